"""Per-token KL estimators between the policy and a reference, by verl's names (Schulman's k1 / k2 / k3,
http://joschu.net/blog/kl-approx.html; verl ``core_algos.kl_penalty`` / ``kl_penalty_forward``).

With tokens sampled from the policy and ``d = ref_logprob - logprob``:

- ``kl`` / ``k1``: ``-d``; unbiased for KL(policy || ref), high variance, can be negative;
- ``abs``: ``|d|``;
- ``mse`` / ``k2``: ``d^2 / 2``; biased, low variance, and its gradient is an unbiased estimate of the
  gradient of KL(policy || ref) (the k1 and k3 gradients are not);
- ``low_var_kl`` / ``k3``: ``exp(d) - d - 1`` (unbiased and never negative) with ``d`` clamped to
  [-20, 20] and the result to [-10, 10] (verl's clamping, for both names), so one wild token cannot
  dominate the loss. :func:`k3_unclamped` is the plain estimator, for diagnostics where a wild token
  should show (spmdrl.rollout.mismatch);
- ``<name>+`` (``k1+``, ``kl+``, ``abs+``, ``k3+``, ``low_var_kl+``, ``k2+``, ``mse+``): straight-through,
  the forward value of ``<name>`` with the gradient of k2 (verl PR #2953): ``k2 - sg(k2) + sg(value)``.

``full`` (verl's KL over the whole vocabulary) is not implemented, as in verl.
"""

from __future__ import annotations

import torch

BASE_KINDS = ("k1", "k2", "k3", "low_var_kl", "kl", "abs", "mse")
KINDS = BASE_KINDS + tuple(f"{kind}+" for kind in BASE_KINDS)

# exp(20) is ~5e8: far above the low_var_kl clamp, far below float32 overflow. Clamping the log
# ratio first keeps exp() finite, so the clamp's zero gradient is not multiplied by inf (NaN).
_MAX_LOG_RATIO = 20.0
_MAX_LOW_VAR_KL = 10.0


def _low_var_kl(diff_BT: torch.Tensor) -> torch.Tensor:
    diff_BT = diff_BT.clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    # expm1(d) - d is exp(d) - 1 - d without the cancellation of 1 - 1 for small d.
    return (torch.expm1(diff_BT) - diff_BT).clamp(-_MAX_LOW_VAR_KL, _MAX_LOW_VAR_KL)


def k3_unclamped(logprobs_BT: torch.Tensor, ref_logprobs_BT: torch.Tensor) -> torch.Tensor:
    """Schulman's k3 ``exp(d) - d - 1``, ``d = ref - logprob``, without ``low_var_kl``'s clamps: one
    wild token shows in a mean (inf where ``exp`` overflows). Not a verl ``kl_penalty`` kind."""
    diff_BT = ref_logprobs_BT - logprobs_BT
    return torch.expm1(diff_BT) - diff_BT


def _forward(diff_BT: torch.Tensor, kind: str) -> torch.Tensor | None:
    if kind in ("k1", "kl"):
        return -diff_BT
    if kind == "abs":
        return diff_BT.abs()
    if kind in ("k2", "mse"):
        return 0.5 * diff_BT.square()
    if kind in ("low_var_kl", "k3"):  # verl's kl_penalty_forward: one branch for both names
        return _low_var_kl(diff_BT)
    return None


def kl_penalty(
    logprobs_BT: torch.Tensor, ref_logprobs_BT: torch.Tensor, kind: str = "low_var_kl"
) -> torch.Tensor:
    """Per-token KL estimate of shape (B, T) (see the module docstring for ``kind``); gradients flow
    into both arguments."""
    diff_BT = ref_logprobs_BT - logprobs_BT
    straight_through = kind.endswith("+")
    base = kind[:-1] if straight_through else kind
    value_BT = _forward(diff_BT, base)
    if value_BT is None:
        raise ValueError(f"unknown KL estimator {kind!r}; use one of {', '.join(KINDS)}")
    if not straight_through:
        return value_BT
    k2_BT = 0.5 * diff_BT.square()
    # Value of the named estimator, gradient of k2 (whose expected gradient is that of the true KL).
    return k2_BT - k2_BT.detach() + value_BT.detach()
