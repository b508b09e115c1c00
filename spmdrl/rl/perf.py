"""The actor's training speed per device: tokens/s of the update and, where the device's peak is known,
the MFU of the update and of the no-grad forwards before it (old and reference logprobs).

The FLOPs come from the rows' real lengths (spmdrl.logging.flops: dense matmuls, causal attention, the LM
head over the response tokens); the times are the step's slowest rank's (``timing/*``, step_metrics).
Keys in docs/metrics.md.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from spmdrl.config import Config, ac_mode
from spmdrl.distributed.reduce import all_reduce_sum
from spmdrl.logging.flops import DecoderShape, device_peak_flops, forward_flops, training_flops, utilization
from spmdrl.rl.batch import PolicyBatch


def actor_perf_metrics(
    cfg: Config,
    actor: torch.nn.Module,
    batch: PolicyBatch,
    timings: dict[str, float],
    *,
    forward_passes: int,
    device: torch.device,
    group: dist.ProcessGroup | None = None,
) -> dict[str, float]:
    """``perf/tokens_per_s_update`` and, with a known peak, ``perf/mfu_update``, ``perf/hfu_update`` and
    (``forward_passes`` > 0: the old and/or reference logprobs ran) ``perf/mfu_forward``.

    ``timings``: the step's reduced metrics (``timing/actor_update_s``, ``timing/old_ref_s``). Every rank of
    ``group`` (the actor's) calls it: one all_reduce of this rank's FLOPs and tokens."""
    shape = DecoderShape.from_hf_config(actor.config)
    lengths = batch.row_lengths()  # one read, after the update: nothing waits on it any more
    epochs = cfg.algorithm.ppo_epochs
    train = training_flops(
        shape,
        lengths.tokens,
        lengths.response_tokens,
        recompute=ac_mode(cfg.model.activation_checkpointing),
        every=cfg.model.activation_checkpointing_every,
    )
    local = {
        "tokens": float(sum(lengths.tokens) * epochs),
        "model": train.model * epochs,
        "hardware": train.hardware * epochs,
        "forward": forward_flops(shape, lengths.tokens, lengths.response_tokens).model * forward_passes,
    }
    total = all_reduce_sum(local, device, group)
    ranks = dist.get_world_size(group) if dist.is_initialized() else 1
    update_s = timings.get("timing/actor_update_s", 0.0)
    metrics = {"perf/tokens_per_s_update": total["tokens"] / ranks / max(update_s, 1e-9)}
    peak = device_peak_flops(device)
    mfu = utilization(total["model"], update_s, ranks, peak)
    if mfu is not None:
        metrics["perf/mfu_update"] = mfu
        metrics["perf/hfu_update"] = utilization(total["hardware"], update_s, ranks, peak) or 0.0
    mfu_forward = utilization(total["forward"], timings.get("timing/old_ref_s", 0.0), ranks, peak)
    if forward_passes > 0 and mfu_forward is not None:
        metrics["perf/mfu_forward"] = mfu_forward
    return metrics
