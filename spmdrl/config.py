"""Typed configuration: the dataclasses Hydra validates against, and the values derived from them.

Every default lives here, nowhere else (no ``cfg.get(key, default)`` in the code). Values that
follow from others (per-rank batch sizes, gradient-accumulation steps, steps per epoch) are
computed once by :func:`derive` and logged at start; no config object is mutated after that.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, TypeVar

# Field kinds and the recipe sections' registry: spmdrl.config_section (below this module), re-exported.
from spmdrl.config_section import (  # noqa: F401
    CONFIG_SECTIONS,
    SWITCH_MODES,
    choice,
    register_config_section,
    registered,
    registry_names,
    switch_mode,
)

# Defined in spmdrl.errors (importable without this module); every config check raises it, and the rest of
# the code imports it from here.
from spmdrl.errors import ConfigError

# trainer.ppo_max_token_len_per_gpu / log_prob_max_token_len_per_gpu: the budget from the card's memory.
AUTO_TOKENS = -1

# rollout.cpu_gemm's choices (spmdrl.rollout.cpu_gemm says what each is).
CPU_GEMM_PATHS = ("auto", "torch", "onednn", "sgl", "zentorch")


@dataclass
class LoraConfig:
    """LoRA adapters on the actor (docs/models.md#lora): the base weights frozen, only the adapters trained,
    the engine served the merged weights W + (alpha / rank) B A. verl's actor_rollout_ref.model.lora_rank,
    lora_alpha and target_modules."""

    # The adapters' rank r; 0: no LoRA (every weight trains).
    rank: int = 0
    # The adapter output is scaled by alpha / rank.
    alpha: float = 16.0
    # Linear module names (the last part of their path, e.g. q_proj, down_proj), or ["all-linear"]: every
    # linear layer of the decoder (the LM head excluded, as PEFT does).
    target_modules: list[str] = field(default_factory=lambda: ["all-linear"])
    # Dropout on the adapter's input, in every forward of the trained model (its log-prob passes too, as for
    # the model's own dropout): keep 0 for RL, where the trainer's log-probs must match the engine's.
    dropout: float = 0.0

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


@dataclass
class ModelConfig:
    # A local directory with an HF causal LM (config.json + safetensors), a hub id, or "tiny": the
    # built-in deterministic tiny Qwen2 model, built on first use and cached (no network needed).
    path: str = "tiny"
    # Training dtypes (FSDP2 mixed precision). "auto": bfloat16 params on CUDA, float32 on CPU.
    param_dtype: str = choice("auto", ("auto", "float32", "bfloat16", "float16"))
    reduce_dtype: str = choice("float32", ("float32", "bfloat16"))
    # Recompute activations in backward instead of keeping them (memory for compute; docs/performance.md,
    # "Activation checkpointing where memory needs it"): off; full (each checkpointed decoder layer keeps only
    # its input); mlp (only each checkpointed layer's MLP is recomputed: its intermediate activations, the
    # widest a layer keeps, are dropped, attention's kept). true / false: full / off (its former boolean form).
    activation_checkpointing: str = "off"
    # Checkpoint every k-th decoder layer only (the k-th, 2k-th, ...): 1 = every layer.
    activation_checkpointing_every: int = 1
    # torch.compile each decoder block of the trained models (spmdrl.models.parallelize.apply_compile); the
    # frozen reference runs eager. Each new micro-batch shape compiles on first use (docs/performance.md).
    compile: bool = False
    # Host-memory offload (docs/performance.md#memory). offload_params: FSDP2's CPUOffloadPolicy for the
    # trained models (actor, critic): their sharded parameters, gradients and optimizer state live in host
    # memory, each layer's parameters are copied to the GPU for its forward and backward, and AdamW steps on
    # the CPU. offload_optimizer: only the optimizer state, in host memory outside the update phase (implied
    # by offload_params). offload_ref: the frozen reference model's parameters in host memory, streamed to
    # the GPU layer by layer for its log-prob pass (none under LoRA: the reference is the actor with its
    # adapters off). On a CPU trainer the same code runs and moves nothing.
    offload_params: bool = False
    offload_optimizer: bool = False
    offload_ref: bool = False
    # FSDP2's units (spmdrl.models.parallelize.apply_fsdp; docs/performance.md, "One FSDP2 unit on one
    # rank"): layer, one unit per decoder layer plus the root (each layer gathered just before it computes
    # and freed after it); model, the whole model as one unit (one gather per pass: a fraction of the host
    # work per micro-batch, with the whole model's unsharded parameters, and in training their gradients,
    # alive during a pass). auto: model where the model's mesh is one rank and, on a GPU, that unsharded
    # copy (spmdrl.models.memory_model.whole_model_unit) fits in 1/8 of the card; layer otherwise. none: no
    # FSDP2 at all, on a one-rank mesh only (a one-GPU job): the bare module with float32 parameters, its
    # forward under bf16 autocast where param_dtype is bf16, as a one-GPU trainer without a framework runs
    # (TRL); FSDP2's host work per pass (its hooks, the gather's and the reduce's per-tensor bookkeeping)
    # is gone, not moved (spmdrl.models.parallelize.apply_autocast). Not with the offload settings.
    fsdp_unit: str = choice("auto", ("auto", "layer", "model", "none"))
    trust_remote_code: bool = False
    # Where the tiny model and generated data are cached. "": $SPMDRL_CACHE or ~/.cache/spmdrl.
    cache_dir: str = ""
    # LoRA on the actor (rank 0: off). A KL term's reference is then the actor with its adapters off (no
    # model of its own, spmdrl/rl/reference.py); the PPO critic is not adapted: it trains every weight.
    lora: LoraConfig = field(default_factory=LoraConfig)
    # The LM head of the trainer's logprob passes (verl's actor_rollout_ref.model.use_fused_kernels): true
    # computes logprobs, entropy and sum pi^2 fused_chunk_tokens positions at a time, recomputing each
    # chunk's logits in backward (spmdrl/models/fused_logprob.py: memory chunk x V instead of tokens x V);
    # false computes every scored position's logits at once. auto: true where the vocabulary has
    # >= FUSED_AUTO_MIN_VOCAB tokens, on any device; below that the logits are small and the plain head is
    # fewer kernels (no per-chunk loop, no recompute in backward). Either way the head runs on the
    # positions that predict a response token only (docs/performance.md#the-lm-head-on-response-positions).
    use_fused_kernels: str = "auto"
    fused_chunk_tokens: int = 512

    def fused_head_chunk(self, vocab_size: int) -> int:
        """The chunk policy_forward's head runs in for a model of ``vocab_size`` tokens, on any device:
        fused_chunk_tokens when fused, 0 for the plain head."""
        mode = switch_mode(self.use_fused_kernels)
        on = mode == "true" or (mode == "auto" and vocab_size >= FUSED_AUTO_MIN_VOCAB)
        return self.fused_chunk_tokens if on else 0


# model.use_fused_kernels=auto fuses the LM head from this vocabulary size on (Llama 3, Qwen2.5, Gemma all
# have 128k-256k; a plain head on N positions keeps N x V float32 logits and their softmax for backward).
# Below it, on a GPU too, the chunked head only adds launches: at 512 tokens and 64 x 160 positions it ran
# 3.7% more ATen ops per update micro-batch than the plain one (docs/performance.md).
FUSED_AUTO_MIN_VOCAB = 32768


@dataclass
class DataConfig:
    # Parquet files. "tiny:train" / "tiny:test" name the built-in task's generated splits,
    # "tiny_tools:train" / "tiny_tools:test" those of the built-in tool task (their settings: the
    # tiny_task / tools_task sections, spmdrl.data.tiny_task / spmdrl.data.tools_task).
    train_files: list[str] = field(default_factory=lambda: ["tiny:train"])
    val_files: list[str] = field(default_factory=lambda: ["tiny:test"])
    # Column holding the prompt: a list of chat messages (verl's schema) or a plain string.
    prompt_key: str = "prompt"
    # SFT only: column holding the response (a string, or a list of messages whose last is the answer).
    response_key: str = "response"
    max_prompt_length: int = 128
    max_response_length: int = 64
    # What to do with a sample longer than the limits: "filter" (drop it, count logged) or "error".
    overlong: str = choice("filter", ("filter", "error"))
    shuffle: bool = True
    seed: int = 0


@dataclass
class OptimConfig:
    lr: float = 1e-4
    min_lr_ratio: float = 0.0
    weight_decay: float = 0.0
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    eps: float = 1e-8
    # "constant" or "cosine", after a linear warm-up of warmup_steps. The schedule advances once per
    # trainer step (an RL step, however many optimizer steps its mini-batches and epochs take).
    schedule: str = choice("constant", ("constant", "cosine"))
    warmup_steps: int = 0
    grad_clip: float = 1.0
    # A non-finite gradient norm: "stop" the run with an error, or "skip" that optimizer step (verl's
    # behaviour), counted in actor/skipped_updates.
    nonfinite_grad: str = choice("stop", ("stop", "skip"))


@dataclass
class ParallelConfig:
    # "colocated": every role spans every rank and time-shares it (the hybrid engine).
    # "split": the actor (and its reference) trains on the first ranks, the critic on the last
    # critic_ranks ranks, each with its own mesh; every rank still generates (docs/architecture.md).
    # "async" (entry grpo_async, docs/async.md): the last rollout_ranks ranks only generate and score, the
    # first ones only train; generation runs up to trainer.max_staleness batches ahead of the update.
    placement: str = choice("colocated", ("colocated", "split", "async"))
    # split: how many ranks (the last ones) hold the critic; 0 = half the world.
    critic_ranks: int = 0
    # async: how many ranks (the last ones) hold the rollout engines and the reward function; 0 = half.
    rollout_ranks: int = 0
    # Before each update, give every rank of a role the same number of rows and about the same number of
    # tokens (greedy longest-first per mini-batch; spmdrl/distributed/exchange.py). Logged as
    # balance/<role>_token_imbalance (max / mean tokens per rank) with its value before balancing.
    balance_tokens: bool = False
    # HSDP: replicate over dp_replicate groups, shard within each (within each role's ranks).
    # 1 means plain FSDP over the role's ranks.
    dp_replicate: int = 1


@dataclass
class TrainerConfig:
    # Optimizer steps to run. 0: derived from total_epochs and the dataset size.
    total_steps: int = 0
    total_epochs: int = 1
    # Sequences per optimizer step over the whole job (SFT); prompts per step (RL).
    global_batch_size: int = 32
    # Sequences per forward/backward on one rank.
    micro_batch_size: int = 8
    # RL, verl's names: tokens per micro-batch on one GPU (sequences of any count up to this many tokens;
    # every rank of a role runs the same number of micro-batches). ppo_max_token_len_per_gpu: the update's
    # forward + backward (actor and critic); log_prob_max_token_len_per_gpu: the no-grad passes (old and
    # reference logprobs, the critic's values), which keep no activations and so fit more. AUTO_TOKENS (-1):
    # on CUDA from the card's free memory (spmdrl/models/memory_model.py; logged, in derived.json); on CPU
    # the update runs micro_batch_size sequences and the no-grad passes the update's micro-batches. 0:
    # micro_batch_size sequences. N > 0: N tokens, at least the longest sequence (prompt + response).
    ppo_max_token_len_per_gpu: int = AUTO_TOKENS
    log_prob_max_token_len_per_gpu: int = AUTO_TOKENS
    # CUDA, automatic budgets: GiB of the free memory they leave alone (CUDA and NCCL buffers, allocator
    # fragmentation, the engine's sleep-mode residue, the chunked float32 log-softmax temporaries).
    memory_reserve_gib: float = 4.0
    # The older name of one budget for every pass: N > 0 is ppo_max_token_len_per_gpu=N and
    # log_prob_max_token_len_per_gpu=N (with the new keys left at -1). 0: unset.
    micro_batch_tokens: int = 0
    # RL: pack each micro-batch's sequences end to end (padding removed; spmdrl/models/packing.py).
    pack_sequences: bool = False
    # When FSDP2 reduces the gradients of a step's micro-batches, in every trainer (RL, SFT, reward model;
    # spmdrl.models.grad_sync). "false": after every micro-batch's backward. "true": once per optimizer
    # step, after the mini-batch's last micro-batch (set_requires_gradient_sync); until then each rank
    # keeps the unsharded gradients (reduce_dtype, the whole trained model) where "false" keeps its 1/N
    # shard, memory that a sharded model pays.
    # "auto" (the default): true where the model's shard dimension has one rank (one GPU; pure
    # replication) and its shards are not offloaded, whose shard is the whole gradient anyway, so
    # deferring costs no memory; false elsewhere. A boolean means true / false (docs/performance.md).
    defer_grad_sync: str = "auto"
    # How packed rows attend (spmdrl/models/varlen.py): "mask", a block-diagonal (R, 1, C, C) mask through
    # the model's own attention; "varlen", each sequence within its segment with no mask (on CUDA torch's
    # varlen_attn, flash_attn or flex attention where the model's features allow, on CPU an exact reference
    # per segment); "auto", varlen on CUDA where such a kernel exists, mask elsewhere. Needs pack_sequences.
    packed_attention: str = choice("auto", ("auto", "mask", "varlen"))
    val_every: int = 0
    # Write a metrics row (metrics.jsonl, tensorboard, console) every log_every steps; RL also at every
    # validation and at the last step.
    log_every: int = 1
    seed: int = 0
    # "auto" (cuda when available, else cpu), "cpu" or "cuda".
    device: str = choice("auto", ("auto", "cpu", "cuda"))
    # torch's intra-op threads per rank (the trainer's CPU work: everything on a CPU trainer, AdamW on the
    # host under model.offload_params). 0: the cores this process may run on, divided by the ranks on this
    # node (torchrun's OMP_NUM_THREADS=1 for every rank would leave all but one core per rank idle).
    cpu_threads: int = 0
    # "" : outputs/<recipe>/<UTC timestamp>, chosen by rank 0 and broadcast to every rank (a restart under
    # torchrun --max-restarts finds the same directory again).
    output_dir: str = ""
    # Minutes a collective may wait before it fails (a dead peer normally ends the job much sooner).
    collective_timeout_min: float = 10.0
    save_hf: bool = True
    # Save a checkpoint (output_dir/checkpoints/step-<N>) every save_every steps and after the last one;
    # 0: only after the last. keep_checkpoints: how many complete ones to keep (the newest).
    save_every: int = 0
    keep_checkpoints: int = 2
    # Write checkpoints in the background: a save only copies the state to memory, and is published at the
    # next save or at the end (docs/checkpointing.md).
    async_save: bool = False
    # "auto": continue from the newest complete checkpoint in output_dir, if there is one; "off": start
    # over (refused when output_dir already holds a run); or the path of a checkpoint to start from.
    resume: str = "auto"
    # parallel.placement=async (verl's name): a batch is trained at most max_staleness policy versions after
    # the one that generated it; generation runs that many batches ahead of the update (docs/async.md).
    max_staleness: int = 0
    # A row older than max_staleness is never trained on: "drop" masks it out (async/dropped_frac);
    # "regenerate": the rollout ranks generate its batch again on the current weights before sending it
    # (async/regenerated_frac). Only a resume with a smaller max_staleness makes rows that old.
    stale_policy: str = choice("drop", ("drop", "regenerate"))


@dataclass
class LoggingConfig:
    # Where the metrics go besides metrics.jsonl (always written): "tensorboard" (output_dir/tensorboard),
    # "console" (a table in the log every console_every steps), "wandb", "mlflow" (extras of their own;
    # docs/metrics.md). A backend whose package is missing fails at config load, naming its extra.
    backends: list[str] = field(default_factory=lambda: ["tensorboard"])
    # wandb's project and MLflow's experiment (verl's trainer.project_name).
    project: str = "spmdrl"
    # The run's name in wandb and MLflow (verl's trainer.experiment_name); "": <recipe>-<output dir name>.
    experiment: str = ""
    # "": MLFLOW_TRACKING_URI if set, else a file store in output_dir/mlruns (mlflow-skinny is enough).
    mlflow_tracking_uri: str = ""
    progress_bar: bool = True
    console_every: int = 10
    # RL recipes: every this many steps, rank 0 appends samples_per_log completions with their
    # rewards to samples.jsonl (0 turns it off).
    samples_every: int = 10
    samples_per_log: int = 4
    # These training steps (counted from 1, as logged; in an RL job the RL steps, not the warm-start's)
    # run under torch.profiler on every rank, each writing a Chrome trace and a table of the step's phases
    # (host and device time) and of the ops with the most self time to output_dir/profile/step-<N>/
    # (spmdrl/logging/profiler.py; docs/performance.md).
    # Empty: off.
    profile_steps: list[int] = field(default_factory=list)


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
    tool_timeout_s: float = 30.0
    # Seconds a rank's whole rollout may take; unfinished trajectories are then aborted and marked
    # truncated (terminate_reason/deadline). 0: no deadline. Keep it well under collective_timeout_min.
    rollout_deadline_s: float = 0.0
    # "continuous": a trajectory's next turn is admitted as soon as its tools return, while the others
    # decode. "turn_barrier": every turn waits for the slowest sample and tool (TRL's and verl's old way).
    scheduler: str = choice("continuous", ("continuous", "turn_barrier"))


@dataclass
class LatencyTailConfig:
    """A simulated long tail of generation latency, for benchmarks and tests (docs/rollout.md#simulated-
    latency-tail). In each training generate call on each rank, ``prompts`` of the call's prompts are slow:
    the call returns ``seconds`` after the engine is done, as a batched engine waits for its slowest
    request. It models waiting that leaves the generating rank idle (a slow tool call, an environment, a
    remote judge), not compute: the rank sleeps. Validation generations are never slowed. 0 in either: off."""

    # Slow prompts per generate call on each rank (a rank holding fewer: all of them; at most
    # trainer.global_batch_size). Which ones is a seeded choice per call, the same on every run.
    prompts: int = 0
    # Extra seconds the call takes when any of its prompts is slow.
    seconds: float = 0.0


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
    latency_tail: LatencyTailConfig = field(default_factory=LatencyTailConfig)
    # Partial rollouts (parallel.placement=async with trainer.max_staleness >= 1, docs/async.md): a weight
    # update that arrives while a batch is generating interrupts it between engine steps. "continue":
    # the unfinished samples resume on the new weights from the tokens they have (the prefix is
    # recomputed), each token recording the policy version that sampled it; "abort": they restart from
    # the prompt on the new weights. "off": the update waits for the generation to finish (exactly
    # reproducible; with partial rollouts on, where the switch lands depends on timing).
    partial: str = choice("off", ("off", "continue", "abort"))


@dataclass
class KLCtrlConfig:
    """verl's algorithm.kl_ctrl: the coefficient of the KL penalty in the reward."""

    # "fixed" or "adaptive" (moves kl_coef towards target_kl over horizon samples).
    type: str = choice("fixed", registry_names("spmdrl.algos.kl_control", "KL_CTRL_TYPES"))
    kl_coef: float = 0.001
    target_kl: float = 0.1
    horizon: int = 10000


@dataclass
class RolloutCorrectionConfig:
    """verl's algorithm.rollout_correction (spmdrl/algos/correction.py, docs/algorithms.md)."""

    # "": off; "token" or "sequence": importance weights exp(trainer - engine logprob).
    rollout_is: str = choice("", ("", "token", "sequence"))
    # A number U: the weights are truncated at U (TIS). "L_U" (quoted: YAML reads 0.5_5.0 as 0.55):
    # weights outside [L, U] are set to 0 (IcePop). verl's str | float, kept as a string here.
    rollout_is_threshold: str = "2.0"
    rollout_is_batch_normalize: bool = False
    # "": off; comma-joined rejection options (token_k1, seq_mean_k3, ...) and their thresholds.
    rollout_rs: str = ""
    rollout_rs_threshold: str = ""
    # verl's bypass mode: the engine's logprobs are the old policy (no old-logprob pass), and the
    # correction above runs inside the policy loss (policy_loss becomes "bypass_mode") with loss_type
    # "ppo_clip" (PPO's ratio against the rollout policy) or "reinforce" (IS-weighted policy gradient).
    bypass_mode: bool = False
    loss_type: str = choice("ppo_clip", registry_names("spmdrl.algos.correction", "BYPASS_LOSS_TYPES"))

    @property
    def enabled(self) -> bool:
        """Whether the recipe corrects the batch before the update (bypass mode corrects in the loss)."""
        return bool(self.rollout_is or self.rollout_rs) and not self.bypass_mode


@dataclass
class FilterGroupsConfig:
    """DAPO's dynamic sampling (verl: algorithm.filter_groups): drop prompts whose samples all got the
    same ``metric`` (no learning signal) and generate more until every rank has its share."""

    enable: bool = False
    # "reward" (verl 0.9.1's: the reward the advantages start from, overlong penalty included, before any
    # KL penalty), "acc" (reward >= 1), "score" (the reward function's score) or "seq_final_reward"
    # (after shaping, the same as "reward" here: the KL penalty comes later).
    metric: str = choice("reward", ("reward", "acc", "score", "seq_final_reward"))
    # Generation batches per step before giving up with an error; 0: no limit (verl's default; verl 0.9.1
    # ignores a positive value and never gives up, spmdrl stops with an error naming this key).
    max_num_gen_batches: int = 0


@dataclass
class AlgorithmConfig:
    """GRPO / PPO loss settings (defaults follow verl's GSM8K GRPO example)."""

    # verl's name (docs/algorithms.md): grpo, grpo_vectorized, rloo, rloo_vectorized, reinforce_plus_plus,
    # reinforce_plus_plus_baseline, remax (one extra greedy rollout per prompt as the baseline), opo,
    # grpo_passk, gpg, gdpo (gdpo_reward_keys below), optimal_token_baseline, tir_optimal_token_baseline
    # (both add the old-logprob pass, with the sum of squared probabilities); gae needs a critic. Or one
    # of your own, by import path or registered with @register_adv_estimator (docs/algorithms.md).
    adv_estimator: str = registered("grpo", "spmdrl.algos.advantages", "ADV_ESTIMATORS")
    # False gives Dr. GRPO (no division by the group's reward std); verl's norm_adv_by_std_in_grpo.
    norm_adv_by_std: bool = True
    # Discount and GAE lambda (gae, reinforce_plus_plus).
    gamma: float = 1.0
    lam: float = 1.0
    clip_ratio_low: float = 0.2
    clip_ratio_high: float = 0.2
    # "token-mean", "token-sum", "seq-mean-token-mean", "seq-mean-token-sum" or "seq-mean-token-sum-norm"
    # (Dr. GRPO). The policy loss, entropy bonus and KL loss all use it (sapo and geo_mean's policy term
    # excepted: verl reduces it with seq-mean-token-mean).
    loss_agg_mode: str = choice("token-mean", registry_names("spmdrl.algos.aggregation", "AGG_MODES"))
    # seq-mean-token-sum-norm's constant divisor per sequence; 0: data.max_response_length (the width of
    # verl's response mask, its default).
    loss_scale_factor: float = 0.0
    # seq-mean-* modes: the mean is over every row of the mini-batch, a row whose tokens were all masked
    # (rejected by the rollout correction) included, as verl's trainer (global_batch_size = the mini-batch's
    # rows); false: over the rows with a valid token (verl's agg_loss without global_batch_size).
    seq_mean_all_rows: bool = True
    # verl's actor.policy_loss.loss_mode: vanilla (PPO clip + dual-clip), gspo, cispo, gpg, clip_cov,
    # kl_cov, geo_mean, sapo, dppo_tv, dppo_kl, dro, bypass_mode (docs/algorithms.md); and the parameters
    # those read, under verl's names. Or one of your own, by import path or registered with
    # @register_policy_loss (docs/algorithms.md); the loss is called with params=this section.
    policy_loss: str = registered("vanilla", "spmdrl.algos.policy_losses", "POLICY_LOSSES")
    clip_ratio_c: float = 3.0
    clip_cov_ratio: float = 0.0002
    clip_cov_lb: float = 1.0
    clip_cov_ub: float = 5.0
    kl_cov_ratio: float = 0.0002
    ppo_kl_coef: float = 0.1
    tau_pos: float = 1.0
    tau_neg: float = 1.05
    # dro's quadratic log-ratio penalty (verl: actor.policy_loss.dro_beta); must be > 0 for dro.
    dro_beta: float | None = None
    # gdpo: the reward function's extra keys holding the reward components (its returned dict), each
    # normalized within its group on its own, and their weights (None: all 1).
    gdpo_reward_keys: list[str] | None = None
    gdpo_reward_weights: list[float] | None = None
    use_kl_loss: bool = True
    kl_loss_coef: float = 0.001
    # kl/k1, abs, mse/k2, low_var_kl/k3, and each with "+" (its value, k2's gradient).
    # Or one of your own, by import path or registered with @register_kl_estimator (docs/algorithms.md).
    kl_loss_type: str = registered("low_var_kl", "spmdrl.algos.kl", "KL_ESTIMATORS")
    # KL to the reference folded into the reward (verl's use_kl_in_reward), estimator kl_penalty, with a
    # fixed or adaptive coefficient (kl_ctrl).
    use_kl_in_reward: bool = False
    kl_penalty: str = registered("kl", "spmdrl.algos.kl", "KL_ESTIMATORS")
    kl_ctrl: KLCtrlConfig = field(default_factory=lambda: KLCtrlConfig())
    entropy_coeff: float = 0.0
    ppo_epochs: int = 1
    # The old policy's logprobs: auto computes them in a no-grad pass of their own only where the update's
    # own forward is not the old policy (several optimizer steps) or something reads them before the
    # update (rollout correction, the KL in the reward, the optimal token baseline); otherwise the update's
    # first forward, detached, is them (the same numbers, one forward fewer). always: the pass every step,
    # as verl does (outside its rollout-correction bypass mode, where the engine's are the old ones).
    recompute_old_logprobs: str = choice("auto", ("auto", "always"))
    # Prompts per optimizer step over the whole job (each brings rollout.n samples); 0: the whole batch.
    ppo_mini_batch_size: int = 0
    # Importance weights and rejection for the engine-vs-trainer mismatch (verl's rollout correction).
    rollout_correction: RolloutCorrectionConfig = field(default_factory=lambda: RolloutCorrectionConfig())
    filter_groups: FilterGroupsConfig = field(default_factory=lambda: FilterGroupsConfig())


@dataclass
class OverlongBufferConfig:
    """DAPO's overlong reward shaping (verl: reward_model.overlong_buffer): a penalty growing linearly
    over the last ``len`` tokens before data.max_response_length, up to -penalty_factor."""

    enable: bool = False
    len: int = 4
    penalty_factor: float = 1.0


@dataclass
class RewardConfig:
    # "auto" (by data_source), "gsm8k", "tiny", "tiny_tools", a user function "pkg.module:fn" /
    # "path/file.py:fn", or one registered with @register_reward_fn (docs/rewards.md).
    fn: str = registered("auto", "spmdrl.rewards.registry", "REWARD_FNS")
    # Seconds a user function may run per sample; past that it scores error_score (counted in reward/errors).
    timeout_s: float = 10.0
    # Seconds one rank's whole batch may take: samples not scored by then score error_score (counted as
    # timeouts). Must stay below trainer.collective_timeout_min, so a slow reward is named as such
    # instead of surfacing as another rank's collective timeout.
    batch_timeout_s: float = 120.0
    error_score: float = 0.0
    # Stop the run (every rank at once, non-zero exit) when more than this fraction of a step's samples
    # failed to score (raised, returned a bad value, timed out). 1.0: never stop.
    max_error_frac: float = 0.5
    # Limits of each reward worker process (0: unlimited): address space and largest file it may write.
    worker_memory_mb: int = 4096
    worker_file_size_mb: int = 64
    overlong_buffer: OverlongBufferConfig = field(default_factory=lambda: OverlongBufferConfig())
    # The rule reward's weight in a step's training reward when a reward model or judge also scores
    # (reward = rule_weight * rule + reward_model.weight * rm + reward_model.judge.weight * judge;
    # docs/rewards.md#reward-models). Validation's accuracy is always the rule's alone.
    rule_weight: float = 1.0


# The judge's default prompt: the policy is asked for a 0-10 grade; the regex below reads it.
JUDGE_TEMPLATE = (
    "Rate the answer to the question from 0 to 10.\nQuestion: {prompt}\nAnswer: {response}\n"
    "Reply with 'Score: <number>'."
)


@dataclass
class JudgeConfig:
    """A generative reward: an LLM judge served by the run's own engine (spmdrl/rewards/judge.py)."""

    enable: bool = False
    # The judge's model. "": the policy itself, served by the run's in-process engine (the only one
    # supported for now; a separate judge engine is refused at config load).
    path: str = ""
    # Rendered as the user turn of the judge's chat: {prompt} (the sample's prompt, its last user
    # message), {response}, and optionally {ground_truth}.
    template: str = JUDGE_TEMPLATE
    # The score is the regex's first group, as a float, in the judge's reply (its first match). A reply
    # without a match scores reward.error_score and is counted in reward/errors.
    score_regex: str = r"[Ss]core:\s*(-?\d+(?:\.\d+)?)"
    temperature: float = 0.0
    max_tokens: int = 16
    weight: float = 1.0


@dataclass
class RewardModelConfig:
    """A sequence-classification reward model (num_labels=1) scoring every sample, weighted with the rule
    reward (spmdrl/rl/reward_model.py; docs/rewards.md#reward-models). verl's reward_model.enable,
    .model.path (here ``path``), .micro_batch_size_per_gpu and .max_length."""

    enable: bool = False
    # An HF directory of a *ForSequenceClassification model with its tokenizer and chat template (an
    # rm_tiny export, say).
    path: str = ""
    # Sequences per no-grad forward on one rank.
    micro_batch_size_per_gpu: int = 8
    # Tokens of a rendered (prompt, response) the model reads; longer ones keep their end (where the score
    # is read). 0: the model's max_position_embeddings.
    max_length: int = 0
    # Where the reward model lives (the judge always uses the run's own engine, wherever that is).
    # "colocated": every rank holds the model sharded with FSDP2 over the actor's ranks and scores its own
    # samples. "separate": on the rollout ranks of parallel.placement=async (entry grpo_async), sharded
    # over them, next to the engines; refused with any other placement. Under parallel.placement=async the
    # reward model is always there, so "colocated" means the same (docs/rewards.md#reward-models).
    placement: str = choice("colocated", ("colocated", "separate"))
    weight: float = 1.0
    judge: JudgeConfig = field(default_factory=lambda: JudgeConfig())


@dataclass
class CriticConfig:
    """The value model, built and trained when algorithm.adv_estimator needs one (gae: PPO)."""

    # "": the actor's starting weights (its backbone; the value head starts at 0). Or a directory with a
    # causal-LM or critic checkpoint.
    model_path: str = ""
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-5))
    # verl's critic.cliprange_value: a value prediction moves at most this far from the old one per step.
    cliprange_value: float = 0.5
    # verl's trainer.critic_warmup: the first steps train only the critic (the actor waits for values
    # that mean something).
    warmup_steps: int = 0


@dataclass
class WarmstartConfig:
    """An SFT stage run inside the RL job before RL starts, on data.train_files' response column.

    grpo_tiny uses it to teach the answer format from demonstrations that are right only part of
    the time; RL with a correctness reward does the rest.
    """

    enabled: bool = False
    # The recipe whose train_sft(run, cfg, stage) runs the stage: a shipped recipe's name, or a Python file
    # (relative to the recipe YAML, as entry is), so a fork may bring its own SFT step.
    entry: str = "sft"
    total_steps: int = 100
    global_batch_size: int = 64
    micro_batch_size: int = 32
    # With model.lora on: false trains every weight in the warm-start (its export, which RL starts from and
    # adapts, is a full model); true trains the warm-start's own adapters too, merged into that export.
    lora: bool = False
    # The SFT stage's own optimizer and schedule (the RL stage's are optim.*).
    optim: OptimConfig = field(
        default_factory=lambda: OptimConfig(lr=1e-3, schedule="cosine", warmup_steps=10, min_lr_ratio=0.1)
    )


T = TypeVar("T")


def _registered_sections() -> dict[str, Any]:
    return {name: cls() for name, cls in CONFIG_SECTIONS.items()}


@dataclass
class Config:
    # The recipe config's name (what recipe= selected; a recipe YAML given by path: its file name unless
    # it sets name) and what it runs: a shipped recipe module (spmdrl.recipes.<entry>) or a Python file's
    # absolute path (config_loader.import_entry).
    name: str = "sft_tiny"
    entry: str = "sft"
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    warmstart: WarmstartConfig = field(default_factory=WarmstartConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    reward_model: RewardModelConfig = field(default_factory=RewardModelConfig)
    # The registered sections' values (register_config_section), by key. Not a key itself: each section is
    # a top-level key of the YAML and the command line, which the loader adds to the schema it composes.
    sections: dict[str, Any] = field(
        default_factory=_registered_sections, metadata={"omegaconf_ignore": True}
    )

    def section(self, cls: type[T]) -> T:
        """The values of the section ``cls`` is registered as, typed as ``cls`` (no string key to repeat)."""
        name = next((n for n, c in CONFIG_SECTIONS.items() if c is cls), None)
        if name is None:
            raise KeyError(
                f"{cls.__qualname__} is not a registered config section: decorate it with "
                '@register_config_section("my_section")'
            )
        if name not in self.sections:
            raise KeyError(
                f"this Config has no section {name!r}: it was built before {name!r} was registered"
            )
        return self.sections[name]


# model.activation_checkpointing's modes (spmdrl.models.parallelize.apply_ac), and its former booleans.
AC_MODES = ("off", "full", "mlp")
_AC_BOOLEANS = {"true": "full", "false": "off"}


def ac_mode(value: str | bool) -> str:
    """model.activation_checkpointing as one of AC_MODES: true / false (a YAML or command-line boolean, which
    the string field holds as "True" / "False") are full / off."""
    return _AC_BOOLEANS.get(str(value).lower(), str(value))


def _check_choice(key: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ConfigError(f"{key}={value!r} is not one of {', '.join(choices)}")


def _check_registered(key: str, value: str, module: str, registry: str) -> None:
    """``value`` names a function of the registry: a registered name, or an import path that imports and
    takes the kind's arguments (spmdrl.registry.Registry.get raises the ConfigError)."""
    import importlib

    getattr(importlib.import_module(module), registry).get(value, key=key)


def _check_choices(node: Any, prefix: str) -> None:
    for f in dataclasses.fields(node):
        value = getattr(node, f.name)
        if dataclasses.is_dataclass(value):
            _check_choices(value, f"{prefix}{f.name}.")
        elif "choices" in f.metadata:
            choices = f.metadata["choices"]
            _check_choice(f"{prefix}{f.name}", value, choices() if callable(choices) else choices)
        elif "registry" in f.metadata:
            _check_registered(f"{prefix}{f.name}", value, *f.metadata["registry"])


def _validate_multi_turn(cfg: Config) -> None:
    mt = cfg.rollout.multi_turn
    if not mt.enable:
        return
    for key, value in {
        "max_assistant_turns": mt.max_assistant_turns,
        "max_parallel_calls": mt.max_parallel_calls,
        "max_tool_response_length": mt.max_tool_response_length,
        "tool_timeout_s": mt.tool_timeout_s,
    }.items():
        if value <= 0:
            raise ConfigError(f"rollout.multi_turn.{key} must be > 0, got {value}")
    if mt.max_user_turns < 0 or mt.rollout_deadline_s < 0:
        raise ConfigError(
            "rollout.multi_turn.max_user_turns and rollout_deadline_s must be >= 0 (deadline 0: none), got "
            f"{mt.max_user_turns}, {mt.rollout_deadline_s}"
        )
    if not (mt.tools or mt.tool_config_path):
        raise ConfigError(
            "rollout.multi_turn.enable=true needs tools: set rollout.multi_turn.tools (e.g. [calculator]) "
            "or rollout.multi_turn.tool_config_path (a verl tool YAML)"
        )
    limit_s = cfg.trainer.collective_timeout_min * 60
    if mt.rollout_deadline_s >= limit_s or mt.tool_timeout_s >= limit_s:
        raise ConfigError(
            f"rollout.multi_turn.rollout_deadline_s={mt.rollout_deadline_s} and tool_timeout_s={mt.tool_timeout_s} "
            f"must stay below trainer.collective_timeout_min={cfg.trainer.collective_timeout_min} minutes: the "
            "other ranks wait in the next collective while a rank finishes its rollout"
        )


def _validate_latency_tail(cfg: Config) -> None:
    """rollout.latency_tail: no negative values, no more slow prompts than a step has, and a wait the
    other ranks' collectives outlast."""
    tail = cfg.rollout.latency_tail
    if tail.prompts < 0 or tail.seconds < 0:
        raise ConfigError(
            f"rollout.latency_tail.prompts and rollout.latency_tail.seconds must be >= 0 (0: no simulated "
            f"latency tail), got {tail.prompts}, {tail.seconds}"
        )
    if tail.prompts > cfg.trainer.global_batch_size:
        raise ConfigError(
            f"rollout.latency_tail.prompts={tail.prompts} is more than the step's batch "
            f"(trainer.global_batch_size={cfg.trainer.global_batch_size} prompts); it counts slow prompts per "
            "generate call on each rank: lower it"
        )
    limit_s = cfg.trainer.collective_timeout_min * 60
    if tail.seconds >= limit_s:
        raise ConfigError(
            f"rollout.latency_tail.seconds={tail.seconds} must stay below trainer.collective_timeout_min="
            f"{cfg.trainer.collective_timeout_min} minutes: the other ranks wait in a collective while a rank "
            "waits out its slow prompts"
        )


def _validate_parity_tol(cfg: Config) -> None:
    """rollout.parity_tol compares two computations of the same distribution; refuse the settings where the
    engine's logprobs are of another one, so that the gate cannot stop a run that is right."""
    r = cfg.rollout
    if not (math.isfinite(r.parity_tol) and r.parity_tol >= 0):
        raise ConfigError(
            f"rollout.parity_tol must be >= 0 (0: off; e.g. 1e-6 with an fp32 engine), got {r.parity_tol}"
        )
    if r.parity_tol == 0:
        return
    if cfg.trainer.max_staleness > 0:
        raise ConfigError(
            f"rollout.parity_tol={r.parity_tol} compares the trainer's logprobs with the engine's for the same "
            f"weights, but with trainer.max_staleness={cfg.trainer.max_staleness} the engine samples from a policy "
            "up to that many versions old, so they differ by design: set rollout.parity_tol=0, or "
            "trainer.max_staleness=0 for a parity run"
        )
    if r.top_p < 1.0 or r.top_k > 0:
        raise ConfigError(
            f"rollout.parity_tol={r.parity_tol} with rollout.top_p={r.top_p}, rollout.top_k={r.top_k}: the engine "
            "reports logprobs of the truncated, renormalized distribution it samples from, and the trainer of the "
            "full one, so they differ by design (by -log of the kept mass): set rollout.top_p=1.0 and "
            "rollout.top_k=-1 for a parity run, or rollout.parity_tol=0"
        )


def _validate_reward_model(cfg: Config) -> None:
    """reward_model.* and its judge: what is not supported yet, and values that cannot work."""
    import re
    import string

    rm, judge = cfg.reward_model, cfg.reward_model.judge
    if rm.enable and not rm.path:
        raise ConfigError(
            "reward_model.enable=true needs reward_model.path: an HF sequence-classification model directory "
            "(e.g. the hf_model of a recipe=rm_tiny run)"
        )
    placement = cfg.parallel.placement
    if rm.placement == "separate" and (rm.enable or judge.enable) and placement != "async":
        raise ConfigError(
            f"reward_model.placement=separate puts the reward model on the rollout ranks of "
            f"parallel.placement=async, but parallel.placement={placement}: set parallel.placement=async "
            "(entry: grpo_async, as in recipe=grpo_async_tiny), or reward_model.placement=colocated (every "
            "rank holds the reward model sharded with FSDP2 and scores its own samples)"
        )
    if (rm.enable or judge.enable) and placement not in ("colocated", "async"):
        raise ConfigError(
            "reward_model.enable / reward_model.judge.enable need parallel.placement=colocated (every rank "
            "scores the samples it generated) or async (the rollout ranks score); got "
            f"parallel.placement={placement}"
        )
    if rm.micro_batch_size_per_gpu <= 0 or rm.max_length < 0:
        raise ConfigError(
            f"reward_model.micro_batch_size_per_gpu must be > 0 and reward_model.max_length >= 0 (0: the model's "
            f"limit), got {rm.micro_batch_size_per_gpu}, {rm.max_length}"
        )
    if not judge.enable:
        return
    if judge.path:
        raise ConfigError(
            f"reward_model.judge.path={judge.path!r}: a separate judge engine is not supported yet; leave it "
            "empty to judge with the policy's own engine"
        )
    if judge.max_tokens <= 0 or judge.temperature < 0:
        raise ConfigError(
            f"reward_model.judge.max_tokens must be > 0 and temperature >= 0, got {judge.max_tokens}, "
            f"{judge.temperature}"
        )
    try:
        fields = {name for _, name, _, _ in string.Formatter().parse(judge.template) if name is not None}
    except ValueError as e:
        raise ConfigError(f"reward_model.judge.template does not parse as a format string: {e}") from None
    unknown = fields - {"prompt", "response", "ground_truth"}
    if unknown or "response" not in fields:
        raise ConfigError(
            f"reward_model.judge.template must contain {{response}} and may contain {{prompt}} and "
            f"{{ground_truth}} only (double other braces: {{{{ }}}}); it has {sorted(fields)}"
        )
    try:
        groups = re.compile(judge.score_regex).groups
    except re.error as e:
        raise ConfigError(
            f"reward_model.judge.score_regex={judge.score_regex!r} is not a regex: {e}"
        ) from None
    if groups < 1:
        raise ConfigError(
            f"reward_model.judge.score_regex={judge.score_regex!r} needs a group around the number, e.g. "
            r"'Score:\s*(\d+)'"
        )


def max_sequence_length(cfg: Config) -> int:
    """The longest row a pass may see: rollout.max_model_len, or prompt + response."""
    return cfg.rollout.max_model_len or cfg.data.max_prompt_length + cfg.data.max_response_length


def _validate_token_budgets(cfg: Config) -> None:
    """trainer's token budgets: -1 (auto), 0 (sequence counts) or at least one longest sequence."""
    t = cfg.trainer
    if t.micro_batch_tokens < 0:
        raise ConfigError(
            f"trainer.micro_batch_tokens must be >= 0 (0: unset), got {t.micro_batch_tokens}; its "
            "replacements are trainer.ppo_max_token_len_per_gpu and trainer.log_prob_max_token_len_per_gpu"
        )
    longest = max_sequence_length(cfg)
    for key in ("ppo_max_token_len_per_gpu", "log_prob_max_token_len_per_gpu"):
        value = getattr(t, key)
        if value < AUTO_TOKENS:
            raise ConfigError(
                f"trainer.{key}={value}: use {AUTO_TOKENS} (from the GPU's memory), 0 (micro_batch_size "
                "sequences) or a number of tokens"
            )
        if value != AUTO_TOKENS and t.micro_batch_tokens > 0:
            raise ConfigError(
                f"trainer.micro_batch_tokens={t.micro_batch_tokens} and trainer.{key}={value} both set a token "
                "budget: micro_batch_tokens is the older name of trainer.ppo_max_token_len_per_gpu and "
                "trainer.log_prob_max_token_len_per_gpu together; set those and drop micro_batch_tokens"
            )
        if 0 < value < longest:
            raise ConfigError(
                f"trainer.{key}={value} is smaller than one sequence of the longest length, {longest} tokens "
                "(rollout.max_model_len, or data.max_prompt_length + data.max_response_length); set it to at "
                f"least {longest}, {AUTO_TOKENS} to size it from the GPU's memory, or 0 for micro_batch_size "
                "sequences"
            )
    if t.memory_reserve_gib < 0:
        raise ConfigError(f"trainer.memory_reserve_gib must be >= 0, got {t.memory_reserve_gib}")


def _validate_loss_names(a: AlgorithmConfig) -> None:
    """The settings a policy loss or advantage estimator needs (dro's beta, gdpo's reward keys), and the
    ranges of the parameters the policy losses read (spmdrl.algos.policy_losses.PolicyLossParams)."""
    from spmdrl.algos.advantages import adv_estimator

    if a.clip_ratio_low < 0 or a.clip_ratio_high < 0:
        raise ConfigError(
            f"algorithm.clip_ratio_low and clip_ratio_high must be >= 0, got {a.clip_ratio_low}, {a.clip_ratio_high}"
        )
    if a.clip_cov_ratio <= 0 or a.kl_cov_ratio <= 0:
        raise ConfigError(
            f"algorithm.clip_cov_ratio and kl_cov_ratio must be > 0, got {a.clip_cov_ratio}, {a.kl_cov_ratio}"
        )
    if a.tau_pos <= 0 or a.tau_neg <= 0:
        raise ConfigError(f"algorithm.tau_pos and tau_neg must be > 0, got {a.tau_pos}, {a.tau_neg}")
    if a.policy_loss == "dro" and not (a.dro_beta is not None and a.dro_beta > 0):
        raise ConfigError(f"algorithm.policy_loss=dro needs algorithm.dro_beta > 0, got {a.dro_beta}")
    if a.dro_beta is not None and a.dro_beta <= 0:
        raise ConfigError(f"algorithm.dro_beta must be > 0 (or null), got {a.dro_beta}")
    if adv_estimator(a.adv_estimator).needs_sum_pi_squared and a.rollout_correction.bypass_mode:
        raise ConfigError(
            f"algorithm.adv_estimator={a.adv_estimator} reads the old policy's sum of squared probabilities, "
            "from the old-logprob pass that algorithm.rollout_correction.bypass_mode skips (verl fails too)"
        )
    if a.adv_estimator in ("grpo_vectorized", "gdpo") and not a.norm_adv_by_std:
        # verl 0.9.1's trainer hands norm_adv_by_std_in_grpo to grpo only: these two always divide by the
        # group's std there, and here. A setting that would be silently ignored is an error instead.
        raise ConfigError(
            f"algorithm.norm_adv_by_std=false has no effect on adv_estimator={a.adv_estimator} (verl 0.9.1 "
            "ignores it too: it always divides by the group's std): use adv_estimator=grpo for Dr. GRPO's "
            "r - mean, or keep norm_adv_by_std=true"
        )
    if a.adv_estimator == "gdpo" and not a.gdpo_reward_keys:
        raise ConfigError(
            "algorithm.adv_estimator=gdpo needs algorithm.gdpo_reward_keys: the keys of the reward "
            "components the reward function returns in its dict (e.g. [format_reward, accuracy_reward])"
        )
    keys, weights = a.gdpo_reward_keys or [], a.gdpo_reward_weights
    if weights is not None and len(weights) != len(keys):
        raise ConfigError(
            f"algorithm.gdpo_reward_weights has {len(weights)} weights for {len(keys)} gdpo_reward_keys"
        )


def _validate_lora(lora: LoraConfig) -> None:
    """The values alone; target module names are checked against the model (spmdrl.models.lora)."""
    if lora.rank < 0:
        raise ConfigError(f"model.lora.rank must be >= 0 (0: LoRA off), got {lora.rank}")
    if not lora.enabled:
        return
    if lora.alpha <= 0:
        raise ConfigError(
            f"model.lora.alpha must be > 0 (the adapter is scaled by alpha / rank), got {lora.alpha}"
        )
    if not 0.0 <= lora.dropout < 1.0:
        raise ConfigError(f"model.lora.dropout must be in [0, 1), got {lora.dropout}")
    if not lora.target_modules:
        raise ConfigError(
            "model.lora.target_modules is empty; name linear modules (q_proj, v_proj, ...) or use [all-linear]"
        )


def validate(cfg: Config) -> None:
    """Checks that need no world size. Raises ConfigError naming the key."""
    _check_choices(cfg, "")
    for name, section in cfg.sections.items():  # the recipes' own sections (register_config_section)
        _check_choices(section, f"{name}.")
    positive = {
        "trainer.global_batch_size": cfg.trainer.global_batch_size,
        "trainer.micro_batch_size": cfg.trainer.micro_batch_size,
        "trainer.total_epochs": cfg.trainer.total_epochs,
        "trainer.log_every": cfg.trainer.log_every,
        "data.max_prompt_length": cfg.data.max_prompt_length,
        "data.max_response_length": cfg.data.max_response_length,
        "parallel.dp_replicate": cfg.parallel.dp_replicate,
        "optim.lr": cfg.optim.lr,
    }
    for key, value in positive.items():
        if value <= 0:
            raise ConfigError(f"{key} must be > 0, got {value}")
    if cfg.rollout.kv_cache_tokens < -1:
        raise ConfigError(
            f"rollout.kv_cache_tokens must be a number of tokens, 0 (sized from rollout."
            f"gpu_memory_utilization on CUDA, rollout.cpu_kvcache_gib on CPU) or -1 (rollout.max_num_seqs "
            f"whole sequences), got {cfg.rollout.kv_cache_tokens}"
        )
    _validate_lora(cfg.model.lora)
    if ac_mode(cfg.model.activation_checkpointing) not in AC_MODES:
        raise ConfigError(
            f"model.activation_checkpointing={cfg.model.activation_checkpointing!r} is not one of "
            f"{', '.join(AC_MODES)} (or true / false, which mean full / off)"
        )
    if cfg.model.activation_checkpointing_every < 1:
        raise ConfigError(
            f"model.activation_checkpointing_every must be >= 1 (1: every decoder layer, k: every k-th), got "
            f"{cfg.model.activation_checkpointing_every}"
        )
    for key, value in (
        ("model.use_fused_kernels", cfg.model.use_fused_kernels),
        ("trainer.defer_grad_sync", cfg.trainer.defer_grad_sync),
    ):
        if switch_mode(value) not in SWITCH_MODES:
            raise ConfigError(f"{key}={value!r} is not one of {', '.join(SWITCH_MODES)}")
    offloads = [k for k in ("offload_params", "offload_optimizer", "offload_ref") if getattr(cfg.model, k)]
    if cfg.model.fsdp_unit == "none" and offloads:
        raise ConfigError(
            f"model.fsdp_unit=none (no FSDP2) keeps each model whole on its device, but "
            f"{', '.join(f'model.{k}' for k in offloads)} is set: host-memory offload is FSDP2's; use "
            "model.fsdp_unit=auto with it"
        )
    if cfg.model.fused_chunk_tokens < 1:
        raise ConfigError(
            f"model.fused_chunk_tokens must be >= 1 (positions per chunk of the fused LM head), got "
            f"{cfg.model.fused_chunk_tokens}"
        )
    from spmdrl.logging.backends import check_backends  # light: no torch, no tracker import

    check_backends(list(cfg.logging.backends))
    if cfg.trainer.save_every < 0 or cfg.trainer.keep_checkpoints < 1:
        raise ConfigError(
            f"trainer.save_every must be >= 0 and trainer.keep_checkpoints >= 1, got {cfg.trainer.save_every}, "
            f"{cfg.trainer.keep_checkpoints}"
        )
    if cfg.reward.batch_timeout_s >= cfg.trainer.collective_timeout_min * 60:
        raise ConfigError(
            f"reward.batch_timeout_s={cfg.reward.batch_timeout_s} must stay below trainer.collective_timeout_min="
            f"{cfg.trainer.collective_timeout_min} minutes: the other ranks wait in a collective while a rank "
            "scores, and a slow reward must be named as such, not as a collective timeout"
        )
    if not 0.0 <= cfg.reward.max_error_frac <= 1.0:
        raise ConfigError(f"reward.max_error_frac must be in [0, 1], got {cfg.reward.max_error_frac}")
    finite = {
        "reward.error_score": cfg.reward.error_score,
        "reward.rule_weight": cfg.reward.rule_weight,
        "reward_model.weight": cfg.reward_model.weight,
        "reward_model.judge.weight": cfg.reward_model.judge.weight,
    }
    for key, value in finite.items():
        if not math.isfinite(
            value
        ):  # it would make every reward it touches NaN or inf, caught only at step 1
            raise ConfigError(f"{key} must be a finite number, got {value}")
    _validate_token_budgets(cfg)
    if cfg.trainer.packed_attention == "varlen" and not cfg.trainer.pack_sequences:
        raise ConfigError(
            "trainer.packed_attention=varlen needs packed micro-batches: set trainer.pack_sequences=true, or "
            "trainer.packed_attention=auto (varlen only where rows are packed)"
        )
    if cfg.parallel.rollout_ranks < 0 or cfg.trainer.max_staleness < 0:
        raise ConfigError(
            f"parallel.rollout_ranks (0 = half the world) and trainer.max_staleness must be >= 0, got "
            f"{cfg.parallel.rollout_ranks} and {cfg.trainer.max_staleness}"
        )
    if cfg.trainer.max_staleness > 0 and cfg.parallel.placement != "async":
        raise ConfigError(
            f"trainer.max_staleness={cfg.trainer.max_staleness} applies to parallel.placement=async only (entry "
            f"grpo_async, recipe=grpo_async_tiny); with parallel.placement={cfg.parallel.placement} every batch is "
            "generated by the policy it trains: set trainer.max_staleness=0"
        )
    if cfg.trainer.stale_policy != "drop" and cfg.parallel.placement != "async":
        raise ConfigError(
            f"trainer.stale_policy={cfg.trainer.stale_policy} applies to parallel.placement=async only; with "
            f"parallel.placement={cfg.parallel.placement} no batch is ever stale: remove the setting"
        )
    if cfg.rollout.partial != "off" and (cfg.parallel.placement != "async" or cfg.trainer.max_staleness < 1):
        raise ConfigError(
            f"rollout.partial={cfg.rollout.partial} interrupts a generation when the next weights arrive, which "
            "happens only with parallel.placement=async and trainer.max_staleness >= 1 (got "
            f"parallel.placement={cfg.parallel.placement}, trainer.max_staleness={cfg.trainer.max_staleness}): "
            "set rollout.partial=off, or run recipe=grpo_async_tiny with trainer.max_staleness >= 1"
        )
    _validate_parity_tol(cfg)
    if cfg.rollout.partial != "off" and cfg.rollout.multi_turn.enable:
        raise ConfigError(
            f"rollout.partial={cfg.rollout.partial} interrupts single-turn generations only; multi-turn "
            "rollouts (rollout.multi_turn.enable=true) finish on the weights they started with: set "
            "rollout.partial=off"
        )
    if cfg.parallel.critic_ranks < 0:
        raise ConfigError(
            f"parallel.critic_ranks must be >= 0 (0 = half the world), got {cfg.parallel.critic_ranks}"
        )
    if cfg.trainer.total_steps < 0:
        raise ConfigError(
            f"trainer.total_steps must be >= 0 (0 derives it from epochs), got {cfg.trainer.total_steps}"
        )
    if len(cfg.optim.betas) != 2:
        raise ConfigError(f"optim.betas must have two values, got {cfg.optim.betas}")
    if cfg.critic.cliprange_value <= 0 or cfg.critic.warmup_steps < 0:
        raise ConfigError(
            f"critic.cliprange_value must be > 0 and critic.warmup_steps >= 0, got {cfg.critic.cliprange_value}, "
            f"{cfg.critic.warmup_steps}"
        )
    if not (0.0 <= cfg.algorithm.gamma <= 1.0 and 0.0 <= cfg.algorithm.lam <= 1.0):
        raise ConfigError(
            f"algorithm.gamma and algorithm.lam must be in [0, 1], got {cfg.algorithm.gamma}, {cfg.algorithm.lam}"
        )

    if cfg.algorithm.loss_scale_factor < 0:
        raise ConfigError(f"algorithm.loss_scale_factor must be >= 0, got {cfg.algorithm.loss_scale_factor}")

    ob = cfg.reward.overlong_buffer
    if ob.enable and not (0 < ob.len <= cfg.data.max_response_length and ob.penalty_factor >= 0):
        raise ConfigError(
            f"reward.overlong_buffer.len={ob.len} must be in (0, data.max_response_length="
            f"{cfg.data.max_response_length}] and penalty_factor={ob.penalty_factor} >= 0"
        )
    rc = cfg.algorithm.rollout_correction
    from spmdrl.algos.correction import parse_is_threshold

    try:
        parse_is_threshold(rc.rollout_is_threshold)
    except ValueError as e:
        raise ConfigError(f"algorithm.rollout_correction: {e}") from None
    if rc.bypass_mode and cfg.algorithm.policy_loss not in ("vanilla", "bypass_mode"):
        raise ConfigError(
            f"algorithm.rollout_correction.bypass_mode=true runs the bypass_mode policy loss (its loss_type="
            f"{rc.loss_type!r}) in place of algorithm.policy_loss={cfg.algorithm.policy_loss!r}, which verl "
            "would ignore; set algorithm.policy_loss=vanilla or turn bypass_mode off"
        )
    _validate_loss_names(cfg.algorithm)
    if rc.rollout_rs:
        from spmdrl.algos.correction import parse_rs_thresholds

        if not rc.rollout_rs_threshold:
            raise ConfigError("algorithm.rollout_correction.rollout_rs needs rollout_rs_threshold")
        try:
            parse_rs_thresholds(
                [o.strip() for o in rc.rollout_rs.split(",") if o.strip()], rc.rollout_rs_threshold
            )
        except ValueError as e:
            raise ConfigError(f"algorithm.rollout_correction: {e}") from None
    if cfg.algorithm.clip_ratio_c <= 1.0:
        raise ConfigError(
            f"algorithm.clip_ratio_c must be > 1 (dual-clip bound), got {cfg.algorithm.clip_ratio_c}"
        )
    if not 0.0 <= cfg.rollout.weight_sync_check_tol < 1.0:
        raise ConfigError(
            f"rollout.weight_sync_check_tol must be in [0, 1), got {cfg.rollout.weight_sync_check_tol}"
        )
    for key, value in {
        "rollout.tp": cfg.rollout.tp,
        "rollout.n": cfg.rollout.n,
        "algorithm.ppo_epochs": cfg.algorithm.ppo_epochs,
        "reward.timeout_s": cfg.reward.timeout_s,
    }.items():
        if value <= 0:
            raise ConfigError(f"{key} must be > 0, got {value}")
    if cfg.trainer.cpu_threads < 0:
        raise ConfigError(
            f"trainer.cpu_threads must be >= 0 (0: cores / ranks on the node), got {cfg.trainer.cpu_threads}"
        )
    if cfg.rollout.temperature < 0 or cfg.rollout.val_temperature < 0:
        raise ConfigError("rollout.temperature and rollout.val_temperature must be >= 0 (0 is greedy)")
    _validate_multi_turn(cfg)
    _validate_latency_tail(cfg)
    _validate_reward_model(cfg)
    if cfg.algorithm.ppo_mini_batch_size < 0:
        raise ConfigError("algorithm.ppo_mini_batch_size must be >= 0 (0: the whole batch)")


@dataclass(frozen=True)
class Derived:
    """Values computed from the config, the world and the data; computed once, logged, never changed."""

    world_size: int
    dp_size: int
    per_rank_batch_size: int
    # trainer.micro_batch_size, or the whole per-rank batch when that is smaller.
    micro_batch_size: int
    grad_accum_steps: int
    steps_per_epoch: int
    total_steps: int

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def derive(cfg: Config, world_size: int, num_train_samples: int, *, samples_per_item: int = 1) -> Derived:
    """Per-rank batch, accumulation steps and step counts.

    ``samples_per_item`` is how many training sequences one dataset item becomes (1 for SFT,
    the rollout n for GRPO); the batch sizes here are counted in dataset items.
    """
    t = cfg.trainer
    dp_size = world_size  # every rank is a data-parallel rank (FSDP / HSDP over the world)
    if t.global_batch_size % dp_size:
        raise ConfigError(
            f"trainer.global_batch_size={t.global_batch_size} is not divisible by the data-parallel size "
            f"{dp_size} (world size {world_size}); pick a multiple of {dp_size}"
        )
    per_rank = t.global_batch_size // dp_size
    per_rank_seqs = per_rank * samples_per_item
    # A micro-batch larger than a rank's batch means the whole batch (the same setting then works on
    # more ranks).
    micro = min(t.micro_batch_size, per_rank_seqs)
    if per_rank_seqs % micro:
        raise ConfigError(
            f"trainer.micro_batch_size={t.micro_batch_size} must divide the per-rank batch of {per_rank_seqs} "
            f"sequences (global_batch_size {t.global_batch_size} / {dp_size} ranks"
            + (f" x {samples_per_item} samples each" if samples_per_item > 1 else "")
            + ")"
        )
    steps_per_epoch = num_train_samples // t.global_batch_size
    if steps_per_epoch == 0:
        raise ConfigError(
            f"the training set has {num_train_samples} samples, fewer than one global batch "
            f"(trainer.global_batch_size={t.global_batch_size}); lower the batch size or add data"
        )
    total = t.total_steps if t.total_steps > 0 else steps_per_epoch * t.total_epochs
    return Derived(
        world_size=world_size,
        dp_size=dp_size,
        per_rank_batch_size=per_rank,
        micro_batch_size=micro,
        grad_accum_steps=per_rank_seqs // micro,
        steps_per_epoch=steps_per_epoch,
        total_steps=total,
    )


@dataclass(frozen=True)
class RLDerived:
    """GRPO's batch arithmetic on top of :class:`Derived` (counts in sequences unless named prompts)."""

    samples_per_prompt: int
    # Ranks the role trains on (its data-parallel size).
    train_ranks: int
    mini_batches_per_step: int
    per_rank_mini_batch_seqs: int
    # trainer.micro_batch_size, or the whole per-rank mini-batch when that is smaller.
    micro_batch_size: int
    micro_batches_per_mini_batch: int
    # Micro-batches accumulated per optimizer step (overrides Derived's count, which assumes one
    # optimizer step per trainer step), and optimizer steps per RL step (mini-batches x PPO epochs).
    grad_accum_steps: int
    optimizer_steps_per_step: int
    max_model_len: int
    # Tokens per micro-batch of the update and of the no-grad passes (trainer.ppo_max_token_len_per_gpu,
    # trainer.log_prob_max_token_len_per_gpu, resolved); 0: micro_batch_size sequences. With a budget the
    # two counts above are those of sequence-count micro-batches, not the number each step runs.
    ppo_max_token_len: int = 0
    log_prob_max_token_len: int = 0

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _resolve_budget(value: int, legacy: int, measured: int | None, otherwise: int) -> int:
    """A token budget key's value: itself when set; at AUTO_TOKENS the older micro_batch_tokens when set,
    else the budget from the GPU's memory when there is one, else ``otherwise``."""
    if value != AUTO_TOKENS:
        return value
    if legacy > 0:
        return legacy
    return measured if measured is not None else otherwise


def derive_rl(
    cfg: Config,
    derived: Derived,
    *,
    train_ranks: int = 0,
    role: str = "actor",
    memory_budgets: tuple[int, int] | None = None,
) -> RLDerived:
    """The update's batch arithmetic for a role trained on ``train_ranks`` ranks (0: every rank, each
    training on the rollouts it generated; under a split placement rows move, so only sequence counts
    must divide). ``memory_budgets``: the (update, no-grad) token budgets the GPU's free memory allows
    (spmdrl/rl/token_budgets.py), for the keys at AUTO_TOKENS; None (CPU): those keep sequence counts."""
    n = cfg.rollout.n
    mini_prompts = cfg.algorithm.ppo_mini_batch_size or cfg.trainer.global_batch_size
    if cfg.trainer.global_batch_size % mini_prompts:
        raise ConfigError(
            f"algorithm.ppo_mini_batch_size={mini_prompts} must divide trainer.global_batch_size="
            f"{cfg.trainer.global_batch_size} (both count prompts)"
        )
    ranks = train_ranks or derived.dp_size
    if not train_ranks and mini_prompts % ranks:
        raise ConfigError(
            f"algorithm.ppo_mini_batch_size={mini_prompts} is not divisible by the data-parallel size {ranks}"
        )
    if train_ranks and (mini_prompts * n) % ranks:
        raise ConfigError(
            f"the {role}'s mini-batch of {mini_prompts * n} sequences (algorithm.ppo_mini_batch_size="
            f"{mini_prompts} x rollout.n={n}) does not split evenly over its {ranks} ranks "
            f"(parallel.placement=split); change the batch size or parallel.critic_ranks"
        )
    per_rank_mini = mini_prompts * n // ranks
    micro = min(cfg.trainer.micro_batch_size, per_rank_mini)  # larger: the whole mini-batch
    if per_rank_mini % micro:
        raise ConfigError(
            f"trainer.micro_batch_size={cfg.trainer.micro_batch_size} must divide the {role}'s per-rank "
            f"mini-batch of {per_rank_mini} sequences ({mini_prompts} prompts x rollout.n={n} / {ranks} ranks)"
        )
    if derived.world_size % cfg.rollout.tp:
        raise ConfigError(f"rollout.tp={cfg.rollout.tp} must divide the world size {derived.world_size}")
    max_len = max_sequence_length(cfg)
    if max_len < cfg.data.max_prompt_length + 1:
        raise ConfigError(
            f"rollout.max_model_len={max_len} leaves no room for a response after data.max_prompt_length"
        )
    t = cfg.trainer
    measured_train, measured_no_grad = memory_budgets if memory_budgets is not None else (None, None)
    train_tokens = _resolve_budget(t.ppo_max_token_len_per_gpu, t.micro_batch_tokens, measured_train, 0)
    # Without a budget of their own (CPU, auto), the no-grad passes run the update's micro-batches.
    no_grad_tokens = _resolve_budget(
        t.log_prob_max_token_len_per_gpu, t.micro_batch_tokens, measured_no_grad, train_tokens
    )
    return RLDerived(
        samples_per_prompt=n,
        train_ranks=ranks,
        mini_batches_per_step=cfg.trainer.global_batch_size // mini_prompts,
        per_rank_mini_batch_seqs=per_rank_mini,
        micro_batch_size=micro,
        micro_batches_per_mini_batch=per_rank_mini // micro,
        grad_accum_steps=per_rank_mini // micro,
        optimizer_steps_per_step=cfg.trainer.global_batch_size // mini_prompts * cfg.algorithm.ppo_epochs,
        max_model_len=max_len,
        ppo_max_token_len=train_tokens,
        log_prob_max_token_len=no_grad_tokens,
    )
