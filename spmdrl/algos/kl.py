"""Per-token KL estimators between the policy and a reference (Schulman's k1 / k2 / k3).

With tokens sampled from the policy and ``d = ref_logprob - logprob``:

- ``k1 = -d``: unbiased for KL(policy || ref), high variance, can be negative;
- ``k2 = d^2 / 2``: biased, low variance, its gradient is that of the reverse KL to first order;
- ``k3 = exp(d) - d - 1``: unbiased and never negative;
- ``low_var_kl``: k3 clamped to [-10, 10] (as verl does), so one wild token cannot dominate.
"""

from __future__ import annotations

import torch

KINDS = ("k1", "k2", "k3", "low_var_kl")

# exp(20) is ~5e8: far above the low_var_kl clamp, far below float32 overflow. Clamping the log
# ratio first keeps exp() finite, so the clamp's zero gradient is not multiplied by inf (NaN).
_MAX_LOG_RATIO = 20.0


def kl_penalty(
    logprobs_BT: torch.Tensor, ref_logprobs_BT: torch.Tensor, kind: str = "low_var_kl"
) -> torch.Tensor:
    """Per-token KL estimate of shape (B, T); gradients flow into both arguments."""
    diff_BT = ref_logprobs_BT - logprobs_BT
    if kind == "k1":
        return -diff_BT
    if kind == "k2":
        return 0.5 * diff_BT.square()
    if kind == "k3":
        return torch.expm1(diff_BT) - diff_BT
    if kind == "low_var_kl":
        diff_BT = diff_BT.clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
        return (torch.expm1(diff_BT) - diff_BT).clamp(-10.0, 10.0)
    raise ValueError(f"unknown KL estimator {kind!r}; use one of {', '.join(KINDS)}")
