"""KL in the reward (verl's ``algorithm.use_kl_in_reward``): the coefficient controllers and the penalty.

Instead of a KL loss term, the per-token reward is lowered by ``coef * KL(policy || ref)`` before the
advantages are computed (InstructGPT / Ziegler et al. 2019, arXiv:1909.08593). ``coef`` comes from a
controller (verl's ``algorithm.kl_ctrl``): fixed, or adapted toward a target KL after every step.
Formulas follow verl's ``core_algos.FixedKLController`` / ``AdaptiveKLController`` /
``get_kl_controller`` and ``ray_trainer.apply_kl_penalty``.
"""

from __future__ import annotations

import torch

from spmdrl.algos.aggregation import masked_mean
from spmdrl.algos.kl import kl_penalty

KL_CTRL_TYPES = ("fixed", "adaptive")


class FixedKLController:
    """A constant coefficient; ``update`` does nothing."""

    def __init__(self, kl_coef: float) -> None:
        self.value = float(kl_coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        del current_kl, n_steps  # the coefficient is fixed


class AdaptiveKLController:
    """Proportional control of the coefficient toward ``target_kl`` (Ziegler et al. 2019, eq. 2)::

        e     = clip(current_kl / target_kl - 1, -0.2, 0.2)
        value *= 1 + e * n_steps / horizon

    verl passes ``n_steps`` = the batch size (number of sequences) after each step, so ``horizon`` is
    in sequences: the coefficient moves by at most 20% per ``horizon`` sequences.
    """

    def __init__(self, init_kl_coef: float, target_kl: float, horizon: int) -> None:
        if horizon <= 0:
            raise ValueError(f"horizon must be > 0, got {horizon}")
        if target_kl <= 0:
            raise ValueError(f"target_kl must be > 0, got {target_kl}")
        self.value = float(init_kl_coef)
        self.target = float(target_kl)
        self.horizon = horizon

    def update(self, current_kl: float, n_steps: int) -> None:
        error = min(max(current_kl / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_steps / self.horizon


def build_kl_controller(
    ctrl_type: str, kl_coef: float, *, target_kl: float = 0.1, horizon: int = 10000
) -> FixedKLController | AdaptiveKLController:
    """verl's ``get_kl_controller`` from ``algorithm.kl_ctrl.{type, kl_coef, target_kl, horizon}``
    (verl's defaults: fixed, 0.001, 0.1, 10000)."""
    if ctrl_type == "fixed":
        return FixedKLController(kl_coef)
    if ctrl_type == "adaptive":
        return AdaptiveKLController(kl_coef, target_kl, horizon)
    raise ValueError(f"unknown KL controller {ctrl_type!r}; use one of {', '.join(KL_CTRL_TYPES)}")


def apply_kl_penalty(
    token_rewards_BT: torch.Tensor,
    logprobs_BT: torch.Tensor,
    ref_logprobs_BT: torch.Tensor,
    mask_BT: torch.Tensor,
    coef: float,
    kind: str = "kl",
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(token_rewards_BT - coef * kl_BT, mean_kl)``, detached (verl's ``apply_kl_penalty``).

    ``kl_BT = kl_penalty(logprobs_BT, ref_logprobs_BT, kind)`` (verl's ``algorithm.kl_penalty``,
    default ``kl`` = k1), 0 at masked positions; ``logprobs_BT`` are the rollout policy's
    (verl's ``old_log_probs``). ``mean_kl`` is the per-sequence mean over valid tokens, averaged over
    all B sequences (a sequence with no valid token counts as 0, as in verl): feed
    ``float(mean_kl)`` and B to the controller's ``update``.
    """
    with torch.no_grad():
        # where(), not multiplication: masked positions may hold inf or NaN.
        kl_BT = torch.where(mask_BT.bool(), kl_penalty(logprobs_BT, ref_logprobs_BT, kind), 0.0)
        rewards_BT = token_rewards_BT - coef * kl_BT
        mean_kl = masked_mean(kl_BT, mask_BT, dim=-1).mean()
    return rewards_BT, mean_kl
