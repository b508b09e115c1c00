"""The covariance family of policy losses (Cui et al., arXiv:2505.22617): clip_cov drops the gradient
of tokens whose advantage and log-probability covary strongly, kl_cov penalizes them with a KL term.
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
    register_policy_loss,
    valid_positions,
    weighted,
)
from spmdrl.transfer import to_device


@register_policy_loss("clip_cov", valid_count=True)
def clip_cov_policy_loss(
    logprobs_BT: torch.Tensor,
    old_logprobs_BT: torch.Tensor,
    advantages_BT: torch.Tensor,
    mask_BT: torch.Tensor,
    *,
    agg: Aggregation,
    params: PolicyLossParams,
    is_weights_BT: torch.Tensor | None = None,
    num_valid_tokens: int | None = None,
) -> PolicyLossOutput:
    """``clip_cov``: Clip-Cov (Cui et al., "The Entropy Mechanism of RL for Reasoning LMs",
    arXiv:2505.22617; verl ``compute_policy_loss_clip_cov``).

    Entropy collapses through tokens with a large covariance between advantage and log-probability.
    Per valid token, ``cov = (A - mean A)(logp - mean logp)`` (means over this micro-batch's valid tokens,
    detached). Among valid tokens not already clipped by PPO (``-A clip(r) > -A r``) with
    ``clip_cov_lb < cov < clip_cov_ub``, ``max(int(clip_cov_ratio * valid tokens), 1)`` are drawn
    uniformly at random (``torch.randperm``, the global RNG, as verl) and their loss is multiplied by 0::

        l = max(-A r, -A clip(r, 1 - eps_l, 1 + eps_h)) * (0 if drawn else 1),    r = exp(logp - old)

    (no dual-clip, and the log ratio is not clamped, as in verl). Metrics: ``pg_clipfrac`` = fraction
    of valid tokens drawn, ``ppo_kl`` = mean of ``old - logp``.

    ``num_valid_tokens``: ``mask_BT``'s count of ones, if the caller knows it on the host (else it is
    read from the device). The candidates' count is read from the device, once per call: randperm
    draws on the host, so the same seed draws the same tokens as verl.
    """
    advantages_BT = as_token_advantages(advantages_BT, logprobs_BT)
    valid_BT = mask_BT.bool()
    log_ratio_BT = logprobs_BT - old_logprobs_BT
    ratio_BT = torch.exp(log_ratio_BT)
    unclipped_BT = -advantages_BT * ratio_BT
    clipped_BT = -advantages_BT * ratio_BT.clamp(1.0 - params.clip_ratio_low, 1.0 + params.clip_ratio_high)
    with torch.no_grad():
        clipped_by_ppo_BT = (clipped_BT > unclipped_BT) & valid_BT
        cov_BT = (advantages_BT - masked_mean(advantages_BT, mask_BT)) * (
            logprobs_BT - masked_mean(logprobs_BT, mask_BT)
        )
        candidates_BT = (
            (cov_BT > params.clip_cov_lb) & (cov_BT < params.clip_cov_ub) & valid_BT & ~clipped_by_ppo_BT
        )
        # Flat (row-major) positions: nonzero's order for the 2-D mask, so randperm picks the same tokens.
        candidates_N = torch.nonzero(candidates_BT.reshape(-1)).squeeze(1)  # the one device read
        n_valid = int(valid_BT.sum()) if num_valid_tokens is None else num_valid_tokens
        n_draw = max(int(params.clip_cov_ratio * n_valid), 1)
        drawn_BT = torch.zeros_like(valid_BT)
        if len(candidates_N) > 0:
            perm_N = to_device(torch.randperm(len(candidates_N))[:n_draw], candidates_N.device)
            drawn_BT.view(-1).index_fill_(0, candidates_N[perm_N], True)
    loss_BT = torch.where(drawn_BT, 0.0, torch.maximum(unclipped_BT, clipped_BT))
    loss = agg(weighted(loss_BT, is_weights_BT), mask_BT)
    with torch.no_grad():
        metrics = {
            "pg_clipfrac": as_metric(masked_mean(drawn_BT.float(), mask_BT)),
            "ppo_kl": as_metric(masked_mean(-log_ratio_BT, mask_BT)),
        }
    return PolicyLossOutput(loss, metrics)


@register_policy_loss("kl_cov", valid_count=True)
def kl_cov_policy_loss(
    logprobs_BT: torch.Tensor,
    old_logprobs_BT: torch.Tensor,
    advantages_BT: torch.Tensor,
    mask_BT: torch.Tensor,
    *,
    agg: Aggregation,
    params: PolicyLossParams,
    is_weights_BT: torch.Tensor | None = None,
    num_valid_tokens: int | None = None,
) -> PolicyLossOutput:
    """``kl_cov``: KL-Cov (arXiv:2505.22617, as clip_cov; verl ``compute_policy_loss_kl_cov``).

    No clipping. The ``max(1, int(valid tokens * kl_cov_ratio))`` valid tokens with the largest
    ``cov = (A - mean A)(logp - mean logp)`` (detached, means over valid tokens) get a KL penalty::

        l = -A r + (ppo_kl_coef * |logp - old| if selected else 0),     r = exp(logp - old)

    (unclamped log ratio, as in verl). Ties at the k-th covariance are broken by ``torch.topk``.
    Metric: ``ppo_kl`` = mean of ``|logp - old|`` (verl logs the absolute value for this loss).

    ``num_valid_tokens``: ``mask_BT``'s count of ones, if the caller knows it on the host; with it
    nothing is read from the device (without it, the count is).
    """
    advantages_BT = as_token_advantages(advantages_BT, logprobs_BT)
    valid_BT = mask_BT.bool()
    log_ratio_BT = logprobs_BT - old_logprobs_BT
    ratio_BT = torch.exp(log_ratio_BT)
    pg_BT = -advantages_BT * ratio_BT
    with torch.no_grad():
        selected_BT = torch.zeros_like(valid_BT)
        n_valid = int(valid_BT.sum()) if num_valid_tokens is None else num_valid_tokens
        if n_valid > 0:
            # The valid tokens in a boolean index's order, gathered without its read of their count.
            valid_N = valid_positions(valid_BT, n_valid)
            adv_N = advantages_BT.reshape(-1).index_select(0, valid_N).detach()
            logp_N = logprobs_BT.reshape(-1).index_select(0, valid_N).detach()
            cov_N = (adv_N - adv_N.mean()) * (logp_N - logp_N.mean())
            top_K = torch.topk(cov_N, max(1, int(n_valid * params.kl_cov_ratio)), largest=True).indices
            selected_BT.view(-1).index_fill_(0, valid_N[top_K], True)
    loss_BT = torch.where(selected_BT, pg_BT + params.ppo_kl_coef * log_ratio_BT.abs(), pg_BT)
    loss = agg(weighted(loss_BT, is_weights_BT), mask_BT)
    with torch.no_grad():
        metrics = {"ppo_kl": as_metric(masked_mean(log_ratio_BT.abs(), mask_BT))}
    return PolicyLossOutput(loss, metrics)
