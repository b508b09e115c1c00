"""The sections of the training loop that no package owns alone: ``trainer`` (steps, batches, token
budgets, checkpoints, the device), ``optim`` (and the optimizers of ``critic`` and ``warmstart``), the PPO
critic and the SFT warm-start stage, with the checks of those values alone. spmdrl.optim builds the
optimizer from an OptimConfig; the recipes and spmdrl.rl read the rest."""

from __future__ import annotations

from dataclasses import dataclass, field

from spmdrl.config_section import SWITCH_MODES, choice, switch_mode
from spmdrl.errors import ConfigError

# trainer.ppo_max_token_len_per_gpu / log_prob_max_token_len_per_gpu: the budget from the card's memory.
AUTO_TOKENS = -1


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

    def check(self, key: str) -> None:
        """``key``: where this section is (optim; critic.optim and warmstart.optim are not checked)."""
        if self.lr <= 0:
            raise ConfigError(f"{key}.lr must be > 0, got {self.lr}")
        if len(self.betas) != 2:
            raise ConfigError(f"{key}.betas must have two values, got {self.betas}")


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
    # verl's name. Validate at step 0 of a run that starts (the curves' first point: the model before
    # training) when validation is on (val_every > 0); false skips that one.
    val_before_train: bool = True
    # verl's name. RL recipes: no training; validate once the checkpoint the run would resume from
    # (trainer.resume: auto, the newest in output_dir; or a path) or, with none, the model as configured,
    # write its val/* metrics and samples into output_dir/val_only/ and exit (docs/checkpointing.md).
    # Needs data.val_files.
    val_only: bool = False
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
    # The dtype of the HF export's weights (output_dir/hf_model): "auto" is the training dtype
    # (model.param_dtype: bfloat16 on CUDA, float32 on CPU; a merged LoRA model float32), "float32" the
    # full-precision master weights. config.json's dtype says which.
    export_dtype: str = choice("auto", ("auto", "float32", "bfloat16", "float16"))
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

    def check(self) -> None:
        """The values alone; the token budgets against the longest sequence, and the async settings against
        parallel.placement, are checked in spmdrl.config.validate."""
        for key, value in {
            "trainer.global_batch_size": self.global_batch_size,
            "trainer.micro_batch_size": self.micro_batch_size,
            "trainer.log_every": self.log_every,
        }.items():
            if value <= 0:
                raise ConfigError(f"{key} must be > 0, got {value}")
        if self.total_epochs <= 0:
            # verl runs validation alone with total_epochs=0 in some scripts; here that is a key of its own.
            raise ConfigError(
                f"trainer.total_epochs must be > 0, got {self.total_epochs}; to run validation only (no "
                "training), set trainer.val_only=true instead"
            )
        if self.total_steps < 0:
            raise ConfigError(
                f"trainer.total_steps must be >= 0 (0 derives it from epochs), got {self.total_steps}"
            )
        if switch_mode(self.defer_grad_sync) not in SWITCH_MODES:
            raise ConfigError(
                f"trainer.defer_grad_sync={self.defer_grad_sync!r} is not one of {', '.join(SWITCH_MODES)}"
            )
        if self.save_every < 0 or self.keep_checkpoints < 1:
            raise ConfigError(
                f"trainer.save_every must be >= 0 and trainer.keep_checkpoints >= 1, got {self.save_every}, "
                f"{self.keep_checkpoints}"
            )
        self._check_token_budgets()
        if self.packed_attention == "varlen" and not self.pack_sequences:
            raise ConfigError(
                "trainer.packed_attention=varlen needs packed micro-batches: set trainer.pack_sequences=true, or "
                "trainer.packed_attention=auto (varlen only where rows are packed)"
            )
        if self.cpu_threads < 0:
            raise ConfigError(
                f"trainer.cpu_threads must be >= 0 (0: cores / ranks on the node), got {self.cpu_threads}"
            )

    def _check_token_budgets(self) -> None:
        """-1 (auto), 0 (sequence counts) or a number of tokens, set under one name only."""
        if self.micro_batch_tokens < 0:
            raise ConfigError(
                f"trainer.micro_batch_tokens must be >= 0 (0: unset), got {self.micro_batch_tokens}; its "
                "replacements are trainer.ppo_max_token_len_per_gpu and trainer.log_prob_max_token_len_per_gpu"
            )
        for key in ("ppo_max_token_len_per_gpu", "log_prob_max_token_len_per_gpu"):
            value = getattr(self, key)
            if value < AUTO_TOKENS:
                raise ConfigError(
                    f"trainer.{key}={value}: use {AUTO_TOKENS} (from the GPU's memory), 0 (micro_batch_size "
                    "sequences) or a number of tokens"
                )
            if value != AUTO_TOKENS and self.micro_batch_tokens > 0:
                raise ConfigError(
                    f"trainer.micro_batch_tokens={self.micro_batch_tokens} and trainer.{key}={value} both set a "
                    "token budget: micro_batch_tokens is the older name of trainer.ppo_max_token_len_per_gpu and "
                    "trainer.log_prob_max_token_len_per_gpu together; set those and drop micro_batch_tokens"
                )
        if self.memory_reserve_gib < 0:
            raise ConfigError(f"trainer.memory_reserve_gib must be >= 0, got {self.memory_reserve_gib}")


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

    def check(self) -> None:
        if self.cliprange_value <= 0 or self.warmup_steps < 0:
            raise ConfigError(
                f"critic.cliprange_value must be > 0 and critic.warmup_steps >= 0, got {self.cliprange_value}, "
                f"{self.warmup_steps}"
            )


@dataclass
class WarmstartConfig:
    """An SFT stage run inside the RL job before RL starts, on data.train_files' response column.

    grpo_tiny uses it to teach the answer format from demonstrations that are right only part of
    the time; RL with a correctness reward does the rest.
    """

    enabled: bool = False
    # What runs the stage: "sft", the library's SFT stage (spmdrl/supervised/sft.py), or a Python file
    # (relative to the recipe YAML, as entry is) whose train_sft(run, cfg, stage) does, a fork's own step.
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


VAL_ONLY_STAGE = "val_only"  # trainer.val_only's sub-directory of the output: its metrics and samples


def check_val_only(trainer: TrainerConfig, val_files: list[str], name: str) -> None:
    """trainer.val_only runs the validation alone: without held-out data there is nothing to run."""
    if trainer.val_only and not val_files:
        raise ConfigError(
            f"trainer.val_only=true runs validation only, on data.val_files, which is empty (recipe "
            f"{name!r}): set data.val_files (e.g. data.val_files=[path/to/test.parquet]), or remove "
            "trainer.val_only"
        )


def refuse_val_only(trainer: TrainerConfig, entry: str, name: str) -> None:
    """For a recipe without a validation-only mode (the reward model): trainer.val_only is refused at
    config load rather than ignored (a job that trains when asked only to evaluate)."""
    if trainer.val_only:
        raise ConfigError(
            f"trainer.val_only=true is not supported by this recipe ({entry}, recipe {name!r}): the RL "
            "recipes (entry: grpo, grpo_async, ppo) and SFT (entry: sft) run validation alone; remove "
            "trainer.val_only"
        )
