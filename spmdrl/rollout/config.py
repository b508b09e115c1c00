"""The ``rollout`` section: the in-process generation engine, its sampling settings and multi-turn
rollouts, and the checks of those values alone (spmdrl.config.validate checks them against the other
sections: the trainer's timeouts and staleness, the placement)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from spmdrl.config_section import choice, registry_names
from spmdrl.errors import ConfigError

# rollout.cpu_gemm's choices (spmdrl.rollout.cpu_gemm says what each is).
CPU_GEMM_PATHS = ("auto", "torch", "onednn", "sgl", "zentorch")


@dataclass
class MultiTurnConfig:
    """Multi-turn, tool-calling rollouts (spmdrl.rollout.agent_loop; docs/multi_turn.md). verl's names
    where verl has the setting."""

    enable: bool = False
    # Assistant turns (engine generations) per trajectory, and tool (user) turns between them.
    max_assistant_turns: int = 5
    max_user_turns: int = 5
    # Tool calls of one turn running at once (the rest of the turn's calls wait for a slot).
    max_parallel_calls: int = 4
    # Tokens of one tool response the model reads; longer ones are cut at tool_response_truncate_side.
    max_tool_response_length: int = 256
    tool_response_truncate_side: str = choice("middle", ("left", "right", "middle"))
    # A verl tool YAML file (tools: [{class_name, config, tool_schema}]).
    tool_config_path: str = ""
    # Tools by name ("calculator", "python") or import path ("pkg.mod:fn", "file.py:fn"), beside the YAML's.
    tools: list[str] = field(default_factory=list)
    # The tool-call format the model writes: "hermes", or a parser's import path.
    format: str = "hermes"
    # Seconds one tool call may take (create + execute + release); then the model reads a timeout error.
    # With a multi-turn env.source: one call of the environment's (its trajectory then ends env_timeout).
    tool_timeout_s: float = 30.0
    # Seconds a rank's whole rollout may take; unfinished trajectories are then aborted and marked
    # truncated (terminate_reason/deadline). 0: no deadline. Keep it well under collective_timeout_min.
    rollout_deadline_s: float = 0.0
    # "continuous": a trajectory's next turn is admitted as soon as its tools return, while the others
    # decode. "turn_barrier": every turn waits for the slowest sample and tool (TRL's and verl's old way).
    scheduler: str = choice("continuous", ("continuous", "turn_barrier"))

    def check(self) -> None:
        if not self.enable:
            return
        for key, value in {
            "max_assistant_turns": self.max_assistant_turns,
            "max_parallel_calls": self.max_parallel_calls,
            "max_tool_response_length": self.max_tool_response_length,
            "tool_timeout_s": self.tool_timeout_s,
        }.items():
            if value <= 0:
                raise ConfigError(f"rollout.multi_turn.{key} must be > 0, got {value}")
        if self.max_user_turns < 0 or self.rollout_deadline_s < 0:
            raise ConfigError(
                "rollout.multi_turn.max_user_turns and rollout_deadline_s must be >= 0 (deadline 0: none), got "
                f"{self.max_user_turns}, {self.rollout_deadline_s}"
            )
        if not (self.tools or self.tool_config_path):
            raise ConfigError(
                "rollout.multi_turn.enable=true needs tools: set rollout.multi_turn.tools (e.g. [calculator]) "
                "or rollout.multi_turn.tool_config_path (a verl tool YAML)"
            )


@dataclass
class RolloutConfig:
    """The in-process generation engine (vLLM) and its sampling settings."""

    engine: str = choice("vllm", registry_names("spmdrl.rollout.engine", "ENGINES"))
    # Tensor-parallel size: consecutive ranks form one engine (tp=2: ranks {0,1}, {2,3}, ...).
    tp: int = 1
    # CUDA: fraction of GPU memory vLLM may take (weights + KV cache). CPU: see cpu_kvcache_gib.
    gpu_memory_utilization: float = 0.5
    cpu_kvcache_gib: float = 1.0
    # The KV cache's size in tokens per engine, on any device. 0: what gpu_memory_utilization leaves
    # (CUDA) or cpu_kvcache_gib (CPU); -1: room for max_num_seqs whole sequences (max_num_seqs x
    # max_model_len, the most the engine runs at once; on CUDA only where that is well below what memory
    # gives); N: N tokens. Prefix-cache KV does not outlive a weight sync, and a larger cache costs every
    # sync's prefix-cache reset (vLLM walks every block) and every wake and sleep
    # (docs/rollout.md#the-kv-caches-size).
    kv_cache_tokens: int = 0
    # 0: max_prompt_length + max_response_length.
    max_model_len: int = 0
    max_num_seqs: int = 256
    enable_prefix_caching: bool = True
    # CUDA graphs speed up decoding on GPUs; the CPU backend always runs eagerly.
    enforce_eager: bool = False
    # The engine's weight dtype. "auto": bfloat16 on CUDA; on CPU bfloat16 where the CPU has native bf16
    # matmuls (AVX512-BF16 or AMX) and float32 elsewhere (there bf16 runs ~4-5x slower than fp32).
    dtype: str = choice("auto", ("auto", "bfloat16", "float16", "float32"))
    # The engine's online quantization (verl's rollout.quantization): the trainer's weights arrive in its
    # own precision and vLLM quantizes them at every sync. "fp8" (CUDA: per-tensor fp8 weights, dynamic
    # fp8 activations) or "none". Needs a 16-bit rollout.dtype. The mismatch it adds is what
    # algorithm.rollout_correction absorbs (docs/rollout.md#low-precision-rollout); on a CPU, where vLLM
    # has no fp8 kernels, the lower-precision engine is rollout.dtype=bfloat16 (spmdrl.rollout.quantization).
    quantization: str = choice("none", ("none", "fp8"))
    # CPU only: vLLM's GEMM path for linear layers. "auto": vLLM's choice for this CPU; "torch" (reads
    # the weights directly), "onednn", "sgl" (bf16) or "zentorch" (needs the zentorch package) force one.
    # Every path is correct after a weight sync (docs/rollout.md); forcing one is for tests and for
    # routing around a path that misbehaves on some CPU.
    cpu_gemm: str = choice("auto", CPU_GEMM_PATHS)
    # CUDA only: release the KV cache and weights while training (vLLM sleep mode).
    free_cache_engine: bool = True
    # CUDA only: vLLM's model runner. "auto": vLLM's choice (VLLM_USE_V2_MODEL_RUNNER if set; vLLM 0.32 takes
    # V2, 0.24 V2 only for some architectures, not Qwen2). "v2" / "v1" force one. V1 samples a request
    # that has its own seed (spmdrl's default: seed_per_request) with a Python loop over requests at every decode
    # step; V2 draws the whole batch's noise at once (docs/rollout.md#gpu-model-runner-v2).
    model_runner: str = choice("auto", ("auto", "v1", "v2"))
    # true: every request carries a seed of its own (from the call's seed, the engine and the prompt), so a
    # sample does not depend on what else was batched with it. false: requests carry none, and the
    # engine's sampler draws from its device's RNG, seeded from the same values at every generate call:
    # runs stay reproducible, samples depend on their batch, and vLLM V1 no longer draws each request's
    # noise one by one (docs/rollout.md#seeds-per-request-or-per-call).
    seed_per_request: bool = True
    # Weight sync gathers the actor's shards in buckets of about this many MB (one all-gather each).
    weight_sync_bucket_mb: float = 32.0
    # How the engine takes the synced weights. "direct": the model's own load_weights writes each tensor
    # into the live parameter the kernels read (what verl does); "reload": vLLM's in-place reload puts each
    # layer on the meta device, materializes it, loads, re-processes and copies it into the kernels'
    # tensors (needed where a kernel computes from a packed copy: vLLM's CPU GEMM paths but "torch").
    # "auto": direct where every linear layer reads its parameter (CUDA, unquantized; CPU on the torch
    # path), else reload. The per-sync check proves either (docs/rollout.md); under auto, a direct load
    # it rejects is repeated with reload, which the run then keeps.
    weight_load: str = choice("auto", ("auto", "direct", "reload"))
    # After every sync, prove the engine's kernels return exactly the weights just sent (one-hot probes
    # through every layer, compared with the trainer's tensors; spmdrl/rollout/fingerprint.py). A
    # mismatch stops the run. The cost is a few small matmuls per layer.
    weight_sync_check: bool = True
    # Allowed difference relative to the probed weights' magnitude. Exact kernels agree to float64
    # rounding (~1e-14); one optimizer step at lr 1e-6 moves the probed sums by ~1e-7 or more.
    weight_sync_check_tol: float = 1e-9
    # Trainer/engine parity gate: stop the run when a step's mean |trainer - engine| logprob of the sampled
    # tokens (mismatch/logprob_abs_diff_mean, measured before the update) exceeds this. 0: off. An fp32
    # engine and an fp32 trainer agree to ~3e-7 on CPU (docs/rollout.md#trainerengine-parity), so 1e-6 is a
    # gate for a smoke run; a bf16 engine differs by ~1e-3 from any trainer, by rounding alone.
    parity_tol: float = 0.0
    # Samples per prompt (the GRPO group size).
    n: int = 5
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    stop: list[str] = field(default_factory=list)
    # Validation decoding: greedy, one sample.
    val_temperature: float = 0.0
    seed: int = 0
    multi_turn: MultiTurnConfig = field(default_factory=MultiTurnConfig)
    # Partial rollouts (parallel.placement=async with trainer.max_staleness >= 1, docs/async.md): a weight
    # update that arrives while a batch is generating interrupts it between engine steps. "continue":
    # the unfinished samples resume on the new weights from the tokens they have (the prefix is
    # recomputed), each token recording the policy version that sampled it; "abort": they restart from
    # the prompt on the new weights. "off": the update waits for the generation to finish (exactly
    # reproducible; with partial rollouts on, where the switch lands depends on timing).
    partial: str = choice("off", ("off", "continue", "abort"))

    def check(self) -> None:
        if self.kv_cache_tokens < -1:
            raise ConfigError(
                f"rollout.kv_cache_tokens must be a number of tokens, 0 (sized from rollout."
                f"gpu_memory_utilization on CUDA, rollout.cpu_kvcache_gib on CPU) or -1 (rollout.max_num_seqs "
                f"whole sequences), got {self.kv_cache_tokens}"
            )
        self._check_parity_tol()
        if self.partial != "off" and self.multi_turn.enable:
            raise ConfigError(
                f"rollout.partial={self.partial} interrupts single-turn generations only; multi-turn "
                "rollouts (rollout.multi_turn.enable=true) finish on the weights they started with: set "
                "rollout.partial=off"
            )
        if not 0.0 <= self.weight_sync_check_tol < 1.0:
            raise ConfigError(
                f"rollout.weight_sync_check_tol must be in [0, 1), got {self.weight_sync_check_tol}"
            )
        for key, value in {"rollout.tp": self.tp, "rollout.n": self.n}.items():
            if value <= 0:
                raise ConfigError(f"{key} must be > 0, got {value}")
        if self.temperature < 0 or self.val_temperature < 0:
            raise ConfigError("rollout.temperature and rollout.val_temperature must be >= 0 (0 is greedy)")
        self.multi_turn.check()

    def _check_parity_tol(self) -> None:
        """rollout.parity_tol compares two computations of the same distribution; refuse the settings where
        the engine's logprobs are of another one, so that the gate cannot stop a run that is right (an
        engine behind the trainer is refused in spmdrl.config.validate, with trainer.max_staleness)."""
        if not (math.isfinite(self.parity_tol) and self.parity_tol >= 0):
            raise ConfigError(
                f"rollout.parity_tol must be >= 0 (0: off; e.g. 1e-6 with an fp32 engine), got {self.parity_tol}"
            )
        if self.parity_tol != 0 and (self.top_p < 1.0 or self.top_k > 0):
            raise ConfigError(
                f"rollout.parity_tol={self.parity_tol} with rollout.top_p={self.top_p}, rollout.top_k={self.top_k}: "
                "the engine reports logprobs of the truncated, renormalized distribution it samples from, and the "
                "trainer of the full one, so they differ by design (by -log of the kept mass): set "
                "rollout.top_p=1.0 and rollout.top_k=-1 for a parity run, or rollout.parity_tol=0"
            )
