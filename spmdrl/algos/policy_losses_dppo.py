"""The DPPO policy losses (arXiv:2602.04879): a trust region on each token's probability instead of
PPO's clip of the ratio, its divergence the total variation (dppo_tv) or the binary KL (dppo_kl).
Registered when :mod:`spmdrl.algos.policy_losses` is imported (its docstring: the losses' contract).
"""

from __future__ import annotations

import torch

from spmdrl.algos.aggregation import Aggregation, masked_mean
from spmdrl.algos.policy_loss_base import (
    PolicyLossOutput,
    PolicyLossParams,
    as_metric,
    as_token_advantages,
    clamped_ratio,
    register_policy_loss,
    weighted,
)


def _dppo_policy_loss(
    valid_BT: torch.Tensor,
    logprobs_BT: torch.Tensor,
    log_ratio_BT: torch.Tensor,
    ratio_BT: torch.Tensor,
    advantages_BT: torch.Tensor,
    mask_BT: torch.Tensor,
    agg: Aggregation,
    params: PolicyLossParams,
    is_weights_BT: torch.Tensor | None,
) -> PolicyLossOutput:
    """DPPO's shared tail: ``l = -A sg(min(r, clip_ratio_c)) logp`` on the tokens ``valid_BT`` keeps."""
    truncated_BT = ratio_BT.clamp(max=params.clip_ratio_c).detach()
    keep_BT = valid_BT.detach().float()
    loss_BT = -advantages_BT * truncated_BT * logprobs_BT * keep_BT
    loss = agg(weighted(loss_BT, is_weights_BT), mask_BT)
    with torch.no_grad():
        metrics = {
            "pg_clipfrac": as_metric(masked_mean(1.0 - keep_BT, mask_BT)),
            "ppo_kl": as_metric(masked_mean(-log_ratio_BT, mask_BT)),
            "pg_clipfrac_lower": as_metric(
                masked_mean((ratio_BT > params.clip_ratio_c).float() * keep_BT, mask_BT)
            ),
        }
    return PolicyLossOutput(loss, metrics)


@register_policy_loss("dppo_tv")
def dppo_tv_policy_loss(
    logprobs_BT: torch.Tensor,
    old_logprobs_BT: torch.Tensor,
    advantages_BT: torch.Tensor,
    mask_BT: torch.Tensor,
    *,
    agg: Aggregation,
    params: PolicyLossParams,
    is_weights_BT: torch.Tensor | None = None,
) -> PolicyLossOutput:
    """``dppo_tv``: DPPO-Binary-TV (Divergence PPO, arXiv:2602.04879; verl ``compute_policy_loss_dppo_tv``).

    PPO's ratio clip replaced by a trust region on the sampled token's probability: with ``p = exp(logp)``,
    ``p_old = exp(old)``, ``r = exp(clamp(logp - old, -20, 20))`` and ``c = clip_ratio_c``::

        keep_t = (p - p_old <= eps_h)    if A > 0
                 (p - p_old >= -eps_l)   otherwise                 (detached)
        l_t    = -A sg(min(r, c)) logp keep_t

    i.e. a policy gradient with a truncated importance weight on the tokens whose probability has not yet
    moved past the threshold in the direction the advantage pushes (the total-variation distance of the
    binary "this token or not" distributions is ``|p - p_old|``). ``clip_ratio_low`` / ``_high`` are
    thresholds on that distance, not on the ratio. Metrics: ``pg_clipfrac`` = fraction of tokens dropped,
    ``pg_clipfrac_lower`` = fraction kept whose ratio exceeds ``c``, ``ppo_kl`` = mean of ``old - logp``
    (clamped).
    """
    advantages_BT = as_token_advantages(advantages_BT, logprobs_BT)
    log_ratio_BT, ratio_BT = clamped_ratio(logprobs_BT, old_logprobs_BT)
    delta_BT = torch.exp(logprobs_BT) - torch.exp(old_logprobs_BT)
    valid_BT = torch.where(
        advantages_BT > 0, delta_BT <= params.clip_ratio_high, delta_BT >= -params.clip_ratio_low
    )
    return _dppo_policy_loss(
        valid_BT, logprobs_BT, log_ratio_BT, ratio_BT, advantages_BT, mask_BT, agg, params, is_weights_BT
    )


@register_policy_loss("dppo_kl")
def dppo_kl_policy_loss(
    logprobs_BT: torch.Tensor,
    old_logprobs_BT: torch.Tensor,
    advantages_BT: torch.Tensor,
    mask_BT: torch.Tensor,
    *,
    agg: Aggregation,
    params: PolicyLossParams,
    is_weights_BT: torch.Tensor | None = None,
) -> PolicyLossOutput:
    """``dppo_kl``: DPPO-Binary-KL (arXiv:2602.04879; verl ``compute_policy_loss_dppo_kl``).

    As ``dppo_tv`` with the KL divergence of the binary distributions ``(p_old, 1 - p_old)`` and
    ``(p, 1 - p)`` as the distance::

        D_t    = p_old (old - logp) + (1 - p_old) log((1 - p_old + 1e-8) / (1 - p + 1e-8))
        keep_t = (D_t <= eps_h or p <= p_old)   if A > 0
                 (D_t <= eps_l or p >= p_old)   otherwise          (detached)
        l_t    = -A sg(min(r, c)) logp keep_t

    A token is only dropped when it has moved too far in the direction its advantage pushes. Metrics as
    ``dppo_tv``.
    """
    advantages_BT = as_token_advantages(advantages_BT, logprobs_BT)
    log_ratio_BT, ratio_BT = clamped_ratio(logprobs_BT, old_logprobs_BT)
    prob_BT, old_prob_BT = torch.exp(logprobs_BT), torch.exp(old_logprobs_BT)
    binary_kl_BT = old_prob_BT * (old_logprobs_BT - logprobs_BT) + (1.0 - old_prob_BT) * torch.log(
        (1.0 - old_prob_BT + 1e-8) / (1.0 - prob_BT + 1e-8)
    )
    valid_BT = torch.where(
        advantages_BT > 0,
        (binary_kl_BT <= params.clip_ratio_high) | (prob_BT <= old_prob_BT),
        (binary_kl_BT <= params.clip_ratio_low) | (prob_BT >= old_prob_BT),
    )
    return _dppo_policy_loss(
        valid_BT, logprobs_BT, log_ratio_BT, ratio_BT, advantages_BT, mask_BT, agg, params, is_weights_BT
    )
