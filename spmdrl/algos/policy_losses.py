"""Policy losses by verl's names (verl's ``actor.policy_loss.loss_mode``; spmdrl: ``algorithm.policy_loss``).

Every loss is a pure function with one signature, registered under its name by the decorator above it::

    @register_policy_loss("my_loss")
    def my_loss(logprobs_BT, old_logprobs_BT, advantages_BT, mask_BT, *, agg, params, is_weights_BT=None)
        -> PolicyLossOutput

``logprobs_BT`` carries the gradient (the policy being trained), ``old_logprobs_BT`` is the policy that
PPO's ratio ``r = exp(logprobs - old_logprobs)`` divides by, ``advantages_BT`` is per token (a per
sequence ``(B,)`` tensor is broadcast over T), ``is_weights_BT`` are detached rollout-correction weights
(:mod:`spmdrl.algos.correction`) that multiply the per-token loss. The per-token loss is reduced by
``agg`` (:class:`~spmdrl.algos.aggregation.Aggregation`: sum / global count), never by a local mean, so
the gradient does not depend on how the mini-batch is split. ``params`` is the algorithm's config section
(:class:`PolicyLossParams` lists what the built-in losses read of it).

``algorithm.policy_loss`` is a registered name, or a loss given by import path (``my_pkg.losses:my_loss``,
``path/to/losses.py:my_loss``). A loss whose policy term must be reduced by a mode of its own, whatever
``algorithm.loss_agg_mode`` says, declares it: ``@register_policy_loss("sapo", agg_mode=...)``;
:func:`agg_mode_for` gives the mode the recipe builds the policy term's ``agg`` with. A loss that needs
the number of valid tokens as a Python int declares ``valid_count=True`` and is called with
``num_valid_tokens=`` (the update knows it on the host).

Metrics are detached 0-dim tensors under verl's names (verl logs them as ``actor/<name>``), each a mean
over this micro-batch's valid tokens; they are not ``.item()``-ed here, so computing them does not
synchronize the device. Nor do the losses read the device otherwise (docs/performance.md, "No sync in
the micro-batch loop"), except clip_cov: its draw needs its candidates' count on the host.

The formulas follow ``verl/trainer/ppo/core_algos.py`` (``compute_policy_loss_<name>``), re-derived here;
each function's docstring gives its formula and the paper.

This module holds the core losses and is where a loss is registered from: importing it registers every
built-in one. The covariance family (clip_cov, kl_cov) is in :mod:`spmdrl.algos.policy_losses_cov`, DPPO's
(dppo_tv, dppo_kl) in :mod:`spmdrl.algos.policy_losses_dppo`; the registry, the types and the helpers
they share in :mod:`spmdrl.algos.policy_loss_base`.
"""

from __future__ import annotations

import torch

from spmdrl.algos.aggregation import Aggregation, masked_mean
from spmdrl.algos.correction import rollout_correction
from spmdrl.algos.policy_loss_base import (
    POLICY_LOSSES,
    PolicyLoss,
    PolicyLossFn,
    PolicyLossOutput,
    PolicyLossParams,
    RolloutCorrectionParams,
    agg_mode_for,
    as_metric,
    as_token_advantages,
    clamped_ratio,
    policy_loss,
    register_policy_loss,
    seq_masked_mean,
    weighted,
    zero_metric,
)

# What a user's loss and the library import from here (docs/forking.md, docs/algorithms.md): the registry,
# the loss's types, and the losses defined in this module.
__all__ = [
    "POLICY_LOSSES",
    "PolicyLoss",
    "PolicyLossFn",
    "PolicyLossOutput",
    "PolicyLossParams",
    "RolloutCorrectionParams",
    "agg_mode_for",
    "as_token_advantages",
    "bypass_mode_policy_loss",
    "cispo_policy_loss",
    "dro_policy_loss",
    "geo_mean_policy_loss",
    "gpg_policy_loss",
    "gspo_policy_loss",
    "policy_loss",
    "register_policy_loss",
    "sapo_policy_loss",
    "seq_masked_mean",
    "vanilla_policy_loss",
]

# gspo clamps its (sequence) log ratio from above only, at 10, as verl does.
_GSPO_MAX_LOG_RATIO = 10.0


@register_policy_loss("vanilla")
def vanilla_policy_loss(
    logprobs_BT: torch.Tensor,
    old_logprobs_BT: torch.Tensor,
    advantages_BT: torch.Tensor,
    mask_BT: torch.Tensor,
    *,
    agg: Aggregation,
    params: PolicyLossParams,
    is_weights_BT: torch.Tensor | None = None,
) -> PolicyLossOutput:
    """``vanilla``: PPO's clipped surrogate with clip-higher and dual-clip (verl ``compute_policy_loss_vanilla``).

    With ``r = exp(clamp(logp - old, -20, 20))``, ``eps_l = clip_ratio_low``, ``eps_h = clip_ratio_high``,
    ``c = clip_ratio_c``::

        l1 = max(-A r, -A clip(r, 1 - eps_l, 1 + eps_h))        (Schulman et al. 2017; DAPO's clip-higher)
        l  = l1                       if A >= 0
             min(l1, -A c)            if A < 0                  (dual-clip, Ye et al. 2019, arXiv:1912.09729)

    Dual-clip bounds the loss (and zeroes the gradient) of a negative-advantage token whose ratio has
    grown past ``c``: without it ``-A r`` is unbounded. Metrics: ``pg_clipfrac`` = fraction of tokens with
    ``-A clip(r) > -A r``; ``pg_clipfrac_lower`` = fraction with ``A < 0`` and ``l1 > -A c``;
    ``ppo_kl`` = mean of ``old - logp`` (k1 of KL(old || new)).
    """
    advantages_BT = as_token_advantages(advantages_BT, logprobs_BT)
    log_ratio_BT, ratio_BT = clamped_ratio(logprobs_BT, old_logprobs_BT)
    unclipped_BT = -advantages_BT * ratio_BT
    clipped_BT = -advantages_BT * ratio_BT.clamp(1.0 - params.clip_ratio_low, 1.0 + params.clip_ratio_high)
    clip1_BT = torch.maximum(unclipped_BT, clipped_BT)
    dual_BT = -advantages_BT * params.clip_ratio_c
    negative_BT = advantages_BT < 0
    loss_BT = torch.where(negative_BT, torch.minimum(clip1_BT, dual_BT), clip1_BT)
    loss = agg(weighted(loss_BT, is_weights_BT), mask_BT)
    with torch.no_grad():
        metrics = {
            "pg_clipfrac": as_metric(masked_mean((clipped_BT > unclipped_BT).float(), mask_BT)),
            "ppo_kl": as_metric(masked_mean(-log_ratio_BT, mask_BT)),
            "pg_clipfrac_lower": as_metric(
                masked_mean(((clip1_BT > dual_BT) & negative_BT).float(), mask_BT)
            ),
        }
    return PolicyLossOutput(loss, metrics)


@register_policy_loss("gspo")
def gspo_policy_loss(
    logprobs_BT: torch.Tensor,
    old_logprobs_BT: torch.Tensor,
    advantages_BT: torch.Tensor,
    mask_BT: torch.Tensor,
    *,
    agg: Aggregation,
    params: PolicyLossParams,
    is_weights_BT: torch.Tensor | None = None,
) -> PolicyLossOutput:
    """``gspo``: Group Sequence Policy Optimization (arXiv:2507.18071; verl ``compute_policy_loss_gspo``).

    The ratio is the sequence's length-normalized likelihood ratio
    ``s_i = exp(mean_t (logp - old))``, applied per token with the token's own gradient::

        log s_it = sg(log s_i) + logp_t - sg(logp_t)       (clamped above at 10)
        l_t      = max(-A s_it, -A clip(s_it, 1 - eps_l, 1 + eps_h))

    so every token of a sequence shares one value and one clipping decision, and the gradient is
    ``s_i * grad logp_t`` per token. Reduced by the configured ``loss_agg_mode``, as verl 0.9.1 does
    (up to 0.8 verl forced ``seq-mean-token-mean``, the paper's sequence-level mean; set
    ``loss_agg_mode=seq-mean-token-mean`` for it). Metrics: ``pg_clipfrac`` (tokens whose clipped term
    won), ``ppo_kl`` (mean of ``old - logp``, unclamped), ``pg_clipfrac_lower`` = 0.
    """
    advantages_BT = as_token_advantages(advantages_BT, logprobs_BT)
    log_ratio_BT = logprobs_BT - old_logprobs_BT
    seq_log_ratio_B = seq_masked_mean(log_ratio_BT, mask_BT)
    log_seq_ratio_BT = logprobs_BT - logprobs_BT.detach() + seq_log_ratio_B.detach().unsqueeze(-1)
    seq_ratio_BT = torch.exp(log_seq_ratio_BT.clamp(max=_GSPO_MAX_LOG_RATIO))
    unclipped_BT = -advantages_BT * seq_ratio_BT
    clipped_BT = -advantages_BT * seq_ratio_BT.clamp(
        1.0 - params.clip_ratio_low, 1.0 + params.clip_ratio_high
    )
    loss_BT = torch.maximum(unclipped_BT, clipped_BT)
    loss = agg(weighted(loss_BT, is_weights_BT), mask_BT)
    with torch.no_grad():
        metrics = {
            "pg_clipfrac": as_metric(masked_mean((clipped_BT > unclipped_BT).float(), mask_BT)),
            "ppo_kl": as_metric(masked_mean(-log_ratio_BT, mask_BT)),
            "pg_clipfrac_lower": zero_metric(loss),
        }
    return PolicyLossOutput(loss, metrics)


@register_policy_loss("sapo", agg_mode="seq-mean-token-mean")
def sapo_policy_loss(
    logprobs_BT: torch.Tensor,
    old_logprobs_BT: torch.Tensor,
    advantages_BT: torch.Tensor,
    mask_BT: torch.Tensor,
    *,
    agg: Aggregation,
    params: PolicyLossParams,
    is_weights_BT: torch.Tensor | None = None,
) -> PolicyLossOutput:
    """``sapo``: Soft Adaptive Policy Optimization (arXiv:2511.20347; verl ``compute_policy_loss_sapo``).

    A smooth gate replaces the hard clip. With ``r = exp(clamp(logp - old, -20, 20))`` and
    ``tau = tau_pos if A > 0 else tau_neg``::

        f(r) = sigmoid(tau (r - 1)) * 4 / tau,       l = -f(r) A

    ``f(1) = 2 / tau`` and ``f'(r) = 4 sigmoid'(tau (r - 1))`` peaks at r = 1 and decays as r leaves 1, so
    far-off-policy tokens get a vanishing (not zero) gradient; a larger ``tau_neg`` damps negative
    updates faster. Declares ``agg_mode="seq-mean-token-mean"`` (verl 0.9.1 forces it). Metrics:
    ``ppo_kl``; ``pg_clipfrac`` and ``pg_clipfrac_lower`` are 0 (nothing is clipped).
    """
    advantages_BT = as_token_advantages(advantages_BT, logprobs_BT)
    log_ratio_BT, ratio_BT = clamped_ratio(logprobs_BT, old_logprobs_BT)
    # The temperatures filled on the device in the ratio's dtype: torch.tensor(tau, device=...) would copy
    # each from the host per micro-batch (a blocking copy on a GPU).
    tau_BT = torch.where(
        advantages_BT > 0, ratio_BT.new_full((), params.tau_pos), ratio_BT.new_full((), params.tau_neg)
    )
    gate_BT = torch.sigmoid(tau_BT * (ratio_BT - 1.0)) * (4.0 / tau_BT)
    loss_BT = -gate_BT * advantages_BT
    loss = agg(weighted(loss_BT, is_weights_BT), mask_BT)
    with torch.no_grad():
        metrics = {
            "pg_clipfrac": zero_metric(loss),
            "ppo_kl": as_metric(masked_mean(-log_ratio_BT, mask_BT)),
            "pg_clipfrac_lower": zero_metric(loss),
        }
    return PolicyLossOutput(loss, metrics)


@register_policy_loss("gpg")
def gpg_policy_loss(
    logprobs_BT: torch.Tensor,
    old_logprobs_BT: torch.Tensor,
    advantages_BT: torch.Tensor,
    mask_BT: torch.Tensor,
    *,
    agg: Aggregation,
    params: PolicyLossParams,
    is_weights_BT: torch.Tensor | None = None,
) -> PolicyLossOutput:
    """``gpg``: Group Policy Gradient (arXiv:2504.02546; verl ``compute_policy_loss_gpg``).

    Plain REINFORCE with no ratio and no clip: ``l = -A logp``. ``old_logprobs_BT`` and ``params`` are
    unused (the signature is shared). No metrics, as in verl.
    """
    del old_logprobs_BT, params  # shared signature; GPG needs neither
    advantages_BT = as_token_advantages(advantages_BT, logprobs_BT)
    loss_BT = -logprobs_BT * advantages_BT
    return PolicyLossOutput(agg(weighted(loss_BT, is_weights_BT), mask_BT), {})


@register_policy_loss("geo_mean", agg_mode="seq-mean-token-mean")
def geo_mean_policy_loss(
    logprobs_BT: torch.Tensor,
    old_logprobs_BT: torch.Tensor,
    advantages_BT: torch.Tensor,
    mask_BT: torch.Tensor,
    *,
    agg: Aggregation,
    params: PolicyLossParams,
    is_weights_BT: torch.Tensor | None = None,
) -> PolicyLossOutput:
    """``geo_mean``: Geometric-Mean Policy Optimization (GMPO, arXiv:2507.20673; verl
    ``compute_policy_loss_geo_mean``).

    The sequence ratio is the geometric mean of token ratios, each clipped in log space (the
    pessimistic side of the clip, per the advantage's sign)::

        d_t   = logp_t - old_t,      c_t = clip(d_t, -clip_ratio_low, clip_ratio_high)
        m_t   = sign(A) * min(sign(A) d_t, sign(A) c_t)
        rho_i = exp(mean_t m_t),     A_i = mean_t A_t,      L_i = -A_i rho_i

    If ``is_weights_BT`` is given, ``L_i`` is multiplied by the geometric mean of the sequence's weights,
    ``exp(mean_t log(w_t + 1e-10))`` (as verl). verl returns the plain mean of ``L_i`` over sequences and
    ignores ``loss_agg_mode``; here ``L_i`` is put on each valid token of its sequence and reduced by
    ``agg``, so ``agg.mode == "seq-mean-token-mean"`` gives verl's loss (a mean over sequences with at
    least one valid token). Metrics: ``pg_clipfrac`` / ``pg_clipfrac_lower`` = fraction of valid tokens
    with ``c_t != d_t`` and ``A > 0`` / ``A < 0``; ``ppo_kl`` = mean of ``old - logp``.
    """
    advantages_BT = as_token_advantages(advantages_BT, logprobs_BT)
    valid_BT = mask_BT.bool()
    log_ratio_BT = logprobs_BT - old_logprobs_BT
    log_ratio_clamped_BT = log_ratio_BT.clamp(-params.clip_ratio_low, params.clip_ratio_high)
    sign_BT = torch.sign(advantages_BT)
    pessimistic_BT = sign_BT * torch.minimum(sign_BT * log_ratio_BT, sign_BT * log_ratio_clamped_BT)
    ratio_B = torch.exp(seq_masked_mean(pessimistic_BT, mask_BT))
    advantage_B = seq_masked_mean(advantages_BT, mask_BT)
    loss_B = -advantage_B * ratio_B
    if is_weights_BT is not None:
        log_w_BT = torch.log(is_weights_BT.detach() + 1e-10)
        loss_B = loss_B * torch.exp(seq_masked_mean(log_w_BT, mask_BT))
    loss_BT = loss_B.unsqueeze(-1).expand_as(logprobs_BT)
    loss = agg(loss_BT, mask_BT)
    with torch.no_grad():
        clipped_BT = (log_ratio_BT != log_ratio_clamped_BT) & valid_BT
        metrics = {
            "pg_clipfrac": as_metric(masked_mean((clipped_BT & (advantages_BT > 0)).float(), mask_BT)),
            "ppo_kl": as_metric(masked_mean(-log_ratio_BT, mask_BT)),
            "pg_clipfrac_lower": as_metric(masked_mean((clipped_BT & (advantages_BT < 0)).float(), mask_BT)),
        }
    return PolicyLossOutput(loss, metrics)


@register_policy_loss("cispo")
def cispo_policy_loss(
    logprobs_BT: torch.Tensor,
    old_logprobs_BT: torch.Tensor,
    advantages_BT: torch.Tensor,
    mask_BT: torch.Tensor,
    *,
    agg: Aggregation,
    params: PolicyLossParams,
    is_weights_BT: torch.Tensor | None = None,
) -> PolicyLossOutput:
    """``cispo``: Clipped IS-weight Policy Optimization (MiniMax-M1, arXiv:2506.13585; verl
    ``compute_policy_loss_cispo``).

    The importance weight is clipped and detached; the gradient flows only through ``logp``::

        l = -sg(clip(r, 1 - eps_l, 1 + eps_h)) * A * logp,       r = exp(clamp(logp - old, -20, 20))

    Unlike PPO's clip, a clipped token still contributes a gradient (scaled by the clip bound), so no
    token's update is dropped. Metrics: ``pg_clipfrac`` = fraction of valid tokens whose ratio was
    clipped, ``ppo_kl`` = mean of ``old - logp``, ``pg_clipfrac_lower`` = 0.
    """
    advantages_BT = as_token_advantages(advantages_BT, logprobs_BT)
    log_ratio_BT, ratio_BT = clamped_ratio(logprobs_BT, old_logprobs_BT)
    clipped_ratio_BT = ratio_BT.clamp(1.0 - params.clip_ratio_low, 1.0 + params.clip_ratio_high).detach()
    loss_BT = -clipped_ratio_BT * advantages_BT * logprobs_BT
    loss = agg(weighted(loss_BT, is_weights_BT), mask_BT)
    with torch.no_grad():
        metrics = {
            "pg_clipfrac": as_metric(masked_mean((ratio_BT != clipped_ratio_BT).float(), mask_BT)),
            "ppo_kl": as_metric(masked_mean(-log_ratio_BT, mask_BT)),
            "pg_clipfrac_lower": zero_metric(loss),
        }
    return PolicyLossOutput(loss, metrics)


@register_policy_loss("dro")
def dro_policy_loss(
    logprobs_BT: torch.Tensor,
    old_logprobs_BT: torch.Tensor,
    advantages_BT: torch.Tensor,
    mask_BT: torch.Tensor,
    *,
    agg: Aggregation,
    params: PolicyLossParams,
    is_weights_BT: torch.Tensor | None = None,
) -> PolicyLossOutput:
    """``dro``: Direct Reward Optimization with a quadratic log-ratio penalty (Richemond et al.,
    arXiv:2405.19107; verl ``compute_policy_loss_dro``)::

        l_t = -(A logp - beta / 2 (logp - old)^2),       beta = dro_beta > 0

    A policy gradient regularised towards the old policy by a squared log ratio (unclamped), in place
    of a clip. Metric: ``ppo_kl`` = mean of ``old - logp``.
    """
    beta = params.dro_beta
    if beta is None or beta <= 0:
        raise ValueError(f"the dro policy loss needs algorithm.dro_beta > 0, got {beta}")
    advantages_BT = as_token_advantages(advantages_BT, logprobs_BT)
    log_ratio_BT = logprobs_BT - old_logprobs_BT
    loss_BT = -(logprobs_BT * advantages_BT - 0.5 * beta * log_ratio_BT.square())
    loss = agg(weighted(loss_BT, is_weights_BT), mask_BT)
    with torch.no_grad():
        metrics = {"ppo_kl": as_metric(masked_mean(-log_ratio_BT, mask_BT))}
    return PolicyLossOutput(loss, metrics)


@register_policy_loss("bypass_mode")
def bypass_mode_policy_loss(
    logprobs_BT: torch.Tensor,
    old_logprobs_BT: torch.Tensor,
    advantages_BT: torch.Tensor,
    mask_BT: torch.Tensor,
    *,
    agg: Aggregation,
    params: PolicyLossParams,
    is_weights_BT: torch.Tensor | None = None,
) -> PolicyLossOutput:
    """``bypass_mode``: the rollout correction inside the loss, with the rollout policy as the old one
    (verl ``compute_policy_loss_bypass_mode``; "When Speed Kills Stability", Liu et al. 2025).

    verl's ``algorithm.rollout_correction.bypass_mode=true`` skips the old-logprob pass: the engine's
    logprobs are the old ones, so ``old_logprobs_BT`` here *is* the rollout policy. Per micro-batch,
    :func:`~spmdrl.algos.correction.rollout_correction` of ``(sg(logp), old)`` (``params.rollout_correction``:
    ``rollout_is``, ``rollout_is_threshold``, ``rollout_is_batch_normalize``, ``rollout_rs``,
    ``rollout_rs_threshold``) gives weights ``w`` and a rejection mask ``m'``, then with
    ``loss_type``:

    - ``ppo_clip``: ``vanilla`` on ``m'`` with ``r = pi / pi_rollout``, no weights (the ratio is already
      the importance weight, the clip bounds it);
    - ``reinforce``: ``l = -A logp w`` on ``m'`` (``w`` = 1 without ``rollout_is``); ``ppo_kl`` = mean of
      ``old - logp``.

    ``is_weights_BT`` is ignored (the weights are computed here, as verl). The aggregation's counts are
    those of the mask before rejection, as verl's are. The correction's metrics join the loss's as
    ``rollout_corr/<name>``.
    """
    del is_weights_BT  # computed here from the current policy, as in verl
    rc = params.rollout_correction
    corr = rollout_correction(
        logprobs_BT.detach(),
        old_logprobs_BT,
        mask_BT,
        rollout_is=rc.rollout_is or None,
        rollout_is_threshold=rc.rollout_is_threshold,
        rollout_is_batch_normalize=rc.rollout_is_batch_normalize,
        rollout_rs=rc.rollout_rs or None,
        rollout_rs_threshold=rc.rollout_rs_threshold or None,
    )
    if rc.loss_type == "reinforce":
        advantages_BT = as_token_advantages(advantages_BT, logprobs_BT)
        loss_BT = -advantages_BT * logprobs_BT
        out = PolicyLossOutput(
            agg(weighted(loss_BT, corr.is_weights_BT), corr.mask_BT),
            {"ppo_kl": as_metric(masked_mean(old_logprobs_BT - logprobs_BT.detach(), corr.mask_BT))},
        )
    else:
        out = vanilla_policy_loss(
            logprobs_BT, old_logprobs_BT, advantages_BT, corr.mask_BT, agg=agg, params=params
        )
    out.metrics.update({f"rollout_corr/{k}": v for k, v in corr.metrics.items()})
    return out


# The other families live in modules of their own and register their losses when imported: here, after
# this module's, so that importing this module registers every built-in loss, the core ones listed first.
from spmdrl.algos import policy_losses_cov, policy_losses_dppo  # noqa: E402, F401
