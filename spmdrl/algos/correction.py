"""Rollout correction: importance weights and rejection masks for the rollout-vs-trainer mismatch.

vLLM samples the tokens, but the trainer's forward (other kernels, other precision, maybe an older or
newer checkpoint) gives them slightly different probabilities, so PPO's "old" policy is not the one the
tokens came from. With ``log r = trainer_old_logprob - rollout_logprob`` per token, verl's rollout
correction (``verl/trainer/ppo/rollout_corr_helper.py``; config ``algorithm.rollout_correction``,
``docs/algo/rollout_corr.md``) offers two independent tools, re-implemented here as pure functions:

- **IS weights** (``rollout_is``: ``"token"`` or ``"sequence"``): ``w = exp(log r)`` per token, or
  ``exp(sum_t log r_t)`` (the product of the token ratios) for every token of a sequence, with the log
  clamped to [-20, 20] and ``w`` truncated at ``rollout_is_threshold`` (TIS). They multiply the
  per-token policy loss (``is_weights_BT``) and carry no gradient. Optional
  ``rollout_is_batch_normalize`` rescales them to mean 1.
- **Rejection** (``rollout_rs``, ``rollout_rs_threshold``): tokens, or whole sequences, whose divergence
  statistic falls outside its bounds are removed from the loss mask.

Metrics use verl's names without its ``rollout_corr/`` prefix; they are detached 0-dim tensors (no
device sync here).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from spmdrl.algos.aggregation import masked_mean

# exp(+-20) bounds every weight to [2e-9, 5e8] before truncation, as verl's SAFETY_BOUND.
_SAFETY_BOUND = 20.0

IS_LEVELS = ("token", "sequence")
RS_OPTIONS = (
    "token_k1",
    "token_k2",
    "token_k3",
    "seq_sum_k1",
    "seq_sum_k2",
    "seq_sum_k3",
    "seq_mean_k1",
    "seq_mean_k2",
    "seq_mean_k3",
    "seq_max_k2",
    "seq_max_k3",
)


@dataclass
class RolloutCorrection:
    is_weights_BT: (
        torch.Tensor | None
    )  # detached, 0 where mask_BT (the input mask) is 0; None if rollout_is is None
    mask_BT: torch.Tensor  # the input mask with rejected tokens set to 0
    metrics: dict[str, torch.Tensor]  # detached 0-dim tensors under verl's names


def _metric(x: torch.Tensor) -> torch.Tensor:
    return x.detach().float()


def _masked_max(x_BT: torch.Tensor, valid_BT: torch.Tensor) -> torch.Tensor:
    return torch.where(valid_BT, x_BT, -torch.inf).max()


def _masked_min(x_BT: torch.Tensor, valid_BT: torch.Tensor) -> torch.Tensor:
    return torch.where(valid_BT, x_BT, torch.inf).min()


def rollout_is_weights(
    trainer_logprobs_BT: torch.Tensor,
    rollout_logprobs_BT: torch.Tensor,
    mask_BT: torch.Tensor,
    *,
    rollout_is: str = "token",
    rollout_is_threshold: float = 2.0,
    rollout_is_batch_normalize: bool = False,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Truncated importance weights ``pi_trainer / pi_rollout`` (verl ``compute_rollout_correction_weights``).

    - ``token``: ``w_t = min(exp(clamp(log r_t, -20, 20)), rollout_is_threshold)``: biased, low variance;
    - ``sequence``: ``w_t = min(exp(clamp(sum_t' log r_t', -20, 20)), rollout_is_threshold)`` for every
      token of the sequence (sum over valid tokens): unbiased before truncation, high variance.

    0 where masked; detached. With ``rollout_is_batch_normalize`` the truncated weights are divided by
    their mean (over valid tokens for ``token``; over sequences with a valid token, one weight each, for
    ``sequence``). verl takes that mean over all ranks; this function over the tensors it is given, so
    pass the whole batch (or normalize with a global mean yourself).

    Metrics (before truncation, as verl): ``rollout_is_mean`` (mean weight over valid tokens),
    ``rollout_is_max`` / ``rollout_is_min``, ``rollout_is_ratio_fraction_high`` / ``_low`` (fraction
    of tokens, or sequences, with weight above the threshold / below its reciprocal),
    ``rollout_is_std`` and ``rollout_is_eff_sample_size`` (``1 / mean(w_n^2)``, ``w_n`` the weights
    clamped to [1/threshold, threshold] and divided by their mean), ``rollout_is_batch_norm_factor``
    when normalizing.
    """
    if rollout_is not in IS_LEVELS:
        raise ValueError(f"unknown rollout_is {rollout_is!r}; use one of {', '.join(IS_LEVELS)}")
    if rollout_is_threshold <= 0:
        raise ValueError(f"rollout_is_threshold must be > 0, got {rollout_is_threshold}")
    with torch.no_grad():
        valid_BT = mask_BT.bool()
        log_ratio_BT = torch.where(valid_BT, trainer_logprobs_BT.float() - rollout_logprobs_BT.float(), 0.0)
        log_upper, log_lower = math.log(rollout_is_threshold), -math.log(rollout_is_threshold)
        metrics: dict[str, torch.Tensor] = {}
        if rollout_is == "token":
            raw_BT = torch.exp(log_ratio_BT.clamp(-_SAFETY_BOUND, _SAFETY_BOUND))
            raw_BT = torch.where(valid_BT, raw_BT, 0.0)
            metrics["rollout_is_max"] = _masked_max(raw_BT, valid_BT)
            metrics["rollout_is_min"] = _masked_min(raw_BT, valid_BT)
            metrics["rollout_is_ratio_fraction_high"] = masked_mean(
                (raw_BT > rollout_is_threshold).float(), valid_BT
            )
            metrics["rollout_is_ratio_fraction_low"] = masked_mean(
                (raw_BT < 1.0 / rollout_is_threshold).float(), valid_BT
            )
        else:
            seq_log_ratio_B = log_ratio_BT.sum(dim=-1)
            seq_valid_B = valid_BT.any(dim=-1)
            raw_B = torch.exp(seq_log_ratio_B.clamp(-_SAFETY_BOUND, _SAFETY_BOUND))
            raw_BT = torch.where(valid_BT, raw_B.unsqueeze(-1), 0.0)
            # From the unclamped log sums (verl: "the true extremes").
            metrics["rollout_is_max"] = torch.exp(
                torch.where(seq_valid_B, seq_log_ratio_B, -torch.inf).max().clamp(max=_SAFETY_BOUND)
            )
            metrics["rollout_is_min"] = torch.exp(torch.where(seq_valid_B, seq_log_ratio_B, torch.inf).min())
            metrics["rollout_is_ratio_fraction_high"] = masked_mean(
                (seq_log_ratio_B > log_upper).float(), seq_valid_B
            )
            metrics["rollout_is_ratio_fraction_low"] = masked_mean(
                (seq_log_ratio_B < log_lower).float(), seq_valid_B
            )
        metrics["rollout_is_mean"] = masked_mean(raw_BT, valid_BT)
        bounded_BT = raw_BT.clamp(1.0 / rollout_is_threshold, rollout_is_threshold)
        bounded_mean = masked_mean(bounded_BT, valid_BT)
        variance = masked_mean(bounded_BT.square(), valid_BT) - bounded_mean.square()
        metrics["rollout_is_std"] = variance.clamp_min(0.0).sqrt()
        normalized_BT = bounded_BT / (bounded_mean + 1e-8)
        metrics["rollout_is_eff_sample_size"] = 1.0 / masked_mean(normalized_BT.square(), valid_BT)

        weights_BT = raw_BT.clamp(max=rollout_is_threshold)
        if rollout_is_batch_normalize:
            if rollout_is == "token":
                mean_w = masked_mean(weights_BT, valid_BT)
            else:
                mean_w = masked_mean(masked_mean(weights_BT, valid_BT, dim=-1), valid_BT.any(dim=-1))
            # A batch whose weights all vanished keeps them as they are rather than dividing by ~0.
            factor = torch.where(mean_w > 1e-8, mean_w, torch.ones_like(mean_w))
            weights_BT = weights_BT / factor
            metrics["rollout_is_batch_norm_factor"] = factor
        return weights_BT, {k: _metric(v) for k, v in metrics.items()}


def parse_rs_thresholds(
    options: list[str], rollout_rs_threshold: str | float
) -> list[tuple[float | None, float]]:
    """Per option ``(lower, upper)``; see :func:`rollout_rejection_mask`."""
    if isinstance(rollout_rs_threshold, int | float):
        specs = [str(rollout_rs_threshold)]
    else:
        specs = [part.strip() for part in rollout_rs_threshold.split(",") if part.strip()]
    if len(specs) not in (1, len(options)):
        raise ValueError(
            f"rollout_rs_threshold {rollout_rs_threshold!r}: give one threshold for all options or one per "
            f"option ({len(options)})"
        )
    specs = specs * len(options) if len(specs) == 1 else specs
    bounds: list[tuple[float | None, float]] = []
    for option, spec in zip(options, specs, strict=True):
        try:
            if option.endswith("k1"):
                lower_s, upper_s = spec.split("_", 1) if "_" in spec else (None, spec)
                upper = float(upper_s)
                lower = float(lower_s) if lower_s is not None else 1.0 / upper
            else:
                if "_" in spec:
                    raise ValueError(f"option {option!r} takes one upper bound, not {spec!r}")
                lower, upper = None, float(spec)
        except ValueError as exc:
            raise ValueError(f"bad rollout_rs_threshold {spec!r} for {option!r}: {exc}") from None
        if upper <= 0 or (lower is not None and lower <= 0):
            raise ValueError(f"rollout_rs_threshold for {option!r} must be > 0, got {spec!r}")
        if lower is not None and lower >= upper:
            # YAML and Hydra read 0.5_2.0 as the number 0.52 (underscores are digit separators), whose
            # reciprocal lower bound then exceeds it: every token would be rejected.
            raise ValueError(
                f"rollout_rs_threshold {spec!r} for {option!r} keeps nothing (lower {lower:g} >= upper "
                f"{upper:g}); on the command line quote a 'lower_upper' pair, e.g. "
                f"rollout_rs_threshold='0.5_2.0', or YAML reads it as a number"
            )
        bounds.append((lower, upper))
    return bounds


def rollout_rejection_mask(
    trainer_logprobs_BT: torch.Tensor,
    rollout_logprobs_BT: torch.Tensor,
    mask_BT: torch.Tensor,
    *,
    rollout_rs: str,
    rollout_rs_threshold: str | float,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The mask with outlier tokens / sequences set to 0 (verl ``compute_rollout_rejection_mask``).

    ``rollout_rs`` is one option or several joined by commas (a token is kept only if every option keeps
    it). With ``l = clamp(log r, -20, 20)`` per token, the statistics are ``k1 = -l``,
    ``k2 = l^2 / 2``, ``k3 = exp(l) - 1 - l``, and the options:

    - ``token_k{1,2,3}``: per token;
    - ``seq_sum_k{1,2,3}`` / ``seq_mean_k{1,2,3}`` / ``seq_max_k{2,3}``: the sum / mean / max over the
      sequence's valid tokens; the whole sequence is kept or rejected.

    ``rollout_rs_threshold``: one spec for all options, or one per option joined by commas. A k1 option
    takes ``"lower_upper"`` (e.g. ``"0.5_2.0"``; a bare number is the upper bound, lower = 1 / upper) and
    keeps ``log(lower) <= k1 <= log(upper)``; k2 / k3 options take an upper bound and keep ``stat <=
    upper``. Note that, as in verl, k1 is ``-log r = log(pi_rollout / pi_trainer)``: the bounds apply to
    ``pi_rollout / pi_trainer`` (so ``"0.5_2.0"`` keeps ``0.5 <= r <= 2``; asymmetric bounds are
    mirrored: ``"0.6_1.4"`` keeps ``1/1.4 <= r <= 1/0.6``).

    Metrics: ``rollout_rs_masked_fraction`` (valid tokens rejected), ``rollout_rs_seq_masked_fraction``
    (sequences with a rejected token, over all B as verl), and per option
    ``rollout_rs_<option>_masked_fraction`` / ``_seq_masked_fraction`` (over sequences with a valid
    token) and ``rollout_rs_<option>_mean`` / ``_max`` of its statistic.
    """
    options = list(dict.fromkeys(opt.strip() for opt in rollout_rs.split(",") if opt.strip()))
    if not options:
        raise ValueError("rollout_rs must name at least one option")
    for option in options:
        if option not in RS_OPTIONS:
            raise ValueError(f"unknown rollout_rs option {option!r}; use one of {', '.join(RS_OPTIONS)}")
    bounds = parse_rs_thresholds(options, rollout_rs_threshold)
    with torch.no_grad():
        valid_BT = mask_BT.bool()
        seq_valid_B = valid_BT.any(dim=-1)
        log_ratio_BT = trainer_logprobs_BT.float() - rollout_logprobs_BT.float()
        log_ratio_BT = torch.where(valid_BT, log_ratio_BT, 0.0).clamp(-_SAFETY_BOUND, _SAFETY_BOUND)
        token_stats = {
            "k1": -log_ratio_BT,
            "k2": 0.5 * log_ratio_BT.square(),
            "k3": torch.expm1(log_ratio_BT) - log_ratio_BT,
        }
        keep_BT = torch.ones_like(valid_BT)
        metrics: dict[str, torch.Tensor] = {}
        for option, (lower, upper) in zip(options, bounds, strict=True):
            level, estimator = option.rsplit("_", 1)
            stat_BT = token_stats[estimator]
            if level == "token":
                stat_for_bounds = stat_BT
            elif level == "seq_sum":
                stat_for_bounds = torch.where(valid_BT, stat_BT, 0.0).sum(dim=-1, keepdim=True)
            elif level == "seq_mean":
                stat_for_bounds = masked_mean(stat_BT, valid_BT, dim=-1).unsqueeze(-1)
            else:  # seq_max; a sequence with no valid token reads 0
                seq_max_B1 = torch.where(valid_BT, stat_BT, -torch.inf).max(dim=-1, keepdim=True).values
                stat_for_bounds = torch.where(seq_valid_B.unsqueeze(-1), seq_max_B1, 0.0)
            if lower is not None:
                option_keep = (stat_for_bounds >= math.log(lower)) & (stat_for_bounds <= math.log(upper))
            else:
                option_keep = stat_for_bounds <= upper
            option_keep_BT = option_keep.expand_as(valid_BT)
            keep_BT &= option_keep_BT
            rejected_BT = ~option_keep_BT & valid_BT
            prefix = f"rollout_rs_{option}"
            metrics[f"{prefix}_masked_fraction"] = masked_mean(rejected_BT.float(), valid_BT)
            metrics[f"{prefix}_seq_masked_fraction"] = masked_mean(
                rejected_BT.any(dim=-1).float(), seq_valid_B
            )
            stat_view_BT = stat_for_bounds.expand_as(valid_BT)
            metrics[f"{prefix}_mean"] = masked_mean(stat_view_BT, valid_BT)
            metrics[f"{prefix}_max"] = _masked_max(stat_view_BT, valid_BT)
        new_mask_BT = torch.where(keep_BT, mask_BT, torch.zeros_like(mask_BT))
        rejected_BT = ~keep_BT & valid_BT
        metrics["rollout_rs_masked_fraction"] = masked_mean(rejected_BT.float(), valid_BT)
        metrics["rollout_rs_seq_masked_fraction"] = rejected_BT.any(dim=-1).float().mean()
        return new_mask_BT, {k: _metric(v) for k, v in metrics.items()}


def rollout_correction(
    trainer_logprobs_BT: torch.Tensor,
    rollout_logprobs_BT: torch.Tensor,
    mask_BT: torch.Tensor,
    *,
    rollout_is: str | None = None,
    rollout_is_threshold: float = 2.0,
    rollout_is_batch_normalize: bool = False,
    rollout_rs: str | None = None,
    rollout_rs_threshold: str | float | None = None,
) -> RolloutCorrection:
    """Both tools at once (verl ``compute_rollout_correction_and_rejection_mask``): weights from the
    input mask (rejection does not zero them, as in verl), then the rejection mask. Either may be off
    (``None``, verl's default for both)."""
    if trainer_logprobs_BT.shape != rollout_logprobs_BT.shape or trainer_logprobs_BT.shape != mask_BT.shape:
        raise ValueError(
            f"shapes differ: trainer {tuple(trainer_logprobs_BT.shape)}, rollout "
            f"{tuple(rollout_logprobs_BT.shape)}, mask {tuple(mask_BT.shape)}"
        )
    metrics: dict[str, torch.Tensor] = {}
    weights_BT = None
    if rollout_is is not None:
        weights_BT, is_metrics = rollout_is_weights(
            trainer_logprobs_BT,
            rollout_logprobs_BT,
            mask_BT,
            rollout_is=rollout_is,
            rollout_is_threshold=rollout_is_threshold,
            rollout_is_batch_normalize=rollout_is_batch_normalize,
        )
        metrics.update(is_metrics)
    new_mask_BT = mask_BT
    if rollout_rs is not None:
        if rollout_rs_threshold is None:
            raise ValueError("rollout_rs needs rollout_rs_threshold")
        new_mask_BT, rs_metrics = rollout_rejection_mask(
            trainer_logprobs_BT,
            rollout_logprobs_BT,
            mask_BT,
            rollout_rs=rollout_rs,
            rollout_rs_threshold=rollout_rs_threshold,
        )
        metrics.update(rs_metrics)
    return RolloutCorrection(weights_BT, new_mask_BT, metrics)
