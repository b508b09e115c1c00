"""What every policy loss shares (:mod:`spmdrl.algos.policy_losses`): the types of its signature, the
registry that names it, and the helpers the built-in losses compute with.

The losses themselves, and the documented way to register one, are in
:mod:`spmdrl.algos.policy_losses`: importing it registers every built-in loss.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from spmdrl.algos.aggregation import check_mode, masked_mean
from spmdrl.registry import Registered, Registry

# exp(20) ~ 5e8: far above any useful ratio, far below float32 overflow. verl clamps the log ratio to
# this in vanilla, sapo, cispo, dppo_tv and dppo_kl (and not in gspo, clip_cov, kl_cov, geo_mean, dro:
# neither do we there).
_MAX_LOG_RATIO = 20.0


class RolloutCorrectionParams(Protocol):
    """bypass_mode's rollout correction: spmdrl.config.RolloutCorrectionConfig ("" turns a tool off)."""

    rollout_is: str
    rollout_is_threshold: str
    rollout_is_batch_normalize: bool
    rollout_rs: str
    rollout_rs_threshold: str
    loss_type: str  # "ppo_clip" or "reinforce"


class PolicyLossParams(Protocol):
    """What the built-in losses read from ``params``, under verl's names (``actor.*`` and
    ``actor.policy_loss.*`` in verl's ``actor.yaml``).

    The recipe passes ``cfg.algorithm``, spmdrl.config's ``AlgorithmConfig``: it holds the defaults and its
    validation the ranges, so this module repeats neither (and imports no config). Any object with these
    attributes works, e.g. a test's ``AlgorithmConfig(clip_ratio_high=0.28)``.
    """

    # PPO clip range: r is clipped to [1 - clip_ratio_low, 1 + clip_ratio_high] (vanilla, gspo, cispo,
    # clip_cov; geo_mean clips the log ratio to [-clip_ratio_low, clip_ratio_high]; dppo_tv / dppo_kl
    # read them as the divergence thresholds below / above the old probability).
    clip_ratio_low: float
    clip_ratio_high: float
    # Dual-clip (vanilla): for A < 0 the per-token loss is at most -A * clip_ratio_c (> 1).
    # dppo_tv / dppo_kl truncate their importance weight at it.
    clip_ratio_c: float
    # clip_cov: fraction of valid tokens whose gradient is dropped, chosen among tokens whose
    # centered covariance (A - mean A)(logp - mean logp) lies in (clip_cov_lb, clip_cov_ub).
    clip_cov_ratio: float
    clip_cov_lb: float
    clip_cov_ub: float
    # kl_cov: fraction of valid tokens (largest covariance) that get + ppo_kl_coef * |log r|.
    kl_cov_ratio: float
    ppo_kl_coef: float
    # sapo: temperatures of the soft gate for positive / non-positive advantages.
    tau_pos: float
    tau_neg: float
    # dro: weight of the quadratic log-ratio penalty (None: unset, dro raises).
    dro_beta: float | None
    # bypass_mode: the rollout correction applied inside the loss, and its loss_type.
    rollout_correction: RolloutCorrectionParams


@dataclass
class PolicyLossOutput:
    loss: torch.Tensor  # scalar with gradient: agg(per-token loss)
    metrics: dict[str, torch.Tensor]  # detached 0-dim tensors under verl's names


PolicyLossFn = Callable[..., PolicyLossOutput]


# ---------------------------------------------------------------------------------------------- registry


@dataclass(frozen=True)
class PolicyLoss(Registered):
    """A registered policy loss and what it declares."""

    # The aggregation mode of the policy term whatever algorithm.loss_agg_mode says (verl 0.9.1 forces
    # seq-mean-token-mean on sapo and geo_mean); None: the configured mode. The entropy and KL terms
    # always keep the configured mode, as in verl.
    agg_mode: str | None = None
    # A config section's dataclass (spmdrl.config.register_config_section) whose values the loss is also
    # called with, as ``section=``: a loss's own hyperparameters, typed and validated with the config.
    section: type | None = None
    # The loss reads how many valid tokens its micro-batch has (clip_cov and kl_cov pick a fraction of
    # them): it is also called with ``num_valid_tokens=``, the mask's count of ones known on the host (the
    # update plans it from the rows' lengths), or None where the caller does not know it, and the loss
    # reads it from the device. Reading it there per micro-batch would stop a GPU's queue each time.
    valid_count: bool = False

    def extra_kwargs(self) -> tuple[str, ...]:
        return (("section",) if self.section is not None else ()) + (
            ("num_valid_tokens",) if self.valid_count else ()
        )


POLICY_LOSSES: Registry[PolicyLoss] = Registry(
    "policy loss",
    PolicyLoss,
    decorator="register_policy_loss",
    args=("logprobs_BT", "old_logprobs_BT", "advantages_BT", "mask_BT"),
    kwargs=("agg", "params", "is_weights_BT"),
)


def register_policy_loss(
    name: str, *, agg_mode: str | None = None, section: type | None = None, valid_count: bool = False
) -> Callable[[PolicyLossFn], PolicyLossFn]:
    """Registers the decorated loss as ``algorithm.policy_loss=name``. ``agg_mode``: the loss_agg_mode
    its policy term is always reduced with (None: algorithm.loss_agg_mode). ``section``: a registered
    config section's dataclass; the loss is then also called with ``section=`` its values (the loss's
    own hyperparameters: ``my_section.my_coef=0.1`` on the command line). ``valid_count``: the loss is
    also called with ``num_valid_tokens=``, its mask's count of ones on the host (None: unknown)."""
    if agg_mode is not None:
        check_mode(agg_mode)
    return POLICY_LOSSES.register(name, agg_mode=agg_mode, section=section, valid_count=valid_count)


def policy_loss(name: str) -> PolicyLossFn:
    """The policy loss ``name`` (``algorithm.policy_loss``: a registered name or an import path)."""
    return POLICY_LOSSES.get(name).fn


def agg_mode_for(name: str, configured_mode: str) -> str:
    """The aggregation mode of loss ``name``'s policy term given the configured ``loss_agg_mode``: the
    one the loss declared (sapo and geo_mean, as verl 0.9.1 does), else ``configured_mode``. The entropy
    and KL terms always use ``configured_mode``; gspo was forced up to verl 0.8 and honours it since."""
    return POLICY_LOSSES.get(name).agg_mode or configured_mode


# ---------------------------------------------------------------------------------------------- helpers


def as_token_advantages(advantages: torch.Tensor, logprobs_BT: torch.Tensor) -> torch.Tensor:
    """Per-token advantages (B, T): a (B,) tensor is broadcast over the T positions."""
    if advantages.dim() == 1 and advantages.shape[0] == logprobs_BT.shape[0]:
        return advantages.unsqueeze(-1).expand_as(logprobs_BT)
    if advantages.shape == logprobs_BT.shape:
        return advantages
    raise ValueError(
        f"advantages must have shape (B,) or (B, T) = {tuple(logprobs_BT.shape)}, got {tuple(advantages.shape)}"
    )


def seq_masked_mean(x_BT: torch.Tensor, mask_BT: torch.Tensor) -> torch.Tensor:
    """Per-sequence mean over valid tokens, shape (B,); 0 for a sequence with none."""
    return masked_mean(x_BT, mask_BT, dim=-1)


def clamped_ratio(
    logprobs_BT: torch.Tensor, old_logprobs_BT: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(log r, r)`` with ``log r`` clamped to +-20, so a token whose probability moved by e^20 cannot
    overflow ``exp`` into inf / NaN (verl's clamp for vanilla, sapo and cispo)."""
    log_ratio_BT = (logprobs_BT - old_logprobs_BT).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    return log_ratio_BT, torch.exp(log_ratio_BT)


def weighted(loss_BT: torch.Tensor, is_weights_BT: torch.Tensor | None) -> torch.Tensor:
    # Importance weights change the measure the expectation is taken under, not the objective: no
    # gradient flows into them.
    return loss_BT if is_weights_BT is None else loss_BT * is_weights_BT.detach()


def valid_positions(valid_BT: torch.Tensor, n_valid: int) -> torch.Tensor:
    """The flat (row-major) positions of ``valid_BT``'s ``n_valid`` ones, in order: what
    ``nonzero`` gives, without reading their count from the device (the caller knows it)."""
    flat = valid_BT.reshape(-1)
    seen = torch.cumsum(flat, 0)  # valid tokens up to and including each position
    at = torch.arange(flat.numel(), device=flat.device)
    # A stable partition, valid first: each valid token goes to its rank among the valid ones, each
    # other one after them, to its rank among the others (every slot is written once).
    dest = torch.where(flat, seen - 1, n_valid + at - seen)
    return torch.empty_like(at).scatter_(0, dest, at)[:n_valid]


def as_metric(x: torch.Tensor) -> torch.Tensor:
    return x.detach().float()


def zero_metric(like: torch.Tensor) -> torch.Tensor:
    return torch.zeros((), dtype=torch.float32, device=like.device)
