"""Values computed from the config, the world and the data: the per-rank batch, accumulation steps and step
counts (:func:`derive`), and the RL update's batch arithmetic on top (:func:`derive_rl`). Computed once,
logged at start and written to derived.json; no config object is mutated.

spmdrl.config re-exports these (``from spmdrl.config import derive``), so this module does not import it:
it reads the sections it needs from any object that has them (:class:`Sections`; a Config has them all).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Protocol

from spmdrl.algos.config import AlgorithmConfig
from spmdrl.data.config import DataConfig
from spmdrl.errors import ConfigError
from spmdrl.rollout.config import RolloutConfig
from spmdrl.trainer_config import AUTO_TOKENS, TrainerConfig


class Sections(Protocol):
    """The sections the batch arithmetic reads: a spmdrl.config.Config, or any object with these."""

    data: DataConfig
    trainer: TrainerConfig
    rollout: RolloutConfig
    algorithm: AlgorithmConfig


def max_sequence_length(cfg: Sections) -> int:
    """The longest row a pass may see: rollout.max_model_len, or prompt + response."""
    return cfg.rollout.max_model_len or cfg.data.max_prompt_length + cfg.data.max_response_length


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


def derive(cfg: Sections, world_size: int, num_train_samples: int, *, samples_per_item: int = 1) -> Derived:
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
    cfg: Sections,
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
