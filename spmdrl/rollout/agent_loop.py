"""Multi-turn, tool-calling rollouts inside the SPMD program: the engine's own loop, driven directly.

One call of :meth:`AgentLoop.run` turns a rank's prompts into ``n`` trajectories each. A trajectory
alternates assistant turns (sampled by the engine) and the turns of a :class:`~spmdrl.rollout.turn_env.TurnEnv`
(spmdrl's tools running the model's ``<tool_call>`` blocks, or a verifiers environment's user and tool
messages), whose messages are appended as observation tokens. The engine
is driven through :class:`~spmdrl.rollout.engine.EngineStepper` (vLLM's ``add_request`` / ``step`` /
``abort_request``), so a trajectory whose tools returned is re-admitted at the next engine step while
the others keep decoding (``scheduler=continuous``); a step then costs about its slowest trajectory,
not the sum over turns of each turn's slowest sample. ``scheduler=turn_barrier`` waits at every turn
for every sample and tool, as ``LLM.generate`` once per turn does (the reference to compare with).

SPMD safety:
- The ranks of one engine (a TP group) run the same scheduler and must make the same calls: the group's
  first rank decides (which turns end, what each tool returned, when to re-admit, the deadline's aborts)
  and broadcasts each engine step's decisions over the group's gloo subgroup; tools and environments run
  once per group, on that rank. Different engines never talk during the rollout, and nothing here touches NCCL.
- ``rollout_deadline_s`` bounds the whole rollout: at the deadline every request still running is
  aborted and every tool still running abandoned; those trajectories end ``deadline`` (truncated,
  counted), so no rank reaches the next collective minutes after the others.

Token exactness: sampled ids are kept as the engine returned them (decoded only to find tool calls);
env messages and turn boundaries come from :class:`~spmdrl.data.turns.TurnCodec` as ids with loss
mask 0. Each turn's prompt is the trajectory so far, so it is a prefix of the final ids. Per-turn
``max_tokens`` is what is left of the response budget (``data.max_response_length``) and of the
context; an env answer that would not leave room for one more sampled token ends the trajectory
(``tool_overflow``) instead of being cut after the fact. The env's messages are kept beside the ids: a
verifiers environment's rubric scores the whole conversation (``TurnEnv.finish``).

Images (a vision-language model): a prompt with images and a tool's image observations keep two forms
of the trajectory (:class:`~spmdrl.data.turns.Observation`): the engine's, one placeholder per image,
sent with every image so far in order (vLLM expands each placeholder itself), and the trainer's, each
image expanded to its tokens, which the generation returns with the observation images' pixel values
(``Generation.images``). The response budget and the context count the expanded tokens.

Reproducibility: every request carries its own seed, mixed from (call seed, engine, prompt, sample,
turn), so how long tools take changes when a turn is admitted, never what it samples (up to the
engine's numerics for different batch compositions).
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import torch.distributed as dist

from spmdrl.data.turns import Observation, TurnCodec
from spmdrl.data.vision import ImageInputs, ImagePrompt
from spmdrl.rollout.config import MultiTurnConfig
from spmdrl.rollout.engine import (
    Generation,
    RolloutEngine,
    SamplingSpec,
    TrajectoryInfo,
    TurnOutput,
    check_prompt_lengths,
    request_seed,
)
from spmdrl.rollout.turn_env import TurnEnv, TurnReply
from spmdrl.tools.executor import truncate_tokens

log = logging.getLogger(__name__)

# An environment that raised, hung past its call's timeout, or rewrote the conversation's earlier
# messages (spmdrl.rollout.vf_turns): the trajectory's reward is charged as failed (rl/samples.py).
ENV_FAILURES = ("env_error", "env_timeout", "env_rewrite")
TERMINATE_REASONS = ("stop", "length", "max_turns", "tool_overflow", "deadline", *ENV_FAILURES)
_TRUNCATED_MARK = "...(truncated)..."


@dataclass
class LoopStats:
    """One rollout's timing on this rank (the metrics are computed by :func:`multi_turn_metrics`)."""

    wall_s: float = 0.0
    engine_idle_s: float = 0.0  # the engine had nothing to run while trajectories waited for tools
    engine_steps: int = 0


@dataclass
class _Trajectory:
    index: int  # position in the engine's (TP group's) list: prompt * n + sample
    prompt: int
    sample: int
    prompt_ids: list[int]
    context: Mapping[str, Any]  # the prompt's extra_info (TurnEnv.open)
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    info: TrajectoryInfo = field(default_factory=TrajectoryInfo)
    user_turns: int = 0
    finished: bool = False
    session: Any = None  # the TurnEnv's, opened at the first answer (deciding rank only)
    messages: list[dict[str, Any]] = field(default_factory=list)  # after the prompt (deciding rank only)
    # A vision-language model's trajectory: the prompt's ImagePrompt, and what the engine takes after it
    # (``ids`` with each observation image as one placeholder) with the images so far; ``pixels``: the
    # observations' images as the trainer takes them.
    image_prompt: ImagePrompt | None = None
    engine_ids: list[int] = field(default_factory=list)
    images: list[Any] = field(default_factory=list)
    pixels: list[ImageInputs] = field(default_factory=list)

    def request_id(self) -> str:
        return f"t{self.index}-{self.info.num_turns}"


# A decision the deciding rank broadcasts: (trajectory index, the observation to append and admit,
# or None to end it, the terminate reason, and the counts the env's turn adds).
_Event = tuple[int, Observation | None, str, dict[str, Any]]


class AgentLoop:
    """Multi-turn rollouts for one rank. Build once per run; :meth:`run` on every rank together."""

    def __init__(
        self,
        cfg: MultiTurnConfig,
        *,
        env: TurnEnv,
        codec: TurnCodec,
        tokenizer: Any,
        max_response_tokens: int,
        max_model_len: int,
    ) -> None:
        self.cfg = cfg
        self.env = env
        self.codec = codec
        self.tokenizer = tokenizer
        self.max_response_tokens = max_response_tokens
        self.max_model_len = max_model_len
        self._mark_ids = list(tokenizer.encode(_TRUNCATED_MARK, add_special_tokens=False))

    # ---- the loop -------------------------------------------------------------------------------------

    def run(
        self,
        engine: RolloutEngine,
        prompts: Sequence[list[int]],
        spec: SamplingSpec,
        contexts: Sequence[Mapping[str, Any]] | None = None,
        images: Sequence[ImagePrompt | None] | None = None,
    ) -> tuple[list[Generation], LoopStats]:
        """``spec.n`` trajectories per prompt of this rank, grouped by prompt in order, as
        :meth:`RolloutEngine.generate` returns them; ``contexts``: each prompt's extra_info (what the env
        opens a trajectory with); ``images``: a vision-language model's prompts (``prompts`` are then
        their expanded ids, ImagePrompt.token_ids). Every rank of the engine calls it together."""
        groups = engine.groups
        kwargs = list(contexts) if contexts is not None else [{}] * len(prompts)
        if len(kwargs) != len(prompts):
            raise ValueError(f"{len(kwargs)} contexts for {len(prompts)} prompts")
        pictures = list(images) if images is not None else [None] * len(prompts)
        if len(pictures) != len(prompts):
            raise ValueError(f"{len(pictures)} image prompts for {len(prompts)} prompts")
        # A prompt's images travel with it to the TP group's other ranks.
        gathered = groups.gather_for_tp(
            [(list(p), k, im) for p, k, im in zip(prompts, kwargs, pictures, strict=True)]
        )
        items = gathered.prompts
        check_prompt_lengths([p for p, _, _ in items], self.max_model_len)
        n = spec.n
        trajs = [
            _Trajectory(i * n + s, i, s, p, k or {}, image_prompt=im)
            for i, (p, k, im) in enumerate(items)
            for s in range(n)
        ]
        leader = groups.tp_rank == 0
        base = spec.seed if spec.seed is not None else 0
        stats = LoopStats()
        t0 = time.monotonic()
        deadline = t0 + self.cfg.rollout_deadline_s if self.cfg.rollout_deadline_s > 0 else None
        pool = cf.ThreadPoolExecutor(max_workers=max(1, min(64, len(trajs))), thread_name_prefix="tools")
        try:
            with engine.stepper() as stepper:
                for t in trajs:
                    self._admit(stepper, t, spec, base, groups.dp_index)
                self._drive(stepper, trajs, spec, base, groups, leader, pool, deadline, stats)
            self._finish_sessions(trajs, groups, leader)
        finally:
            pool.shutdown(wait=False, cancel_futures=True)
            for t in trajs:
                if t.session is not None:
                    self.env.finish(t.session, t.messages)
        stats.wall_s = time.monotonic() - t0
        mine = groups.scatter_from_tp([self._generation(t) for t in trajs], gathered, per_prompt=n)
        return [replace(g, prompt_index=g.prompt_index - gathered.start) for g in mine], stats

    def _drive(
        self,
        stepper: Any,
        trajs: list[_Trajectory],
        spec: SamplingSpec,
        base: int,
        groups: Any,
        leader: bool,
        pool: cf.ThreadPoolExecutor,
        deadline: float | None,
        stats: LoopStats,
    ) -> None:
        by_request: dict[str, _Trajectory] = {}
        for t in trajs:
            by_request[t.request_id()] = t
        in_tools: dict[int, cf.Future[TurnReply]] = {}
        barrier = self.cfg.scheduler == "turn_barrier"
        while True:
            finished: list[TurnOutput] = []
            if stepper.num_unfinished():
                finished = stepper.step()
                stats.engine_steps += 1
            events: list[_Event] = []
            for out in finished:
                t = by_request.pop(out.request_id)
                self._append_turn(t, out)
                if leader:
                    text = self._decode(out.token_ids)
                    t.messages.append({"role": "assistant", "content": text})
                    ended = self._end_reason_after_turn(t, out)
                    if ended is not None:
                        events.append((t.index, None, ended, {}))
                    else:
                        in_tools[t.index] = pool.submit(self._reply, t, text)
            if leader:
                ready = self._ready(in_tools, stepper, barrier, deadline, stats)
                for i in ready:
                    events.append(self._reply_event(trajs[i], in_tools.pop(i).result()))
                if deadline is not None and time.monotonic() >= deadline:
                    pending = {e[0] for e in events}
                    for t in trajs:
                        if not t.finished and t.index not in pending:
                            events.append((t.index, None, "deadline", {}))
                    for i in list(in_tools):
                        in_tools.pop(i).cancel()
            if groups.group is not None:
                box = [events if leader else None]
                dist.broadcast_object_list(box, group_src=0, group=groups.group)
                events = box[0]  # type: ignore[assignment]
            elif not leader:
                raise AssertionError("a rank that is not its engine's first must have a TP group")
            for index, obs, reason, counts in events:
                t = trajs[index]
                self._count(t, counts)
                if obs is None:
                    if reason == "deadline":
                        stepper.abort([t.request_id()])
                        by_request.pop(t.request_id(), None)
                    self._finish(t, reason)
                    continue
                self._append_observation(t, obs)
                self._admit(stepper, t, spec, base, groups.dp_index)
                by_request[t.request_id()] = t
            if all(t.finished for t in trajs):
                return

    def _ready(
        self,
        in_tools: dict[int, cf.Future[TurnReply]],
        stepper: Any,
        barrier: bool,
        deadline: float | None,
        stats: LoopStats,
    ) -> list[int]:
        """The trajectories whose tool turn may be admitted now (deciding rank only)."""
        if not in_tools:
            return []
        engine_busy = stepper.num_unfinished() > 0
        if barrier:
            # A turn starts only when every sample of the previous one and every tool call are done.
            if engine_busy:
                return []
            wait_for = cf.ALL_COMPLETED
        else:
            done = [i for i, f in in_tools.items() if f.done()]
            if done or engine_busy:
                return sorted(done)
            wait_for = cf.FIRST_COMPLETED
        # The engine has nothing to run: wait for tools (bounded by the deadline).
        timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
        t0 = time.monotonic()
        cf.wait(list(in_tools.values()), timeout=timeout, return_when=wait_for)
        stats.engine_idle_s += time.monotonic() - t0
        if barrier and not all(f.done() for f in in_tools.values()):
            return []  # the deadline passed first
        return sorted(i for i, f in in_tools.items() if f.done())

    # ---- one trajectory ---------------------------------------------------------------------------------

    def _admit(self, stepper: Any, t: _Trajectory, spec: SamplingSpec, base: int, dp_index: int) -> None:
        room = self._room(t)
        # A turn may use what is left of the response budget; spec.max_tokens caps a single turn.
        budget = min(room, spec.max_tokens)
        if room < 1:
            self._finish(t, "length")
            return
        seed = request_seed(base, dp_index, t.prompt, t.sample, t.info.num_turns)
        # A turn ends at the template's end-of-turn tokens as well as the eos (a base model's eos is not
        # its chat template's turn end).
        stops = sorted(set(spec.stop_token_ids) | self.codec.end_ids)
        params = replace(spec, n=1, max_tokens=budget, seed=seed, stop_token_ids=stops)
        if t.image_prompt is None and not t.images:
            stepper.add(t.request_id(), t.prompt_ids + t.ids, params)
            return
        # The engine's form: one placeholder per image, every image of the trajectory so far in order.
        prompt = t.image_prompt
        engine_prompt = prompt.engine_ids if prompt is not None else t.prompt_ids
        images = [*(prompt.images if prompt is not None else []), *t.images]
        stepper.add(t.request_id(), engine_prompt + t.engine_ids, params, images=images)

    def _room(self, t: _Trajectory) -> int:
        """Tokens ``t`` may still add: what is left of the response budget and of the context."""
        return min(self.max_response_tokens - len(t.ids), self.max_model_len - len(t.prompt_ids) - len(t.ids))

    def _append_turn(self, t: _Trajectory, out: TurnOutput) -> None:
        t.ids += out.token_ids
        t.engine_ids += out.token_ids  # sampled ids are the same in both forms
        t.logprobs += out.logprobs if out.logprobs else [0.0] * len(out.token_ids)
        t.mask += [1] * len(out.token_ids)
        t.info.num_turns += 1

    def _append_observation(self, t: _Trajectory, obs: Observation) -> None:
        """The env's answer as context (loss mask 0 on every token, an image's expanded tokens too)."""
        t.ids += obs.ids
        t.engine_ids += obs.engine_ids
        t.logprobs += [0.0] * len(obs.ids)
        t.mask += [0] * len(obs.ids)
        t.images += obs.images
        if obs.pixels is not None:
            t.pixels.append(obs.pixels)
        t.info.observation_tokens += len(obs.ids)
        t.info.observation_images += len(obs.images)
        t.user_turns += 1

    def _end_reason_after_turn(self, t: _Trajectory, out: TurnOutput) -> str | None:
        if out.finish_reason == "length":  # cut by the budget, the context or spec.max_tokens
            return "length"
        if t.info.num_turns >= self.cfg.max_assistant_turns:
            return "max_turns"
        return None

    def _decode(self, ids: list[int]) -> str:
        return str(self.tokenizer.decode(ids, skip_special_tokens=True))

    def _reply(self, t: _Trajectory, text: str) -> TurnReply:
        """The env's answer to the turn ``text`` (in a pool thread)."""
        if t.session is None:
            t.session = self.env.open(t.context)
        return self.env.reply(t.session, text)

    def _reply_event(self, t: _Trajectory, reply: TurnReply) -> _Event:
        counts = reply.counts
        if reply.end:
            t.messages += reply.messages  # the env's last words: for the reward, never sampled after
            return (t.index, None, reply.end, counts)
        if t.user_turns >= self.cfg.max_user_turns:
            return (t.index, None, "max_turns", counts)
        messages = [
            {**m, "content": self._cut_content(m["content"])} if m["role"] == "tool" else m
            for m in reply.messages
        ]
        obs = self.codec.observation(messages)
        # The trainer's tokens count (an image's expanded ones): they are what the engine's context holds.
        if len(obs.ids) >= self._room(t):  # not even one sampled token would fit after it
            return (t.index, None, "tool_overflow", counts)
        t.messages += messages
        return (t.index, obs, "", counts)

    def _cut_content(self, content: Any) -> Any:
        """A tool message's content cut to max_tool_response_length tokens: a string, or the text parts of a
        list of parts (its images stay whole: an image's tokens are the processor's, never cut)."""
        if isinstance(content, str):
            return self._cut(content)
        return [{**p, "text": self._cut(p["text"])} if p.get("type") == "text" else p for p in content]

    def _cut(self, text: str) -> str:
        limit = self.cfg.max_tool_response_length
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        if len(ids) <= limit:
            return text
        side = self.cfg.tool_response_truncate_side
        return str(self.tokenizer.decode(truncate_tokens(ids, limit, side, self._mark_ids)))  # type: ignore[arg-type]

    def _count(self, t: _Trajectory, counts: Mapping[str, Any]) -> None:
        info = t.info
        info.tool_calls += int(counts.get("tool_calls", 0))
        info.tool_errors += int(counts.get("tool_errors", 0))
        info.parse_errors += int(counts.get("parse_errors", 0))
        info.timeouts += int(counts.get("timeouts", 0))
        info.tool_reward += float(counts.get("tool_reward", 0.0))
        info.tool_latencies_s += list(counts.get("latencies", []))

    def _finish_sessions(self, trajs: list[_Trajectory], groups: Any, leader: bool) -> None:
        """Ends every env session (deciding rank) and gives each trajectory, on every rank of the engine,
        what its env adds to the reward's extra_info (a verifiers conversation and state)."""
        extras: list[dict[str, Any]] = []
        if leader:
            for t in trajs:
                session, t.session = t.session, None
                extras.append(self.env.finish(session, t.messages) if session is not None else {})
        if groups.group is not None:
            box = [extras if leader else None]
            dist.broadcast_object_list(box, group_src=0, group=groups.group)
            extras = box[0]  # type: ignore[assignment]
        for t, extra in zip(trajs, extras, strict=True):
            t.info.env_extra = extra

    def _finish(self, t: _Trajectory, reason: str) -> None:
        t.finished = True
        t.info.terminate_reason = reason

    def _generation(self, t: _Trajectory) -> Generation:
        # A trajectory cut by its budget, its turn limits or the deadline did not end by the model's own
        # choice: "length", as a single-turn response cut at max_tokens (overlong filters treat it so).
        return Generation(
            prompt_index=t.prompt,
            token_ids=list(t.ids),
            logprobs=list(t.logprobs),
            finish_reason="stop" if t.info.terminate_reason == "stop" else "length",
            loss_mask=list(t.mask),
            trajectory=t.info,
            images=ImageInputs.join(t.pixels) if t.pixels else None,
        )


def multi_turn_metrics(gens: Sequence[Generation], stats: LoopStats) -> dict[str, float]:
    """This rank's multi-turn sums and maxima (prefixed ``multi_turn/``); reduce over ranks with
    :func:`reduce_multi_turn_metrics`."""
    infos = [g.trajectory for g in gens if g.trajectory is not None]
    out: dict[str, float] = {
        "n": float(len(infos)),
        "num_turns": float(sum(i.num_turns for i in infos)),
        "tool_calls": float(sum(i.tool_calls for i in infos)),
        "tool_parse_errors": float(sum(i.parse_errors for i in infos)),
        "tool_timeouts": float(sum(i.timeouts for i in infos)),
        "tool_errors": float(sum(i.tool_errors for i in infos)),
        "env_errors": float(sum(i.terminate_reason in ENV_FAILURES for i in infos)),
        "observation_tokens": float(sum(i.observation_tokens for i in infos)),
        "observation_images": float(sum(i.observation_images for i in infos)),
        "wall_s": stats.wall_s,
        "engine_idle_s": stats.engine_idle_s,
    }
    for r in TERMINATE_REASONS:
        out[f"terminate_reason/{r}"] = float(sum(i.terminate_reason == r for i in infos))
    return out


def tool_latency_p99(gens: Sequence[Generation]) -> float:
    lat = [x for g in gens if g.trajectory is not None for x in g.trajectory.tool_latencies_s]
    return float(np.percentile(lat, 99)) if lat else 0.0
