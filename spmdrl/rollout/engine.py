"""The rollout engine interface: what a recipe may ask of a generation backend.

A recipe sees only :class:`RolloutEngine`; vLLM is one implementation (:mod:`spmdrl.rollout.vllm_engine`)
and a second backend (SGLang, say) is a new module plus one branch in :func:`build_engine`, without
touching recipes. Every rank builds the engine and calls every method (one SPMD program): an engine
that spans several ranks (tensor parallelism) needs all of them in each call. ``build_engine(ranks=...)``
builds it on a block of ranks only; the others get None.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, overload, runtime_checkable

import numpy as np
import torch

from spmdrl.errors import ConfigError
from spmdrl.rollout.config import RolloutConfig
from spmdrl.rollout.fingerprint import Fingerprint
from spmdrl.rollout.groups import TPGroups

ENGINES = ("vllm",)


@dataclass(frozen=True)
class SamplingSpec:
    """How to sample. ``temperature == 0`` is greedy decoding (then ``n`` must be 1)."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_tokens: int = 64
    stop: list[str] = field(default_factory=list)
    # Token ids that end a sample besides the eos (multi-turn: the template's end-of-turn tokens).
    stop_token_ids: list[int] = field(default_factory=list)
    # None: the engine derives per-request seeds from its own call counter (reproducible for one run).
    # Pass a value derived from the step (cfg.seed, step) to make sampling reproducible across resumes.
    seed: int | None = None
    logprobs: bool = True

    def __post_init__(self) -> None:
        if self.n < 1:
            raise ValueError(f"SamplingSpec.n must be >= 1, got {self.n}")
        if self.temperature < 0:
            raise ValueError(f"SamplingSpec.temperature must be >= 0 (0 is greedy), got {self.temperature}")
        if self.temperature == 0 and self.n > 1:
            raise ValueError(
                f"SamplingSpec: greedy decoding (temperature=0) gives {self.n} identical samples; use n=1"
            )
        if self.max_tokens < 1:
            raise ValueError(f"SamplingSpec.max_tokens must be >= 1, got {self.max_tokens}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"SamplingSpec.top_p must be in (0, 1], got {self.top_p}")
        if self.top_k == 0 or self.top_k < -1:
            raise ValueError(f"SamplingSpec.top_k must be -1 (off) or >= 1, got {self.top_k}")

    @classmethod
    def for_training(cls, cfg: RolloutConfig, max_tokens: int, seed: int | None = None) -> SamplingSpec:
        return cls(
            n=cfg.n,
            temperature=cfg.temperature,
            top_p=cfg.top_p,
            top_k=cfg.top_k,
            max_tokens=max_tokens,
            stop=list(cfg.stop),
            seed=seed,
        )

    @classmethod
    def for_validation(cls, cfg: RolloutConfig, max_tokens: int, seed: int | None = None) -> SamplingSpec:
        """One sample per prompt at ``val_temperature`` (greedy by default)."""
        return cls(
            n=1, temperature=cfg.val_temperature, max_tokens=max_tokens, stop=list(cfg.stop), seed=seed
        )


@dataclass
class TrajectoryInfo:
    """What happened in one multi-turn trajectory (spmdrl.rollout.agent_loop), for rewards and metrics."""

    num_turns: int = 0  # assistant turns sampled
    tool_calls: int = 0  # calls the parser found (well-formed or not)
    tool_errors: int = 0  # calls that ran and raised, or were invalid (unknown tool, bad arguments)
    parse_errors: int = 0
    timeouts: int = 0
    observation_tokens: int = 0  # mask-0 tokens between the turns (an image's as the trainer sees them)
    observation_images: int = 0  # images the env's messages added (a vision-language model's tools)
    # stop (the model answered without a call, or the environment ended the conversation), length (the
    # response budget or the context ran out), max_turns (max_assistant_turns / max_user_turns reached),
    # tool_overflow (an env answer did not fit the remaining budget), deadline (aborted at
    # rollout_deadline_s), env_error / env_timeout / env_rewrite (the environment raised, hung, or
    # rewrote earlier messages: spmdrl.rollout.vf_turns).
    terminate_reason: str = "stop"
    tool_reward: float = 0.0  # the sum of the tools' step rewards
    tool_latencies_s: list[float] = field(default_factory=list)
    # What the turns' env adds to the reward's extra_info (a verifiers environment: env_completion, the
    # conversation after the prompt, and env_state; spmdrl.rollout.turn_env.TurnEnv.finish).
    env_extra: dict[str, Any] = field(default_factory=dict)

    def as_extra_info(self) -> dict[str, Any]:
        """What a reward function sees in ``extra_info``: the counts (verl: num_turns; here also tool use)
        and the env's additions."""
        return {
            "num_turns": self.num_turns,
            "tool_calls": self.tool_calls,
            "tool_errors": self.tool_errors,
            "tool_parse_errors": self.parse_errors,
            "tool_timeouts": self.timeouts,
            "terminate_reason": self.terminate_reason,
            **self.env_extra,
        }


@dataclass
class Generation:
    """One sampled completion. ``n`` samples of prompt i are ``n`` Generations with ``prompt_index == i``."""

    prompt_index: int
    token_ids: list[int]
    # The engine's log-probability of each sampled token, under the distribution it sampled from
    # (after temperature and top-k/top-p); empty when SamplingSpec.logprobs is False. 0.0 at mask-0
    # positions of a multi-turn trajectory.
    logprobs: list[float]
    # "stop" (eos or a stop string) or "length" (max_tokens or the context limit reached; a multi-turn
    # trajectory cut by its budget, its turn limits or the deadline).
    finish_reason: str
    # Multi-turn: 1 where the engine sampled the token (the loss sees it), 0 for tool output and turn
    # boundaries. None: every token was sampled.
    loss_mask: list[int] | None = None
    trajectory: TrajectoryInfo | None = None
    # rollout.partial (spmdrl/rollout/interruptible.py): per token, the policy version whose weights
    # sampled it, and whether a weight switch landed while the sample was unfinished. None / False: every
    # token is the version that started the generation's.
    versions: list[int] | None = None
    interrupted: bool = False
    # Router replay (model.router_replay=r3): the experts the engine routed each position of prompt +
    # response through, (positions, MoE layers, k) int16, -1 where none (the last sampled token is never
    # run through the model). None when not asked for (build_engine(routed_experts=True)).
    routed_experts: Any = None
    # A multi-turn trajectory of a vision-language model: the images its tools returned, in order, as the
    # trainer's forward takes them (one row of spmdrl.data.vision.ImageInputs; the row's prompt images come
    # first). None when none.
    images: Any = None


@dataclass
class TurnOutput:
    """A finished request of an :class:`EngineStepper`: one assistant turn."""

    request_id: str
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str  # "stop" or "length"


class EngineStepper(Protocol):
    """The engine's own loop, driven request by request (multi-turn rollouts). Every rank of one engine
    (TP group) must make the same calls in the same order; ranks of different engines need not."""

    def add(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingSpec,
        *,
        track_partial: bool = False,
        images: Sequence[Any] = (),
    ) -> None:
        """Queue one request (``params.n`` must be 1; ``params.seed`` is the request's own seed).
        ``track_partial``: keep what it has sampled so far readable through :meth:`partial`. ``images``: a
        vision-language model's images (PIL), one per placeholder in ``prompt_ids``, in order."""
        ...

    def partial(self, request_id: str) -> TurnOutput | None:
        """What an unfinished request added with ``track_partial`` has sampled as of the last step (its
        ``finish_reason`` is ""), None before its first token. Read it before aborting the request."""
        ...

    def step(self) -> list[TurnOutput]:
        """One engine step (a batch of decode/prefill work); the requests that finished in it."""
        ...

    def abort(self, request_ids: list[str]) -> None: ...

    def num_unfinished(self) -> int: ...


@dataclass(frozen=True)
class LoadSeconds:
    """Where an engine's load_weights spent its time, for the sync's timing metrics."""

    wake: float = 0.0  # taking the weights' device memory back (CUDA sleep mode; 0 where it never sleeps)
    load: float = 0.0  # the reload, which pulls the trainer's gathered buckets as it goes (lazy)
    prefix_cache_reset: float = 0.0  # dropping KV blocks computed with the old weights


def check_prompt_lengths(prompts: list[list[int]], max_model_len: int) -> None:
    """Every prompt of an engine's batch must leave room for one sampled token. Called on a TP group's
    gathered prompts, so every rank of the group raises together (not one rank while the others wait
    in the engine)."""
    for i, p in enumerate(prompts):
        if not p or len(p) >= max_model_len:
            raise ValueError(
                f"a prompt in this engine's batch (index {i}) has {len(p)} tokens; the engine takes "
                f"1..{max_model_len - 1} (max_model_len={max_model_len}): raise "
                "rollout.max_model_len or filter long prompts (data.max_prompt_length)"
            )


def request_seed(base: int, *keys: int) -> int:
    """A well-mixed 31-bit seed per (call seed, keys...): the engine, the prompt (and, multi-turn, the
    sample and the turn). vLLM adds 0..n-1 for a request's n samples."""
    state = np.random.SeedSequence((base & 0xFFFFFFFF, *keys)).generate_state(1)[0]
    return int(state) & 0x3FFFFFFF


@runtime_checkable
class RolloutEngine(Protocol):
    """A generation engine living inside this rank's process. Every rank calls every method."""

    # The dtype the engine keeps its weights in; weight sync casts to it before the transfer.
    dtype: torch.dtype
    # Which ranks share this engine (tensor parallelism) and this engine's data-parallel index.
    groups: TPGroups
    # How load_weights writes the weights: "direct" or "reload" (rollout.weight_load, resolved). The sync
    # sets it to "reload" when a direct load fails the check under auto (weight_sync.sync_with_fallback).
    weight_load: str

    def generate(
        self, prompts: list[list[int]], params: SamplingSpec, images: list[list[Any]] | None = None
    ) -> list[Generation]:
        """Completions of this rank's prompts, ``params.n`` per prompt, grouped by prompt in order.
        ``images``: a vision-language model's images (PIL) for each prompt, whose token ids hold one
        placeholder per image, which the engine expands (spmdrl.data.vision.ImagePrompt)."""
        ...

    def stepper(self) -> contextlib.AbstractContextManager[EngineStepper]:
        """The engine's request-level loop, for multi-turn rollouts (spmdrl.rollout.agent_loop). Requests
        still unfinished when the context exits are aborted."""
        ...

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> LoadSeconds:
        """Replace the weights in place from (HF checkpoint name, full tensor) pairs, consumed once, lazily;
        returns where the time went."""
        ...

    def weight_fingerprint(self, seed: int) -> Fingerprint:
        """The weights as the engine's kernels compute with them, reduced over the engine's ranks
        (spmdrl.rollout.fingerprint); compared with the trainer's after each sync."""
        ...

    def sleep(self, *, keep_weights: bool = True) -> None:
        """Release device memory (KV cache, weights) while the trainer runs; a no-op where unsupported.

        ``keep_weights=False`` promises that the next call is ``load_weights``: the engine may then
        discard its weights instead of keeping a copy, and ``generate`` raises until they are loaded.
        """
        ...

    def wake_up(self) -> None:
        """Take the memory back; generate and load_weights also wake the parts they need."""
        ...

    def close(self) -> None:
        """Tear the engine down, leaving the trainer's process groups intact. Call before destroying them."""
        ...


def check_model_runner(cfg: RolloutConfig, device_type: str) -> None:
    """rollout.model_runner other than auto: CUDA only (vLLM's CPU backend has one model runner)."""
    if cfg.model_runner != "auto" and device_type != "cuda":
        raise ConfigError(
            f"rollout.model_runner={cfg.model_runner} chooses between vLLM's CUDA model runners; vLLM's "
            f"{device_type.upper()} backend has one: set rollout.model_runner=auto"
        )


def check_engine_config(cfg: RolloutConfig, device_type: str) -> None:
    """What can be checked about the engine without building it: the installed release, a
    rollout.quantization this device cannot run (spmdrl.rollout.quantization), and a forced CPU GEMM path
    this machine cannot run (for the engine dtype the config resolves to). Recipes call it first, so a bad setting fails before any
    training (the warm-start, say) instead of at the engine's build."""
    if cfg.engine != "vllm":
        raise ConfigError(f"rollout.engine={cfg.engine!r} is not one of {', '.join(ENGINES)}")
    from spmdrl.rollout.vllm_version import require_supported_vllm

    require_supported_vllm()
    check_model_runner(cfg, device_type)
    from spmdrl.rollout.quantization import check_quantization
    from spmdrl.rollout.vllm_plan import resolve_engine_dtype

    engine_dtype = resolve_engine_dtype(cfg.dtype, device_type)
    check_quantization(cfg.quantization, str(engine_dtype).removeprefix("torch."), device_type)
    if device_type == "cpu":
        from spmdrl.rollout.cpu_gemm import check_available

        check_available(cfg.cpu_gemm, engine_dtype)
        if cfg.weight_load == "direct" and cfg.cpu_gemm != "torch":
            raise ConfigError(
                "rollout.weight_load=direct on CPU needs rollout.cpu_gemm=torch: the other CPU GEMM paths "
                "compute from packed copies of the weights, which only rollout.weight_load=reload rebuilds"
            )


# rollout.kv_cache_tokens: room for max_num_seqs whole sequences.
KV_CACHE_SEQUENCES = -1


def check_kv_cache_tokens(tokens: int, max_model_len: int) -> None:
    """A cache that cannot hold one whole sequence is refused by vLLM only once the engine is built."""
    if 0 < tokens < max_model_len:
        raise ConfigError(
            f"rollout.kv_cache_tokens={tokens} cannot hold one sequence of max_model_len={max_model_len} "
            "(data.max_prompt_length + data.max_response_length, or rollout.max_model_len): raise it to at "
            "least that, times the sequences the engine should run at once; or set 0 to size the cache "
            "from memory, or -1 for rollout.max_num_seqs whole sequences"
        )


def check_kv_cache_fits(
    model_dir: Path, cfg: RolloutConfig, max_model_len: int, device_type: str, engines_on_node: int
) -> None:
    """The engine's KV cache against the memory it would live in, before anything expensive runs
    (the engine's own check; only vLLM is registered)."""
    from spmdrl.rollout.vllm_plan import check_kv_cache_fits as check

    check(model_dir, cfg, max_model_len, device_type, engines_on_node)


@overload
def build_engine(
    model_dir: Path,
    cfg: RolloutConfig,
    *,
    max_model_len: int,
    device_type: str,
    ranks: None = None,
    routed_experts: bool = False,
) -> RolloutEngine: ...


@overload
def build_engine(
    model_dir: Path,
    cfg: RolloutConfig,
    *,
    max_model_len: int,
    device_type: str,
    ranks: list[int],
    routed_experts: bool = False,
) -> RolloutEngine | None: ...


def build_engine(
    model_dir: Path,
    cfg: RolloutConfig,
    *,
    max_model_len: int,
    device_type: str,
    ranks: list[int] | None = None,
    routed_experts: bool = False,
) -> RolloutEngine | None:
    """The engine ``cfg.engine`` names. ``routed_experts``: each generation carries the experts the engine
    routed its tokens through (router replay; Generation.routed_experts). Every rank of the world calls this together, at the same point.

    ``ranks`` None: built on every rank. Otherwise built on those ranks only (a block of consecutive
    ranks, a multiple of ``cfg.tp`` long), which vLLM then takes for its whole world
    (:mod:`spmdrl.rollout.engine_ranks`); the other ranks get None, import nothing of vLLM, and take part
    only in creating the process groups.
    """
    if cfg.engine != "vllm":
        raise ConfigError(f"rollout.engine={cfg.engine!r} is not one of {', '.join(ENGINES)}")
    from spmdrl.rollout.engine_ranks import EngineWorld
    from spmdrl.rollout.groups import engine_tp_groups, new_tp_subgroups

    world = EngineWorld.create(ranks, cfg.tp)
    engine: RolloutEngine | None = None
    if world.holds_engine:
        from spmdrl.rollout.vllm_process import isolated_rng

        # vLLM's imports draw from Python's random too (rich.style's getrandbits at import, before the
        # engine's own isolated build): none of the trainer's random streams move.
        with isolated_rng(device_type):
            from spmdrl.rollout.vllm_engine import VLLMEngine

            engine = VLLMEngine(
                model_dir,
                cfg,
                max_model_len=max_model_len,
                device_type=device_type,
                world=world,
                routed_experts=routed_experts,
            )
    else:  # the engines' TP groups, which the engine ranks create in VLLMEngine's TPGroups
        new_tp_subgroups(engine_tp_groups(cfg.tp, world.ranks))
    world.agree_group_names()
    return engine
