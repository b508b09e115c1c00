"""Per-token KL estimators between the policy and a reference, by verl's names (Schulman's k1 / k2 / k3,
http://joschu.net/blog/kl-approx.html; verl ``core_algos.kl_penalty`` / ``kl_penalty_forward``), for
``algorithm.kl_loss_type`` (the KL loss) and ``algorithm.kl_penalty`` (the KL folded into the reward).

With tokens sampled from the policy and ``d = ref_logprob - logprob``:

- ``kl`` / ``k1``: ``-d``; unbiased for KL(policy || ref), high variance, can be negative;
- ``abs``: ``|d|``;
- ``mse`` / ``k2``: ``d^2 / 2``; biased, low variance, and its gradient is an unbiased estimate of the
  gradient of KL(policy || ref) (the k1 and k3 gradients are not);
- ``low_var_kl`` / ``k3``: ``exp(d) - d - 1`` (unbiased and never negative) with ``d`` clamped to
  [-20, 20] and the result to [-10, 10] (verl's clamping, for both names), so one wild token cannot
  dominate the loss. :func:`k3_unclamped` is the plain estimator, for diagnostics where a wild token
  should show (spmdrl.rollout.mismatch);
- ``<name>+`` (``k1+``, ``kl+``, ``abs+``, ``k3+``, ``low_var_kl+``, ``k2+``, ``mse+``, and any registered
  name): straight-through, the forward value of ``<name>`` with the gradient of k2 (verl PR #2953):
  ``k2 - sg(k2) + sg(value)``.

``full`` (verl's KL over the whole vocabulary) is not implemented, as in verl.

Every estimator is registered under its names by the decorators above it, with one signature::

    @register_kl_estimator("my_kl")
    def my_kl(logprobs_BT: torch.Tensor, ref_logprobs_BT: torch.Tensor) -> torch.Tensor: ...   # (B, T)

Gradients must flow into both arguments. The config may also name one by import path
(``algorithm.kl_loss_type=my_pkg.kl:my_kl``, with ``+`` after it for the straight-through form).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from spmdrl.registry import Registered, Registry

KLFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]

KL_ESTIMATORS: Registry[Registered] = Registry(
    "KL estimator",
    Registered,
    decorator="register_kl_estimator",
    args=("logprobs_BT", "ref_logprobs_BT"),
    suffix="+",
)

# exp(20) is ~5e8: far above the low_var_kl clamp, far below float32 overflow. Clamping the log
# ratio first keeps exp() finite, so the clamp's zero gradient is not multiplied by inf (NaN).
_MAX_LOG_RATIO = 20.0
_MAX_LOW_VAR_KL = 10.0


def register_kl_estimator(name: str) -> Callable[[KLFn], KLFn]:
    """Registers the decorated estimator as ``algorithm.kl_loss_type=name`` / ``algorithm.kl_penalty=name``
    (and ``name+``, its straight-through form). Stack it for aliases."""
    return KL_ESTIMATORS.register(name)


@register_kl_estimator("kl")
@register_kl_estimator("k1")
def k1(logprobs_BT: torch.Tensor, ref_logprobs_BT: torch.Tensor) -> torch.Tensor:
    return -(ref_logprobs_BT - logprobs_BT)


@register_kl_estimator("abs")
def abs_kl(logprobs_BT: torch.Tensor, ref_logprobs_BT: torch.Tensor) -> torch.Tensor:
    return (ref_logprobs_BT - logprobs_BT).abs()


@register_kl_estimator("mse")
@register_kl_estimator("k2")
def k2(logprobs_BT: torch.Tensor, ref_logprobs_BT: torch.Tensor) -> torch.Tensor:
    return 0.5 * (ref_logprobs_BT - logprobs_BT).square()


@register_kl_estimator("low_var_kl")
@register_kl_estimator("k3")  # verl's kl_penalty_forward: one branch for both names
def low_var_kl(logprobs_BT: torch.Tensor, ref_logprobs_BT: torch.Tensor) -> torch.Tensor:
    diff_BT = (ref_logprobs_BT - logprobs_BT).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    # expm1(d) - d is exp(d) - 1 - d without the cancellation of 1 - 1 for small d.
    return (torch.expm1(diff_BT) - diff_BT).clamp(-_MAX_LOW_VAR_KL, _MAX_LOW_VAR_KL)


def k3_unclamped(logprobs_BT: torch.Tensor, ref_logprobs_BT: torch.Tensor) -> torch.Tensor:
    """Schulman's k3 ``exp(d) - d - 1``, ``d = ref - logprob``, without ``low_var_kl``'s clamps: one
    wild token shows in a mean (inf where ``exp`` overflows). Not a verl ``kl_penalty`` kind."""
    diff_BT = ref_logprobs_BT - logprobs_BT
    return torch.expm1(diff_BT) - diff_BT


def kl_penalty(
    logprobs_BT: torch.Tensor, ref_logprobs_BT: torch.Tensor, kind: str = "low_var_kl"
) -> torch.Tensor:
    """Per-token KL estimate of shape (B, T) (see the module docstring for ``kind``: a registered name or
    an import path, with an optional ``+``); gradients flow into both arguments."""
    value_BT = KL_ESTIMATORS.get(kind).fn(logprobs_BT, ref_logprobs_BT)
    if not kind.endswith("+"):
        return value_BT
    k2_BT = k2(logprobs_BT, ref_logprobs_BT)
    # Value of the named estimator, gradient of k2 (whose expected gradient is that of the true KL).
    return k2_BT - k2_BT.detach() + value_BT.detach()
