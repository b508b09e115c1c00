"""Trainer-vs-engine logprob parity: the gap between the trainer's logprobs of the engine's samples and the
engine's own.

The engine samples in bf16 with its own kernels; the trainer scores the same tokens in its own precision.
A small gap is expected. A large one means the weight sync is broken (stale or misnamed weights) or the
two disagree on the sampling distribution (temperature), and it biases the policy gradient; recipes log
these numbers every step.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from spmdrl.algos.kl import k3_unclamped


def logprob_mismatch(
    trainer_logprobs_BT: torch.Tensor,
    engine_logprobs_BT: torch.Tensor,
    mask_BT: torch.Tensor,
    group: dist.ProcessGroup | None = None,
) -> dict[str, float]:
    """Mean / max |trainer - engine| logprob and the k3 estimate of KL(engine || trainer) over masked tokens.

    Samples come from the engine, so with ``d = trainer - engine`` the k3 estimator ``exp(d) - d - 1`` is
    unbiased for KL(engine || trainer) and never negative. Local to this rank unless ``group`` is given
    (``dist.group.WORLD`` for all ranks): then they cover every rank's tokens, and every rank must call.
    """
    mask = mask_BT.bool()
    diff = (trainer_logprobs_BT.float() - engine_logprobs_BT.float()).abs()[mask]
    # Unclamped (not verl's k3 = low_var_kl): a wild token should show here.
    k3 = k3_unclamped(engine_logprobs_BT.float(), trainer_logprobs_BT.float())[mask]
    sums = torch.stack([diff.sum(), k3.sum(), diff.new_tensor(float(diff.numel()))]).double()
    peak = diff.max() if diff.numel() else diff.new_tensor(0.0)
    if group is not None:
        dist.all_reduce(sums, group=group)
        dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=group)
    count = max(float(sums[2]), 1.0)
    return {
        "logprob_abs_diff_mean": float(sums[0]) / count,
        "logprob_abs_diff_max": float(peak),
        "kl_k3": float(sums[1]) / count,
        "tokens": float(sums[2]),
    }
