"""Rollout correction: importance weights and rejection masks for the rollout-vs-trainer mismatch.

vLLM samples the tokens, but the trainer's forward (other kernels, other precision, maybe an older or
newer checkpoint) gives them slightly different probabilities, so PPO's "old" policy is not the one the
tokens came from. With ``log r = trainer_old_logprob - rollout_logprob`` per token, verl's rollout
correction (``verl/trainer/ppo/rollout_corr_helper.py``; config ``algorithm.rollout_correction``,
``docs/algo/rollout_corr.md``) offers two independent tools, re-implemented here as pure functions:

- **IS weights** (``rollout_is``: ``"token"`` or ``"sequence"``): ``w = exp(log r)`` per token, or
  ``exp(sum_t log r_t)`` (the product of the token ratios) for every token of a sequence, with the log
  clamped to [-20, 20]; ``rollout_is_threshold`` a number truncates ``w`` at it (TIS), a
  ``"lower_upper"`` string sets ``w`` to 0 outside [lower, upper] (IcePop). They multiply the
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


# rollout_correction.loss_type: the bypass_mode loss's two forms.
BYPASS_LOSS_TYPES = ("ppo_clip", "reinforce")


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


def parse_is_threshold(rollout_is_threshold: str | float) -> tuple[float, float | None]:
    """``(upper, lower)`` of verl's ``rollout_is_threshold``: a number (or a numeric string) is TIS's
    upper bound (lower None); ``"lower_upper"`` is IcePop's two bounds, ``0 < lower <= upper``."""
    if isinstance(rollout_is_threshold, bool):
        raise ValueError("rollout_is_threshold must be a number or a 'lower_upper' string, not a boolean")
    spec = str(rollout_is_threshold).strip()
    try:
        if "_" in spec:
            lower_s, upper_s = spec.split("_", 1)
            upper, lower = float(upper_s), float(lower_s)
        else:
            upper, lower = float(spec), None
    except ValueError:
        raise ValueError(
            f"rollout_is_threshold {rollout_is_threshold!r} is neither a number (TIS) nor 'lower_upper' (IcePop)"
        ) from None
    if upper <= 0 or (lower is not None and lower <= 0):
        raise ValueError(f"rollout_is_threshold bounds must be > 0, got {rollout_is_threshold!r}")
    if lower is not None and lower > upper:
        raise ValueError(f"rollout_is_threshold {rollout_is_threshold!r}: lower bound above the upper one")
    return upper, lower


def rollout_is_weights(
    trainer_logprobs_BT: torch.Tensor,
    rollout_logprobs_BT: torch.Tensor,
    mask_BT: torch.Tensor,
    *,
    rollout_is: str = "token",
    rollout_is_threshold: str | float = 2.0,
    rollout_is_batch_normalize: bool = False,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Truncated (TIS) or masked (IcePop) importance weights ``pi_trainer / pi_rollout`` (verl
    ``compute_rollout_correction_weights``). The raw weight ``rho`` is

    - ``token``: ``rho_t = exp(clamp(log r_t, -20, 20))``: biased, low variance;
    - ``sequence``: ``rho_t = exp(clamp(sum_t' log r_t', -20, 20))`` for every token of the sequence (sum
      over valid tokens): unbiased before truncation, high variance.

    ``rollout_is_threshold`` a number ``U``: ``w = min(rho, U)`` (TIS, "Your Efficient RL Framework
    Secretly Brings You Off-Policy RL Training", Yao et al. 2025). ``"L_U"``: ``w = rho`` where ``L <=
    rho <= U``, else 0 (IcePop, from Ring-1T, arXiv:2510.18855: the mismatched token drops out of the
    gradient instead of being down-weighted).

    0 where masked; detached. With ``rollout_is_batch_normalize`` the weights are divided by their mean
    (over valid tokens for ``token``; over sequences with a valid token, one weight each, for
    ``sequence``). verl takes that mean over all ranks; this function over the tensors it is given, so
    pass the whole batch (or normalize with a global mean yourself).

    Metrics, as verl 0.9.1 (``compute_is_metrics``), on the applied weights ``w`` before batch
    normalization unless said: ``rollout_is_mean`` (over valid tokens), ``rollout_is_max`` /
    ``rollout_is_min`` (token: of ``w``; sequence: of ``exp(sum log r)`` from the unclamped log sums,
    the max capped at exp(20)), ``rollout_is_ratio_fraction_high`` / ``_low`` (tokens, or sequences,
    whose raw weight is above ``U`` / below ``L``, ``L = 1 / U`` for TIS), ``rollout_is_std`` and
    ``rollout_is_eff_sample_size`` (``1 / mean(w_n^2)``, ``w_n`` = ``clamp(w, 0, U)`` divided by its
    mean), per sequence (the mean ``w`` of each row) ``rollout_is_seq_mean``,
    ``_seq_std``, ``_seq_max``, ``_seq_min``, ``_seq_max_deviation`` (largest ``|mean - 1|``),
    ``_seq_fraction_high`` / ``_low`` (the sequence's mean *raw* weight above ``U`` / below ``L``);
    IcePop's ``rollout_is_oob_ratio`` (valid tokens outside [L, U]); ``rollout_is_batch_norm_factor``
    when normalizing. The sequence-level statistics count every row, as verl's: a row with no valid token
    has sequence ratio 1 and mean weight 0 (a rollout's response always has a token).
    """
    if rollout_is not in IS_LEVELS:
        raise ValueError(f"unknown rollout_is {rollout_is!r}; use one of {', '.join(IS_LEVELS)}")
    upper, icepop_lower = parse_is_threshold(rollout_is_threshold)
    lower = icepop_lower if icepop_lower is not None else 1.0 / upper
    with torch.no_grad():
        valid_BT = mask_BT.bool()
        log_ratio_BT = torch.where(valid_BT, trainer_logprobs_BT.float() - rollout_logprobs_BT.float(), 0.0)
        metrics: dict[str, torch.Tensor] = {}
        if rollout_is == "token":
            raw_BT = torch.exp(log_ratio_BT.clamp(-_SAFETY_BOUND, _SAFETY_BOUND))
            raw_BT = torch.where(valid_BT, raw_BT, 0.0)
            metrics["rollout_is_ratio_fraction_high"] = masked_mean((raw_BT > upper).float(), valid_BT)
            metrics["rollout_is_ratio_fraction_low"] = masked_mean((raw_BT < lower).float(), valid_BT)
        else:
            seq_log_ratio_B = log_ratio_BT.sum(dim=-1)
            raw_B = torch.exp(seq_log_ratio_B.clamp(-_SAFETY_BOUND, _SAFETY_BOUND))
            raw_BT = torch.where(valid_BT, raw_B.unsqueeze(-1), 0.0)
            # From the unclamped log sums (verl: "the true extremes"), over every row as verl (a row with no
            # valid token has log sum 0: ratio 1).
            metrics["rollout_is_max"] = torch.exp(seq_log_ratio_B.max().clamp(max=_SAFETY_BOUND))
            metrics["rollout_is_min"] = torch.exp(seq_log_ratio_B.min())
            metrics["rollout_is_ratio_fraction_high"] = (seq_log_ratio_B > math.log(upper)).float().mean()
            metrics["rollout_is_ratio_fraction_low"] = (seq_log_ratio_B < math.log(lower)).float().mean()
        if icepop_lower is None:
            weights_BT = raw_BT.clamp(max=upper)
        else:
            outside_BT = (raw_BT < icepop_lower) | (raw_BT > upper)
            weights_BT = torch.where(outside_BT, 0.0, raw_BT)
            metrics["rollout_is_oob_ratio"] = masked_mean(outside_BT.float(), valid_BT)
        if rollout_is == "token":
            metrics["rollout_is_max"] = _masked_max(weights_BT, valid_BT)
            metrics["rollout_is_min"] = _masked_min(weights_BT, valid_BT)
        metrics["rollout_is_mean"] = masked_mean(weights_BT, valid_BT)
        # std and ESS of the applied weights (clamp(0, U) is a no-op for TIS and IcePop alike).
        bounded_BT = weights_BT.clamp(0.0, upper)
        bounded_mean = masked_mean(bounded_BT, valid_BT)
        variance = masked_mean(bounded_BT.square(), valid_BT) - bounded_mean.square()
        # Chosen on the device: bypass_mode runs this per micro-batch, where int(valid.sum()) would sync.
        metrics["rollout_is_std"] = torch.where(
            valid_BT.sum() > 1, variance.clamp_min(0.0).sqrt(), torch.zeros_like(variance)
        )
        normalized_BT = bounded_BT / (bounded_mean + 1e-8)
        metrics["rollout_is_eff_sample_size"] = 1.0 / masked_mean(normalized_BT.square(), valid_BT)
        metrics.update(_seq_is_metrics(weights_BT, raw_BT, valid_BT, upper, lower))

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


def _seq_is_metrics(
    weights_BT: torch.Tensor, raw_BT: torch.Tensor, valid_BT: torch.Tensor, upper: float, lower: float
) -> dict[str, torch.Tensor]:
    """verl's ``rollout_is_seq_*`` metrics over every row (one with no valid token has mean weight 0)."""
    seq_mean_B = masked_mean(weights_BT, valid_BT, dim=-1)
    raw_seq_mean_B = masked_mean(raw_BT, valid_BT, dim=-1)
    if seq_mean_B.numel() == 0:  # every rank logs the same keys (they are all_reduced): zeros
        seq_mean_B = raw_seq_mean_B = weights_BT.new_zeros(1)
    return {
        "rollout_is_seq_mean": seq_mean_B.mean(),
        "rollout_is_seq_std": seq_mean_B.std() if seq_mean_B.numel() > 1 else seq_mean_B.new_zeros(()),
        "rollout_is_seq_max": seq_mean_B.max(),
        "rollout_is_seq_min": seq_mean_B.min(),
        "rollout_is_seq_max_deviation": (seq_mean_B - 1.0).abs().max(),
        # The raw means: a mean of truncated weights never exceeds the threshold (verl's reason).
        "rollout_is_seq_fraction_high": (raw_seq_mean_B > upper).float().mean(),
        "rollout_is_seq_fraction_low": (raw_seq_mean_B < lower).float().mean(),
    }


def metric_reduction(name: str) -> str:
    """How a metric of this module combines over ranks: ``"max"`` (maxima, largest deviations), ``"min"``
    or ``"mean"`` (each rank's mean, averaged). verl computes them on the whole batch at once; a mean
    of per-rank maxima would understate the largest weight."""
    if name.endswith(("_max", "_max_deviation")):
        return "max"
    if name.endswith("_min"):
        return "min"
    return "mean"


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
    rollout_is_threshold: str | float = 2.0,
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
