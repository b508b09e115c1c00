"""The token budgets of an RL job's micro-batches on a GPU, from the memory the card has.

trainer.ppo_max_token_len_per_gpu and trainer.log_prob_max_token_len_per_gpu at AUTO_TOKENS (-1, the
default) become, on CUDA, the tokens that fit in the card's free memory by the memory model
(spmdrl/models/memory_model.py). The free memory is measured once, at start, before any model or the engine
is allocated, as the least over all ranks (every rank must plan alike): that is what the trainer's passes
share with a sleeping engine (rollout.free_cache_engine: asleep, it holds neither weights nor KV cache),
less what the models' state will take, which the memory model counts from the models' shapes (the actor's,
and reward_model.path's and teacher.path's) on the busiest rank (rank_states: actor, reference (none under
LoRA: the actor with its adapters off), LoRA's adapters, a critic, the reward model, a distillation teacher,
by placement). Measured later, the
optimizer's moments (allocated at the first step) would be missing from it. The critic's passes take the actor's budgets (its one-value head costs far less than the
LM head: they err small). The reward model's own scoring pass is sized by
reward_model.micro_batch_size_per_gpu, not by these budgets; check_reward_model_pass warns when it may not
fit beside the awake engine. On CPU the keys at -1 keep sequence-count micro-batches (config.derive_rl).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from spmdrl.algos.config import TeacherConfig
from spmdrl.config import Config
from spmdrl.config_section import switch_mode
from spmdrl.derived import max_sequence_length
from spmdrl.distributed.placement import Placement
from spmdrl.distributed.reduce import all_reduce_min
from spmdrl.models.config import ac_mode
from spmdrl.models.grad_sync import auto_defers
from spmdrl.models.memory_model import (
    MASTER_BYTES,
    TRAINED_BYTES,
    DecoderShape,
    MemoryInputs,
    TokenBudgets,
    lora_adapter_params,
    model_state_bytes,
    scoring_pass_bytes,
    token_budgets,
    whole_model_unit,
)
from spmdrl.trainer_config import AUTO_TOKENS

log = logging.getLogger(__name__)


def wants_memory_budgets(cfg: Config, device: torch.device) -> bool:
    """Whether a token budget is left to the memory model: on CUDA, a key at AUTO_TOKENS (the older
    trainer.micro_batch_tokens, when set, is the budget instead)."""
    t = cfg.trainer
    auto = AUTO_TOKENS in (t.ppo_max_token_len_per_gpu, t.log_prob_max_token_len_per_gpu)
    return device.type == "cuda" and auto and t.micro_batch_tokens == 0


def memory_inputs(
    cfg: Config,
    shape: DecoderShape,
    attention_kernel: str,
    *,
    padded_mask: bool = True,
    whole_model: bool = False,
) -> MemoryInputs:
    """The memory model's inputs from the model's section, for a CUDA trainer whose packed rows attend
    with ``attention_kernel`` (spmdrl.models.varlen.choose_kernel: "mask" or a varlen kernel).
    ``padded_mask``: padded rows attend through a 4-D mask; False for a model whose layers all attend fully
    with SDPA, which the RL build switches to causal SDPA with no mask (spmdrl.models.causal_attention).
    ``whole_model``: the actor is one FSDP2 unit (model.fsdp_unit; actor_whole_model)."""
    m, t = cfg.model, cfg.trainer
    if not t.pack_sequences:
        attention = "padded" if padded_mask else "causal"
    else:
        attention = "packed_mask" if attention_kernel == "mask" else "varlen"
    return MemoryInputs(
        shape=shape,
        compute_bytes=4 if m.param_dtype == "float32" else 2,  # auto: bfloat16 on CUDA
        activation_checkpointing=ac_mode(m.activation_checkpointing),
        checkpoint_every=m.activation_checkpointing_every,
        fused_chunk_tokens=m.fused_head_chunk(shape.vocab),
        attention=attention,
        whole_model=whole_model,
    )


def actor_whole_model(cfg: Config, shape: DecoderShape, placement: Placement, total_bytes: int) -> bool:
    """model.fsdp_unit resolved for the actor on a card of ``total_bytes`` (as the build resolves it:
    spmdrl.models.build.parallelize)."""
    return whole_model_unit(
        cfg.model.fsdp_unit,
        mesh_ranks=placement.role("actor").num_ranks,
        params=shape.params,
        compute_bytes=4 if cfg.model.param_dtype == "float32" else 2,
        trained=True,
        total_bytes=total_bytes,
    )


@dataclass(frozen=True)
class RankState:
    """The models' state on one kind of rank at the update, by model, in bytes (docs/scaling.md)."""

    ranks: str  # whose ranks: "actor" (colocated, async: the trainer ranks) or "critic" (split)
    actor: int = 0
    ref: int = 0
    critic: int = 0
    reward_model: int = 0
    teacher: int = 0  # teacher.path: frozen, in teacher.dtype, sharded over its role's ranks
    deferred_grads: int = 0  # trainer.defer_grad_sync's unsharded gradients

    @property
    def total(self) -> int:
        return self.actor + self.ref + self.critic + self.reward_model + self.teacher + self.deferred_grads

    def describe(self) -> str:
        parts = {k: v for k, v in dataclasses.asdict(self).items() if k != "ranks" and v}
        inner = ", ".join(f"{k} {v / 2**30:.2f}" for k, v in parts.items()) or "nothing"
        return f"{self.ranks} ranks {self.total / 2**30:.2f} GiB ({inner})"


def frozen_bytes_per_param(cfg: Config) -> int:
    """A frozen model's stored bytes per parameter: spmdrl.models.build keeps it in model.param_dtype
    (auto: bfloat16 on CUDA), without a float32 master copy."""
    return 4 if cfg.model.param_dtype == "float32" else 2


def teacher_bytes(teacher: TeacherConfig, auto_bytes: int, shape: DecoderShape, shards: int) -> int:
    """A distillation teacher's state: frozen, stored in teacher.dtype (auto: model.param_dtype's,
    ``auto_bytes`` a parameter, as spmdrl.rl.teacher builds it); 0 offloaded (teacher.offload)."""
    if teacher.offload:
        return 0
    per_param = auto_bytes if teacher.dtype == "auto" else (4 if teacher.dtype == "float32" else 2)
    return model_state_bytes(shape.params, 0, per_param, shards)


def actor_bytes(cfg: Config, shape: DecoderShape, shards: int) -> int:
    """The actor's state: every weight trained, or under LoRA a frozen base stored as a frozen model is
    (model.param_dtype: no float32 master, no gradient, no moments; spmdrl.models.build) and trained
    adapters with their float32 master; 0 offloaded."""
    m = cfg.model
    if m.offload_params:
        return 0
    if not m.lora.enabled:
        return model_state_bytes(shape.params, shape.params, MASTER_BYTES, shards)
    adapters = lora_adapter_params(shape, m.lora.rank, list(m.lora.target_modules))
    return (shape.params * frozen_bytes_per_param(cfg) + adapters * TRAINED_BYTES) // shards


def critic_bytes(cfg: Config, shape: DecoderShape, shards: int) -> int:
    """The critic's state: every weight of the backbone and its value head trained; 0 offloaded."""
    params = shape.params_with_head("value")
    return 0 if cfg.model.offload_params else model_state_bytes(params, params, MASTER_BYTES, shards)


def trained_params(cfg: Config, shape: DecoderShape, role: str) -> int:
    """The parameters with gradients of ``role``'s model ("actor" or "critic")."""
    lora = cfg.model.lora
    if role == "actor" and lora.enabled:
        return lora_adapter_params(shape, lora.rank, list(lora.target_modules))
    return shape.params_with_head("lm" if role == "actor" else "value")


def rank_states(
    cfg: Config,
    shape: DecoderShape,
    placement: Placement,
    *,
    needs_critic: bool,
    rm_shape: DecoderShape | None = None,
    teacher_shape: DecoderShape | None = None,
) -> list[RankState]:
    """What the models will hold at the update on each kind of rank: the actor's ranks (actor, reference,
    a colocated critic, the reward model, a teacher sharded over them), under a split placement the
    critic's ranks (the critic alone; the actor's copy there is a meta-device one), and with
    parallel.teacher_ranks the teacher's own ranks (the teacher alone). Each model is sharded over its
    role's ranks. ``rm_shape``: reward_model.path's shape, when reward_model.enable; ``teacher_shape``:
    teacher.path's, when a teacher distils. The critic is counted at the actor's shape (critic.model_path's
    is not read)."""
    m, a = cfg.model, cfg.algorithm
    shards = placement.role("actor").dp_shard
    frozen = frozen_bytes_per_param(cfg)
    # Under LoRA the reference is the actor with its adapters off (spmdrl.rl.reference): no copy of its own.
    has_ref = (a.use_kl_loss or a.use_kl_in_reward) and not m.offload_ref and not m.lora.enabled
    critic_here = needs_critic and not placement.is_split
    rm = 0  # reward_model.enable: on the actor's ranks, except under async (the rollout ranks)
    if rm_shape is not None and cfg.reward_model.enable and not placement.is_async:
        rm = model_state_bytes(rm_shape.params_with_head("reward"), 0, frozen, shards)
    # trainer.defer_grad_sync: a rank keeps the unsharded gradients (reduce_dtype) until the mini-batch's
    # last micro-batch, of one model at a time (the actor's and the critic's updates take turns). That is
    # more device memory than its shard's gradients only on a sharded model, or with the shards (and so
    # their gradients) offloaded to the host; auto defers in neither (spmdrl.models.grad_sync.auto_defers).
    reduce_bytes = 4 if m.reduce_dtype == "float32" else 2

    def deferred(ranks: int) -> int:
        costs = not auto_defers(ranks, offloaded=m.offload_params)
        return reduce_bytes if switch_mode(cfg.trainer.defer_grad_sync) == "true" and costs else 0

    grad_bytes = deferred(shards)
    roles = ["actor", "critic"] if critic_here else ["actor"]
    teacher = 0  # beside the actor, or on its own ranks (parallel.teacher_ranks)
    if teacher_shape is not None and "teacher" in placement.roles:
        teacher = teacher_bytes(cfg.teacher, frozen, teacher_shape, placement.role("teacher").dp_shard)
    states = [
        RankState(
            "actor",
            actor=actor_bytes(cfg, shape, shards),
            ref=model_state_bytes(shape.params, 0, frozen, shards) if has_ref else 0,
            critic=critic_bytes(cfg, shape, shards) if critic_here else 0,
            reward_model=rm,
            teacher=0 if placement.teacher_apart else teacher,
            deferred_grads=grad_bytes * max(trained_params(cfg, shape, r) for r in roles),
        )
    ]
    if placement.teacher_apart:
        states.append(RankState("teacher", teacher=teacher))
    if needs_critic and placement.is_split:
        critic = critic_bytes(cfg, shape, placement.role("critic").dp_shard)
        states.append(
            RankState(
                "critic",
                critic=critic,
                deferred_grads=deferred(placement.role("critic").dp_shard)
                * trained_params(cfg, shape, "critic"),
            )
        )
    return states


def state_bytes(
    cfg: Config,
    shape: DecoderShape,
    placement: Placement,
    *,
    needs_critic: bool,
    rm_shape: DecoderShape | None = None,
    teacher_shape: DecoderShape | None = None,
) -> int:
    """The state of the busiest rank (rank_states): every rank plans with the same budgets."""
    states = rank_states(
        cfg, shape, placement, needs_critic=needs_critic, rm_shape=rm_shape, teacher_shape=teacher_shape
    )
    return max(s.total for s in states)


def reward_model_shape(cfg: Config) -> DecoderShape | None:
    """reward_model.path's shape when reward_model.enable (its files checked first: ConfigError)."""
    if not cfg.reward_model.enable:
        return None
    from transformers import AutoConfig

    from spmdrl.rewards.reward_model_path import check_reward_model_dir

    path = check_reward_model_dir(cfg.reward_model.path)
    return DecoderShape.from_hf(
        AutoConfig.from_pretrained(path, trust_remote_code=cfg.model.trust_remote_code)
    )


def check_reward_model_pass(cfg: Config, rm_shape: DecoderShape, room: int) -> int:
    """The reward model's scoring pass, estimated (memory_model.scoring_pass_bytes): it runs right after
    generation with the engine still awake, on reward_model.micro_batch_size_per_gpu right-padded rows of
    up to the longest sequence (its own budget, not the token budgets). Warns when that exceeds ``room``,
    what the engine and the state leave; returns the estimate."""
    rm = cfg.reward_model
    row_len = min(rm.max_length or max_sequence_length(cfg), max_sequence_length(cfg))
    m = MemoryInputs(shape=rm_shape, compute_bytes=frozen_bytes_per_param(cfg))
    need = scoring_pass_bytes(m, rm.micro_batch_size_per_gpu, row_len)
    if need > room:
        log.warning(
            "reward model: a scoring micro-batch of %d rows x %d tokens needs about %.1f GiB next to the awake "
            "engine, which with the models' state leaves %.1f GiB: lower reward_model.micro_batch_size_per_gpu "
            "or rollout.gpu_memory_utilization if it runs out of memory",
            rm.micro_batch_size_per_gpu,
            row_len,
            need / 2**30,
            room / 2**30,
        )
    return need


def measure_token_budgets(
    cfg: Config,
    model_dir: Path,
    device: torch.device,
    placement: Placement,
    *,
    needs_critic: bool,
    teacher_dir: Path | None = None,
    mem_get_info: Callable[[torch.device], tuple[int, int]] = torch.cuda.mem_get_info,
) -> TokenBudgets:
    """The update's and the no-grad passes' budgets on this job's GPUs. Every rank calls it (one
    all_reduce), before any model is built. ``teacher_dir``: teacher.path's files, when a teacher distils.
    ``mem_get_info``: the device's (free, total) bytes, CUDA's query (a test on a CPU passes a card's
    figures instead)."""
    from transformers import AutoConfig

    from spmdrl.models.varlen import capabilities, choose_kernel, features_of

    rm_shape = reward_model_shape(cfg)
    hf_config = AutoConfig.from_pretrained(model_dir, trust_remote_code=cfg.model.trust_remote_code)
    shape = DecoderShape.from_hf(hf_config)
    teacher_shape = (
        DecoderShape.from_hf(
            AutoConfig.from_pretrained(teacher_dir, trust_remote_code=cfg.model.trust_remote_code)
        )
        if teacher_dir is not None
        else None
    )
    dtype = torch.float32 if cfg.model.param_dtype == "float32" else torch.bfloat16
    features = features_of(hf_config, dtype)
    kernel = choose_kernel(
        cfg.trainer.packed_attention, cfg.trainer.pack_sequences, capabilities("cuda"), features
    ).kernel
    free, total = mem_get_info(device)
    free = int(all_reduce_min({"free": float(free)}, device)["free"])
    # An engine that stays awake through the update (free_cache_engine=false) keeps its share of the card
    # (async: the trainer ranks hold no engine).
    awake = int(cfg.rollout.gpu_memory_utilization * total)
    engine = 0 if cfg.rollout.free_cache_engine or placement.is_async else awake
    states = rank_states(
        cfg, shape, placement, needs_critic=needs_critic, rm_shape=rm_shape, teacher_shape=teacher_shape
    )
    state = max(s.total for s in states)
    reserve = int(cfg.trainer.memory_reserve_gib * 2**30)
    # Without sliding windows or soft-capping (eager attention) the model attends with causal SDPA.
    padded_mask = features.sliding_window or features.softcap
    budgets = token_budgets(
        memory_inputs(
            cfg,
            shape,
            kernel,
            padded_mask=padded_mask,
            whole_model=actor_whole_model(cfg, shape, placement, total),
        ),
        free_bytes=free - engine,
        state_bytes=state,
        reserve_bytes=reserve,
        max_len=max_sequence_length(cfg),
    )
    log.info(
        "token budgets from %.1f GiB free: update %d tokens (%d bytes/token), no-grad passes %d tokens "
        "(%d bytes/token), %.1f GiB left for activations; state: %s",
        free / 2**30,
        budgets.train,
        budgets.train_bytes_per_token,
        budgets.no_grad,
        budgets.no_grad_bytes_per_token,
        budgets.available_gib,
        "; ".join(s.describe() for s in states),
    )
    if rm_shape is not None and not placement.is_async:
        check_reward_model_pass(cfg, rm_shape, free - awake - state - reserve)
    return budgets
