"""What a recipe calls to sample responses: the engine's single-turn ``generate``, or, with
``rollout.multi_turn.enable``, the tool-calling agent loop (:mod:`spmdrl.rollout.agent_loop`).

Both return :class:`~spmdrl.rollout.engine.Generation` lists in the same layout, so the rest of a step
(rewards, advantages, the update) does not care which ran; a multi-turn generation carries its loss mask
(0 on tool output) and what happened in it (:class:`~spmdrl.rollout.engine.TrajectoryInfo`).

The job builds its Rollout with :func:`build_rollout`, which passes it through the wrappers a launcher
installed (:func:`wrap_rollouts`): the seam for changing how training generates without touching the
user's config (a benchmark's simulated slow prompts, say: docs/rollout.md#simulated-latency-tail).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch
import torch.distributed as dist

from spmdrl.data.config import DataConfig
from spmdrl.data.prompts import PromptExample
from spmdrl.distributed.reduce import all_reduce_max, all_reduce_min, all_reduce_sum
from spmdrl.envs.load import LoadedEnv
from spmdrl.errors import ConfigError
from spmdrl.rollout.agent_loop import (
    TERMINATE_REASONS,
    AgentLoop,
    LoopStats,
    multi_turn_metrics,
    tool_latency_p99,
)
from spmdrl.rollout.config import RolloutConfig
from spmdrl.rollout.engine import Generation, RolloutEngine, SamplingSpec
from spmdrl.rollout.interruptible import VersionedGenerations, generate_interruptible

log = logging.getLogger(__name__)

# Every key take_multi_turn_metrics returns (parallel.placement=async carries them with the rows).
MULTI_TURN_KEYS = (
    "multi_turn/num_turns",
    "multi_turn/tool_calls",
    "multi_turn/tool_parse_error_rate",
    "multi_turn/tool_timeout_rate",
    "multi_turn/tool_error_rate",
    "multi_turn/env_errors",
    "multi_turn/tool_latency_p99_s",
    "multi_turn/observation_tokens",
    "multi_turn/engine_idle_frac",
    "multi_turn/rank_finish_skew_s",
    "multi_turn/rollout_s",
    *(f"multi_turn/terminate_reason/{r}" for r in TERMINATE_REASONS),
    # Last: the keys before it are what queues saved without their metric names carried
    # (spmdrl.rl.async_rows reads those by count).
    "multi_turn/observation_images",
)


class RolloutSections(Protocol):
    """What the multi-turn set-up below reads of the job's config: a spmdrl.config.Config, which this
    package sits below (spmdrl.config composes the rollout section from spmdrl.rollout.config)."""

    data: DataConfig
    rollout: RolloutConfig


def load_multi_turn_tools(cfg: RolloutSections) -> dict[str, Any]:
    """The tools ``rollout.multi_turn`` names (built-ins, functions, a verl YAML), loaded once at start
    so a bad name or file fails before any model is built."""
    from spmdrl.tools import load_tools

    mt = cfg.rollout.multi_turn
    specs: list[Any] = list(mt.tools)
    if mt.tool_config_path:
        specs.append(mt.tool_config_path)
    tools = load_tools(specs)
    if not tools:
        raise ConfigError("rollout.multi_turn.enable=true but rollout.multi_turn names no tools")
    return tools


def check_image_tools(tools: dict[str, Any], processor: Any) -> None:
    """A tool that says it returns images (``returns_images = True``, as the built-in ``draw_shape``) with
    a text model (no ``processor``): a ConfigError at start naming the tool and the fix; a tool that
    returns one without saying so stops the rollout with the same message (spmdrl.rollout.turn_env)."""
    if processor is not None:
        return
    from spmdrl.rollout.turn_env import tool_image_message

    for name, tool in tools.items():
        if getattr(tool, "returns_images", False):
            raise ConfigError(f"rollout.multi_turn.tools: {tool_image_message(name, None, 'model.path')}")


class Rollout:
    """Samples a step's responses on this rank (every rank of ``group``, the ranks that generate, calls
    :meth:`generate` together; None: the whole world, parallel.placement=async: the rollout ranks)."""

    def __init__(
        self, engine: RolloutEngine, agent: AgentLoop | None = None, *, group: dist.ProcessGroup | None = None
    ) -> None:
        self.engine = engine
        self.agent = agent
        self.group = group  # the multi-turn metrics reduce over it
        self._gens: list[Generation] = []
        self._stats: list[LoopStats] = []

    @property
    def multi_turn(self) -> bool:
        return self.agent is not None

    def generate(
        self, prompts: Sequence[PromptExample], spec: SamplingSpec, *, training: bool = True
    ) -> list[Generation]:
        """This rank's completions of ``prompts``. ``training=False``: a validation call (the same here; a
        wrapper may tell them apart)."""
        ids = [p.prompt_ids for p in prompts]
        vision = any(p.image is not None for p in prompts)  # a VLM: the engine expands the image placeholders
        if self.agent is None:
            if not vision:
                return self.engine.generate(ids, spec)
            engine_ids = [p.image.engine_ids if p.image is not None else p.prompt_ids for p in prompts]
            return self.engine.generate(
                engine_ids, spec, images=[p.image.images if p.image else [] for p in prompts]
            )
        contexts = [p.extra_info if isinstance(p.extra_info, dict) else {} for p in prompts]
        images = [p.image for p in prompts] if vision else None
        gens, stats = self.agent.run(self.engine, ids, spec, contexts, images=images)
        self._gens += gens
        self._stats.append(stats)
        return gens

    def generate_interruptible(
        self,
        prompts: Sequence[PromptExample],
        spec: SamplingSpec,
        *,
        version: int,
        poll: Callable[[], bool],
        switch: Callable[[], int],
        mode: str,
    ) -> VersionedGenerations:
        """A single-turn training call that a weight update may interrupt between engine steps
        (rollout.partial; :func:`spmdrl.rollout.interruptible.generate_interruptible` says how)."""
        ids = [p.prompt_ids for p in prompts]
        return generate_interruptible(
            self.engine, ids, spec, version=version, poll=poll, switch=switch, mode=mode
        )

    def take_wait_seconds(self) -> float:
        """Seconds this rank's training calls spent waiting on something other than the engine since the
        last take (inside the rollout phase): what a wrapper that waits reports (a simulated slow prompt, a
        remote environment). This Rollout never waits: 0. take_metrics takes it too: call one."""
        return 0.0

    def take_metrics(self, device: torch.device) -> dict[str, float]:
        """``multi_turn/*`` over every generating rank's trajectories since the last call (a collective
        over ``group``: each of its ranks calls it; nothing for single-turn rollouts), and ``rollout/wait_s``
        when this rank's calls waited since the last call (:meth:`take_wait_seconds`)."""
        # This rank's own wait, not a reduction: a collective here would add one to the single-turn path
        # (which a recipe may call on some ranks only).
        wait_s = self.take_wait_seconds()
        wait = {"rollout/wait_s": wait_s} if wait_s > 0 else {}
        return {**wait, **self.take_multi_turn_metrics(device)}

    def take_multi_turn_metrics(self, device: torch.device) -> dict[str, float]:
        """``multi_turn/*`` (MULTI_TURN_KEYS) over the trajectories of every rank of ``group`` since the
        last take (a collective over ``group``; nothing, and no collective, for single-turn rollouts)."""
        if self.agent is None:
            return {}
        gens, stats = self._gens, self._stats
        self._gens, self._stats = [], []
        wall = LoopStats(
            wall_s=sum(s.wall_s for s in stats),
            engine_idle_s=sum(s.engine_idle_s for s in stats),
            engine_steps=sum(s.engine_steps for s in stats),
        )
        sums = all_reduce_sum(multi_turn_metrics(gens, wall), device, self.group)
        hi = all_reduce_max({"wall_s": wall.wall_s, "p99": tool_latency_p99(gens)}, device, self.group)
        lo = all_reduce_min({"wall_s": wall.wall_s}, device, self.group)
        n = max(sums["n"], 1.0)
        calls = max(sums["tool_calls"], 1.0)
        out = {
            "multi_turn/num_turns": sums["num_turns"] / n,
            "multi_turn/tool_calls": sums["tool_calls"] / n,
            "multi_turn/tool_parse_error_rate": sums["tool_parse_errors"] / calls,
            "multi_turn/tool_timeout_rate": sums["tool_timeouts"] / calls,
            "multi_turn/tool_error_rate": sums["tool_errors"] / calls,
            # Trajectories whose environment raised, hung or rewrote the conversation (charged as failed
            # rewards), per trajectory.
            "multi_turn/env_errors": sums["env_errors"] / n,
            "multi_turn/tool_latency_p99_s": hi["p99"],
            "multi_turn/observation_tokens": sums["observation_tokens"] / n,
            "multi_turn/observation_images": sums["observation_images"] / n,
            "multi_turn/engine_idle_frac": sums["engine_idle_s"] / max(sums["wall_s"], 1e-9),
            "multi_turn/rank_finish_skew_s": hi["wall_s"] - lo["wall_s"],
            "multi_turn/rollout_s": hi["wall_s"],
        }
        for r in TERMINATE_REASONS:
            out[f"multi_turn/terminate_reason/{r}"] = sums[f"terminate_reason/{r}"] / n
        return out


# What a launcher wraps every job's Rollout in (wrap_rollouts), in order, innermost first.
RolloutWrapper = Callable[[Rollout], Rollout]
_WRAPPERS: list[RolloutWrapper] = []


def wrap_rollouts(wrapper: RolloutWrapper) -> None:
    """From now on, in this process, every Rollout :func:`build_rollout` makes is ``wrapper(rollout)``: for
    a launcher that runs spmdrl.train with training's generation changed (a test's or benchmark's simulated
    latency, docs/rollout.md#simulated-latency-tail), not for recipes (a recipe builds what it wants
    itself). The wrapper returns a Rollout (a subclass that calls the one it wraps, typically)."""
    _WRAPPERS.append(wrapper)


def build_rollout(
    engine: RolloutEngine, agent: AgentLoop | None = None, *, group: dist.ProcessGroup | None = None
) -> Rollout:
    """The job's Rollout over ``engine`` (and ``agent``), wrapped by what :func:`wrap_rollouts` installed."""
    rollout = Rollout(engine, agent, group=group)
    for wrapper in _WRAPPERS:
        rollout = wrapper(rollout)
    return rollout


def build_agent_loop(
    cfg: RolloutSections,
    tokenizer: Any,
    tools: dict[str, Any] | None,
    *,
    max_model_len: int,
    env: LoadedEnv | None = None,
    processor: Any = None,
) -> AgentLoop | None:
    """The agent loop over ``tools``, or over the multi-turn environment ``env`` (env.source), or None for
    single-turn rollouts. Needs no engine: recipes build it at start, so a chat template that cannot
    render tool turns or an unknown parser fails before any model is trained or built;
    ``Rollout(engine, agent)`` joins them later. ``processor``: a vision-language model's
    (spmdrl.models.load.load_processor), whose tools' images become image observations; None for a text
    model, where a tool that returns images is refused (:func:`check_image_tools`)."""
    mt = cfg.rollout.multi_turn
    turns_env = env is not None and env.multi_turn
    if not mt.enable and not turns_env:
        return None
    from spmdrl.data.turns import TurnCodec
    from spmdrl.rollout.turn_env import ToolTurnEnv, TurnEnv
    from spmdrl.tools import ToolExecutor, get_parser, tool_schemas

    turn_env: TurnEnv
    if turns_env:
        from spmdrl.rollout.vf_turns import VfTurnEnv

        assert env is not None
        from spmdrl.rollout.vf_turns import tool_schemas as env_tool_schemas

        turn_env, what = VfTurnEnv(env, call_timeout_s=mt.tool_timeout_s), env.source
        schemas = env_tool_schemas(env)
    else:
        assert tools is not None
        check_image_tools(tools, processor)
        executor = ToolExecutor(
            tools, max_parallel_calls=mt.max_parallel_calls, tool_timeout_s=mt.tool_timeout_s
        )
        turn_env = ToolTurnEnv(executor, get_parser(mt.format), images=processor is not None)
        what = "tools " + ", ".join(tools)
        schemas = tool_schemas(tools)
    agent = AgentLoop(
        mt,
        env=turn_env,
        codec=TurnCodec(tokenizer, tools=schemas, processor=processor),
        tokenizer=tokenizer,
        max_response_tokens=cfg.data.max_response_length,
        max_model_len=max_model_len,
    )
    log.info(
        "multi-turn rollouts: %s, scheduler %s, up to %d assistant turns, deadline %s",
        what,
        mt.scheduler,
        mt.max_assistant_turns,
        f"{mt.rollout_deadline_s:g} s" if mt.rollout_deadline_s > 0 else "none",
    )
    return agent
