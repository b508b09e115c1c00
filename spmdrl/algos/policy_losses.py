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
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from spmdrl.algos.aggregation import Aggregation, check_mode, masked_mean
from spmdrl.algos.correction import rollout_correction
from spmdrl.registry import Registered, Registry
from spmdrl.transfer import to_device

# exp(20) ~ 5e8: far above any useful ratio, far below float32 overflow. verl clamps the log ratio to
# this in vanilla, sapo, cispo, dppo_tv and dppo_kl (and not in gspo, clip_cov, kl_cov, geo_mean, dro:
# neither do we there).
_MAX_LOG_RATIO = 20.0
# gspo clamps its (sequence) log ratio from above only, at 10, as verl does.
_GSPO_MAX_LOG_RATIO = 10.0


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


def _clamped_ratio(
    logprobs_BT: torch.Tensor, old_logprobs_BT: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(log r, r)`` with ``log r`` clamped to +-20, so a token whose probability moved by e^20 cannot
    overflow ``exp`` into inf / NaN (verl's clamp for vanilla, sapo and cispo)."""
    log_ratio_BT = (logprobs_BT - old_logprobs_BT).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    return log_ratio_BT, torch.exp(log_ratio_BT)


def _weighted(loss_BT: torch.Tensor, is_weights_BT: torch.Tensor | None) -> torch.Tensor:
    # Importance weights change the measure the expectation is taken under, not the objective: no
    # gradient flows into them.
    return loss_BT if is_weights_BT is None else loss_BT * is_weights_BT.detach()


def _valid_positions(valid_BT: torch.Tensor, n_valid: int) -> torch.Tensor:
    """The flat (row-major) positions of ``valid_BT``'s ``n_valid`` ones, in order: what
    ``nonzero`` gives, without reading their count from the device (the caller knows it)."""
    flat = valid_BT.reshape(-1)
    seen = torch.cumsum(flat, 0)  # valid tokens up to and including each position
    at = torch.arange(flat.numel(), device=flat.device)
    # A stable partition, valid first: each valid token goes to its rank among the valid ones, each
    # other one after them, to its rank among the others (every slot is written once).
    dest = torch.where(flat, seen - 1, n_valid + at - seen)
    return torch.empty_like(at).scatter_(0, dest, at)[:n_valid]


def _metric(x: torch.Tensor) -> torch.Tensor:
    return x.detach().float()


def _zero(like: torch.Tensor) -> torch.Tensor:
    return torch.zeros((), dtype=torch.float32, device=like.device)


# ---------------------------------------------------------------------------------------------- losses


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
    log_ratio_BT, ratio_BT = _clamped_ratio(logprobs_BT, old_logprobs_BT)
    unclipped_BT = -advantages_BT * ratio_BT
    clipped_BT = -advantages_BT * ratio_BT.clamp(1.0 - params.clip_ratio_low, 1.0 + params.clip_ratio_high)
    clip1_BT = torch.maximum(unclipped_BT, clipped_BT)
    dual_BT = -advantages_BT * params.clip_ratio_c
    negative_BT = advantages_BT < 0
    loss_BT = torch.where(negative_BT, torch.minimum(clip1_BT, dual_BT), clip1_BT)
    loss = agg(_weighted(loss_BT, is_weights_BT), mask_BT)
    with torch.no_grad():
        metrics = {
            "pg_clipfrac": _metric(masked_mean((clipped_BT > unclipped_BT).float(), mask_BT)),
            "ppo_kl": _metric(masked_mean(-log_ratio_BT, mask_BT)),
            "pg_clipfrac_lower": _metric(masked_mean(((clip1_BT > dual_BT) & negative_BT).float(), mask_BT)),
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
    loss = agg(_weighted(loss_BT, is_weights_BT), mask_BT)
    with torch.no_grad():
        metrics = {
            "pg_clipfrac": _metric(masked_mean((clipped_BT > unclipped_BT).float(), mask_BT)),
            "ppo_kl": _metric(masked_mean(-log_ratio_BT, mask_BT)),
            "pg_clipfrac_lower": _zero(loss),
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
    log_ratio_BT, ratio_BT = _clamped_ratio(logprobs_BT, old_logprobs_BT)
    # The temperatures filled on the device in the ratio's dtype: torch.tensor(tau, device=...) would copy
    # each from the host per micro-batch (a blocking copy on a GPU).
    tau_BT = torch.where(
        advantages_BT > 0, ratio_BT.new_full((), params.tau_pos), ratio_BT.new_full((), params.tau_neg)
    )
    gate_BT = torch.sigmoid(tau_BT * (ratio_BT - 1.0)) * (4.0 / tau_BT)
    loss_BT = -gate_BT * advantages_BT
    loss = agg(_weighted(loss_BT, is_weights_BT), mask_BT)
    with torch.no_grad():
        metrics = {
            "pg_clipfrac": _zero(loss),
            "ppo_kl": _metric(masked_mean(-log_ratio_BT, mask_BT)),
            "pg_clipfrac_lower": _zero(loss),
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
    return PolicyLossOutput(agg(_weighted(loss_BT, is_weights_BT), mask_BT), {})


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
    loss = agg(_weighted(loss_BT, is_weights_BT), mask_BT)
    with torch.no_grad():
        metrics = {
            "pg_clipfrac": _metric(masked_mean(drawn_BT.float(), mask_BT)),
            "ppo_kl": _metric(masked_mean(-log_ratio_BT, mask_BT)),
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
            valid_N = _valid_positions(valid_BT, n_valid)
            adv_N = advantages_BT.reshape(-1).index_select(0, valid_N).detach()
            logp_N = logprobs_BT.reshape(-1).index_select(0, valid_N).detach()
            cov_N = (adv_N - adv_N.mean()) * (logp_N - logp_N.mean())
            top_K = torch.topk(cov_N, max(1, int(n_valid * params.kl_cov_ratio)), largest=True).indices
            selected_BT.view(-1).index_fill_(0, valid_N[top_K], True)
    loss_BT = torch.where(selected_BT, pg_BT + params.ppo_kl_coef * log_ratio_BT.abs(), pg_BT)
    loss = agg(_weighted(loss_BT, is_weights_BT), mask_BT)
    with torch.no_grad():
        metrics = {"ppo_kl": _metric(masked_mean(log_ratio_BT.abs(), mask_BT))}
    return PolicyLossOutput(loss, metrics)


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
            "pg_clipfrac": _metric(masked_mean((clipped_BT & (advantages_BT > 0)).float(), mask_BT)),
            "ppo_kl": _metric(masked_mean(-log_ratio_BT, mask_BT)),
            "pg_clipfrac_lower": _metric(masked_mean((clipped_BT & (advantages_BT < 0)).float(), mask_BT)),
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
    log_ratio_BT, ratio_BT = _clamped_ratio(logprobs_BT, old_logprobs_BT)
    clipped_ratio_BT = ratio_BT.clamp(1.0 - params.clip_ratio_low, 1.0 + params.clip_ratio_high).detach()
    loss_BT = -clipped_ratio_BT * advantages_BT * logprobs_BT
    loss = agg(_weighted(loss_BT, is_weights_BT), mask_BT)
    with torch.no_grad():
        metrics = {
            "pg_clipfrac": _metric(masked_mean((ratio_BT != clipped_ratio_BT).float(), mask_BT)),
            "ppo_kl": _metric(masked_mean(-log_ratio_BT, mask_BT)),
            "pg_clipfrac_lower": _zero(loss),
        }
    return PolicyLossOutput(loss, metrics)


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
    loss = agg(_weighted(loss_BT, is_weights_BT), mask_BT)
    with torch.no_grad():
        metrics = {
            "pg_clipfrac": _metric(masked_mean(1.0 - keep_BT, mask_BT)),
            "ppo_kl": _metric(masked_mean(-log_ratio_BT, mask_BT)),
            "pg_clipfrac_lower": _metric(
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
    log_ratio_BT, ratio_BT = _clamped_ratio(logprobs_BT, old_logprobs_BT)
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
    log_ratio_BT, ratio_BT = _clamped_ratio(logprobs_BT, old_logprobs_BT)
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
    loss = agg(_weighted(loss_BT, is_weights_BT), mask_BT)
    with torch.no_grad():
        metrics = {"ppo_kl": _metric(masked_mean(-log_ratio_BT, mask_BT))}
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
            agg(_weighted(loss_BT, corr.is_weights_BT), corr.mask_BT),
            {"ppo_kl": _metric(masked_mean(old_logprobs_BT - logprobs_BT.detach(), corr.mask_BT))},
        )
    else:
        out = vanilla_policy_loss(
            logprobs_BT, old_logprobs_BT, advantages_BT, corr.mask_BT, agg=agg, params=params
        )
    out.metrics.update({f"rollout_corr/{k}": v for k, v in corr.metrics.items()})
    return out
