"""Each trained role's speed per device: tokens/s of its update and, where the device's peak is known, the
MFU of the update and of its no-grad forwards (the actor's old and reference logprobs, the critic's values).

The FLOPs come from the rows' real lengths (spmdrl.logging.flops: dense matmuls, causal attention, the LM
head over the response tokens; a value model's hidden x 1 head over every token); the times are the step's
slowest rank's (``timing/*``, step_metrics). Keys in docs/metrics.md.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from spmdrl.distributed.reduce import all_reduce_sum
from spmdrl.logging.flops import (
    DecoderShape,
    PassFlops,
    device_peak_flops,
    forward_flops,
    training_flops,
    utilization,
)
from spmdrl.models.config import ModelConfig, ac_mode
from spmdrl.rl.batch import PolicyBatch


@dataclass(frozen=True)
class PerfKeys:
    """One role's metric names and the ``timing/*`` keys its passes are timed under."""

    tokens_per_s: str
    mfu: str
    hfu: str
    mfu_forward: str
    update_s: str
    forward_s: str


ACTOR_KEYS = PerfKeys(
    "perf/tokens_per_s_update",
    "perf/mfu_update",
    "perf/hfu_update",
    "perf/mfu_forward",
    "timing/actor_update_s",
    "timing/old_ref_s",
)
CRITIC_KEYS = PerfKeys(
    "perf/critic_tokens_per_s_update",
    "perf/critic_mfu",
    "perf/critic_hfu",
    "perf/critic_mfu_forward",
    "timing/critic_update_s",
    "timing/values_s",
)


def value_shape(shape: DecoderShape) -> DecoderShape:
    """A value model's shape for the FLOPs count: the decoder with transformers' token-classification head
    of one label (hidden x 1) in place of the LM head (hidden x vocab). Its head runs at every position
    (the value of every state), so the value passes count ``lm_positions`` = all the rows' tokens."""
    return dataclasses.replace(shape, vocab=1)


def value_forward_flops(shape: DecoderShape, tokens_B: Sequence[int]) -> PassFlops:
    """The critic's no-grad values pass over sequences of ``tokens_B`` real tokens; ``shape``: the decoder's
    (its config's), not yet :func:`value_shape`'s."""
    return forward_flops(value_shape(shape), tokens_B, tokens_B)


def value_training_flops(
    shape: DecoderShape, tokens_B: Sequence[int], *, recompute: str = "off", every: int = 1
) -> PassFlops:
    """The critic's forward + backward over sequences of ``tokens_B`` real tokens (training_flops' rules,
    activation checkpointing included); ``shape`` as in :func:`value_forward_flops`."""
    return training_flops(value_shape(shape), tokens_B, tokens_B, recompute=recompute, every=every)


def actor_perf_metrics(
    model_cfg: ModelConfig,
    ppo_epochs: int,
    actor: torch.nn.Module,
    batch: PolicyBatch,
    timings: dict[str, float],
    *,
    forward_passes: int,
    device: torch.device,
    group: dist.ProcessGroup | None = None,
    trained: bool = True,
) -> dict[str, float]:
    """``perf/tokens_per_s_update`` and, with a known peak, ``perf/mfu_update``, ``perf/hfu_update`` and
    (``forward_passes`` > 0: the old and/or reference logprobs ran) ``perf/mfu_forward``.

    ``timings``: the step's reduced metrics (``timing/actor_update_s``, ``timing/old_ref_s``). ``trained``
    False (PPO's critic.warmup_steps: the actor did not update) leaves the update's keys out. Every rank of
    ``group`` (the actor's) calls it: one all_reduce of this rank's FLOPs and tokens."""
    shape = DecoderShape.from_hf_config(actor.config)
    lengths = batch.row_lengths()  # one read, after the update: nothing waits on it any more
    train = training_flops(
        shape,
        lengths.tokens,
        lengths.response_tokens,
        recompute=ac_mode(model_cfg.activation_checkpointing),
        every=model_cfg.activation_checkpointing_every,
    )
    forward = forward_flops(shape, lengths.tokens, lengths.response_tokens)
    return _role_perf(
        ACTOR_KEYS,
        ppo_epochs,
        lengths.tokens,
        train,
        forward * forward_passes,
        timings,
        device,
        group,
        trained=trained,
    )


def critic_perf_metrics(
    model_cfg: ModelConfig,
    ppo_epochs: int,
    critic: torch.nn.Module,
    batch: PolicyBatch,
    timings: dict[str, float],
    *,
    device: torch.device,
    group: dist.ProcessGroup | None = None,
) -> dict[str, float]:
    """The critic's ``perf/critic_tokens_per_s_update`` and, with a known peak, ``perf/critic_mfu``,
    ``perf/critic_hfu`` (its update: ``timing/critic_update_s``) and ``perf/critic_mfu_forward`` (its values
    pass: ``timing/values_s``), counted as the actor's (ppo_epochs epochs over its rows, the model's
    activation checkpointing) on the value model's shape. Every rank of ``group`` (the critic's) calls it:
    one all_reduce."""
    shape = DecoderShape.from_hf_config(critic.config)
    lengths = batch.row_lengths()
    train = value_training_flops(
        shape,
        lengths.tokens,
        recompute=ac_mode(model_cfg.activation_checkpointing),
        every=model_cfg.activation_checkpointing_every,
    )
    forward = value_forward_flops(shape, lengths.tokens)
    return _role_perf(CRITIC_KEYS, ppo_epochs, lengths.tokens, train, forward, timings, device, group)


def _role_perf(
    keys: PerfKeys,
    epochs: int,
    tokens_B: Sequence[int],
    train: PassFlops,
    forward: PassFlops,
    timings: dict[str, float],
    device: torch.device,
    group: dist.ProcessGroup | None,
    *,
    trained: bool = True,
) -> dict[str, float]:
    """One role's metrics from this rank's tokens and FLOPs (``train``: one epoch's; ``forward``: all the
    no-grad passes', 0 if none ran), summed over ``group``, per device of it."""
    local = {
        "tokens": float(sum(tokens_B) * epochs),
        "model": train.model * epochs,
        "hardware": train.hardware * epochs,
        "forward": forward.model,
    }
    total = all_reduce_sum(local, device, group)
    ranks = dist.get_world_size(group) if dist.is_initialized() else 1
    peak = device_peak_flops(device)
    metrics: dict[str, float] = {}
    if trained:
        update_s = timings.get(keys.update_s, 0.0)
        metrics[keys.tokens_per_s] = total["tokens"] / ranks / max(update_s, 1e-9)
        mfu = utilization(total["model"], update_s, ranks, peak)
        if mfu is not None:
            metrics[keys.mfu] = mfu
            metrics[keys.hfu] = utilization(total["hardware"], update_s, ranks, peak) or 0.0
    mfu_forward = utilization(total["forward"], timings.get(keys.forward_s, 0.0), ranks, peak)
    if total["forward"] > 0 and mfu_forward is not None:
        metrics[keys.mfu_forward] = mfu_forward
    return metrics
