"""Trainer-vs-engine logprob parity: the gap between the trainer's logprobs of the engine's samples and the
engine's own.

The engine samples with its own kernels; the trainer scores the same tokens with its own. With a bf16
engine the gap is ~1e-3 from rounding alone; an fp32 engine and an fp32 trainer agree to ~3e-7. A large
gap means the weight sync is broken (stale or misnamed weights) or the two disagree on the sampling
distribution (temperature), and it biases the policy gradient; recipes log these numbers every step, and
``rollout.parity_tol`` turns the mean into a gate that stops the run (:func:`parity_failure`).
"""

from __future__ import annotations

from collections.abc import Callable

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


class ParityError(RuntimeError):
    """A step's trainer/engine logprob gap exceeded rollout.parity_tol."""


def parity_failure(tol: float, metrics: dict[str, float], step: int, dtypes: Callable[[], str]) -> str | None:
    """Why the step fails rollout.parity_tol (``tol`` > 0), or None. ``metrics``: the step's reduced metrics,
    the same on every rank, so every rank decides alike; ``dtypes()``: the trainer's and the engine's, for
    the message."""
    mean = metrics.get("mismatch/logprob_abs_diff_mean")
    if tol <= 0 or mean is None or mean <= tol:
        return None
    peak = metrics.get("mismatch/logprob_abs_diff_max", float("nan"))
    return (
        f"trainer/engine parity failed at step {step}: the mean |trainer - engine| logprob of the sampled tokens "
        f"is {mean:.3g} (max {peak:.3g}), above rollout.parity_tol={tol:g} ({dtypes()}). With the weight-sync check "
        "on (rollout.weight_sync_check, the default) the engine holds the trainer's weights, so what differs is "
        "how the two compute with them. Likely causes: a bf16 engine or trainer (rounding alone gives ~1e-3: use rollout.dtype=float32 and "
        "model.param_dtype=float32 for a parity run), a model whose trainer and engine implementations differ "
        "(rope scaling, sliding window, soft-capping, a custom architecture), or the sampling settings "
        "(temperature). The step's metrics row is in metrics.jsonl; docs/rollout.md#trainerengine-parity"
    )


def corrected_mismatch(
    trainer_logprobs_BT: torch.Tensor,
    engine_logprobs_BT: torch.Tensor,
    kept_mask_BT: torch.Tensor,
    is_weights_BT: torch.Tensor | None,
    sequence_level: bool,
    group: dist.ProcessGroup | None = None,
) -> dict[str, float]:
    """The gap the rollout correction leaves: ``logprob_abs_diff_mean`` and ``kl_k3`` as in
    :func:`logprob_mismatch`, after the correction (``mismatch/corrected_*``).

    An importance weight ``w`` turns the engine's probability of a token into ``engine x w``; exact weights
    (``w = trainer / engine``) leave no gap, truncated ones (TIS) the part above the threshold. So the gap
    per token is ``d = log(trainer / engine) - log w`` over the tokens the correction kept (its rejection
    mask, and ``w > 0``: IcePop's zero weight drops a token as rejection does). Without weights (rejection
    alone) ``d`` is the plain gap on the kept tokens. Sequence-level weights correct a sequence's summed
    log-ratio: the gap is then per sequence, ``|sum_t log r_t - log w| / tokens``, averaged over sequences,
    and ``kl_k3`` is that of the per-token mean. Summed over ``group``'s ranks like
    :func:`logprob_mismatch`.
    """
    keep = kept_mask_BT.bool()
    log_r = trainer_logprobs_BT.float() - engine_logprobs_BT.float()
    if is_weights_BT is not None:
        keep = keep & (is_weights_BT > 0)
        log_w = torch.log(is_weights_BT.float().clamp_min(1e-30))
    else:
        log_w = torch.zeros_like(log_r)
    if sequence_level and is_weights_BT is not None:
        tokens_B = keep.sum(1)
        has_B = tokens_B > 0
        # One weight per sequence, repeated on its tokens: read it from any kept token.
        first_B = keep.float().argmax(1)
        w_log_B = log_w.gather(1, first_B[:, None]).squeeze(1)
        d_B = (torch.where(keep, log_r, 0.0).sum(1) - w_log_B) / tokens_B.clamp_min(1)
        d = d_B[has_B]
    else:
        d = (log_r - log_w)[keep]
    k3 = k3_unclamped(torch.zeros_like(d), d)  # exp(d) - d - 1
    sums = torch.stack([d.abs().sum(), k3.sum(), d.new_tensor(float(d.numel()))]).double()
    if group is not None:
        dist.all_reduce(sums, group=group)
    count = max(float(sums[2]), 1.0)
    return {
        "corrected_logprob_abs_diff_mean": float(sums[0]) / count,
        "corrected_kl_k3": float(sums[1]) / count,
    }
