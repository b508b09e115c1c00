"""The token budgets of an RL job's micro-batches on a GPU, from the memory the card has.

trainer.ppo_max_token_len_per_gpu and trainer.log_prob_max_token_len_per_gpu at AUTO_TOKENS (-1, the
default) become, on CUDA, the tokens that fit in the card's free memory by the memory model
(spmdrl/models/memory_model.py). The free memory is measured once, at start, before any model or the engine
is allocated, as the least over all ranks (every rank must plan alike): that is what the trainer's passes
share with a sleeping engine (rollout.free_cache_engine: asleep, it holds neither weights nor KV cache),
less what the models' state will take, which the memory model counts from the model's shape. Measured
later, the optimizer's moments (allocated at the first step) would be missing from it. The critic's passes
take the actor's budgets (its one-value head costs far less than the LM head: they err small). On CPU the
keys at -1 keep sequence-count micro-batches (config.derive_rl).
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from spmdrl.config import AUTO_TOKENS, Config, ac_mode, max_sequence_length
from spmdrl.distributed.placement import Placement
from spmdrl.distributed.reduce import all_reduce_min
from spmdrl.models.memory_model import (
    DecoderShape,
    MemoryInputs,
    TokenBudgets,
    token_budgets,
    trainer_state_bytes,
)

log = logging.getLogger(__name__)


def wants_memory_budgets(cfg: Config, device: torch.device) -> bool:
    """Whether a token budget is left to the memory model: on CUDA, a key at AUTO_TOKENS (the older
    trainer.micro_batch_tokens, when set, is the budget instead)."""
    t = cfg.trainer
    auto = AUTO_TOKENS in (t.ppo_max_token_len_per_gpu, t.log_prob_max_token_len_per_gpu)
    return device.type == "cuda" and auto and t.micro_batch_tokens == 0


def memory_inputs(cfg: Config, shape: DecoderShape, attention_kernel: str) -> MemoryInputs:
    """The memory model's inputs from the model's section, for a CUDA trainer whose packed rows attend
    with ``attention_kernel`` (spmdrl.models.varlen.choose_kernel: "mask" or a varlen kernel)."""
    m, t = cfg.model, cfg.trainer
    if not t.pack_sequences:
        attention = "padded"
    else:
        attention = "packed_mask" if attention_kernel == "mask" else "varlen"
    return MemoryInputs(
        shape=shape,
        compute_bytes=4 if m.param_dtype == "float32" else 2,  # auto: bfloat16 on CUDA
        activation_checkpointing=ac_mode(m.activation_checkpointing),
        checkpoint_every=m.activation_checkpointing_every,
        fused_chunk_tokens=m.fused_head_chunk(shape.vocab, "cuda"),
        attention=attention,
    )


def state_bytes(cfg: Config, shape: DecoderShape, placement: Placement, *, needs_critic: bool) -> int:
    """What the models will hold on one rank at the update, plus an engine that stays awake. Counted for
    the busiest rank of a colocated job (actor, reference and critic on every rank); a split placement's
    ranks hold less, so the budget errs small there."""
    m, a = cfg.model, cfg.algorithm
    shards = placement.role("actor").num_ranks // cfg.parallel.dp_replicate
    colocated_critic = needs_critic and not placement.is_split
    trained = 0 if m.offload_params else 1 + int(colocated_critic)
    has_ref = a.use_kl_loss or a.use_kl_in_reward
    frozen = int(has_ref and not m.offload_ref)
    # trainer.defer_grad_sync: each rank keeps the unsharded gradients (reduce_dtype) until the
    # mini-batch's last micro-batch. (LoRA's smaller optimizer state is not counted: the budget errs small.)
    deferred = (4 if m.reduce_dtype == "float32" else 2) * shape.params if cfg.trainer.defer_grad_sync else 0
    return trainer_state_bytes(shape, shards, trained=trained, frozen=frozen) + deferred


def measure_token_budgets(
    cfg: Config, model_dir: Path, device: torch.device, placement: Placement, *, needs_critic: bool
) -> TokenBudgets:
    """The update's and the no-grad passes' budgets on this job's GPUs. Every rank calls it (one
    all_reduce), before any model is built."""
    from transformers import AutoConfig

    from spmdrl.models.varlen import capabilities, choose_kernel, features_of

    hf_config = AutoConfig.from_pretrained(model_dir, trust_remote_code=cfg.model.trust_remote_code)
    shape = DecoderShape.from_hf(hf_config)
    dtype = torch.float32 if cfg.model.param_dtype == "float32" else torch.bfloat16
    kernel = choose_kernel(
        cfg.trainer.packed_attention,
        cfg.trainer.pack_sequences,
        capabilities("cuda"),
        features_of(hf_config, dtype),
    ).kernel
    free, total = torch.cuda.mem_get_info(device)
    free = int(all_reduce_min({"free": float(free)}, device)["free"])
    # An engine that stays awake through the update (free_cache_engine=false) keeps its share of the card.
    engine = 0 if cfg.rollout.free_cache_engine else int(cfg.rollout.gpu_memory_utilization * total)
    budgets = token_budgets(
        memory_inputs(cfg, shape, kernel),
        free_bytes=free - engine,
        state_bytes=state_bytes(cfg, shape, placement, needs_critic=needs_critic),
        reserve_bytes=int(cfg.trainer.memory_reserve_gib * 2**30),
        max_len=max_sequence_length(cfg),
    )
    log.info(
        "token budgets from %.1f GiB free: update %d tokens (%d bytes/token), no-grad passes %d tokens "
        "(%d bytes/token), %.1f GiB left for activations",
        free / 2**30,
        budgets.train,
        budgets.train_bytes_per_token,
        budgets.no_grad,
        budgets.no_grad_bytes_per_token,
        budgets.available_gib,
    )
    return budgets
