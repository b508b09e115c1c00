"""Rollout correction (spmdrl/algos/correction.py): IS weights, rejection, their metrics, against values
computed by hand or by loop-based references written from the papers' / verl's formulas."""

from __future__ import annotations

import math
import statistics

import pytest
import torch

from spmdrl.algos.correction import (
    metric_reduction,
    parse_is_threshold,
    rollout_correction,
    rollout_is_weights,
    rollout_rejection_mask,
)

# ---------------------------------------------------------------------------------------------- correction


def test_token_is_weights_truncate_and_match_tis():
    trainer_BT = torch.tensor([[math.log(0.5), math.log(0.2), 0.0]], requires_grad=True)
    rollout_BT = torch.tensor([[math.log(0.25), math.log(0.4), -50.0]])
    mask_BT = torch.tensor([[1, 1, 0]])
    w_BT, metrics = rollout_is_weights(
        trainer_BT, rollout_BT, mask_BT, rollout_is="token", rollout_is_threshold=1.5
    )
    torch.testing.assert_close(w_BT, torch.tensor([[1.5, 0.5, 0.0]]))
    assert not w_BT.requires_grad
    # As verl 0.9.1: mean, max and min of the applied (truncated) weights 1.5 and 0.5; the fractions of
    # the raw ones (2 > 1.5, 0.5 < 1 / 1.5).
    assert metrics["rollout_is_mean"].item() == pytest.approx(1.0)
    assert metrics["rollout_is_max"].item() == pytest.approx(1.5)
    assert metrics["rollout_is_min"].item() == pytest.approx(0.5)
    assert metrics["rollout_is_ratio_fraction_high"].item() == pytest.approx(0.5)
    assert metrics["rollout_is_ratio_fraction_low"].item() == pytest.approx(0.5)
    # std and ESS of the applied weights clamped to [0, 1.5] (no lower clamp): mean 1, E[w^2] = 1.25.
    assert metrics["rollout_is_std"].item() == pytest.approx(0.5)
    assert metrics["rollout_is_eff_sample_size"].item() == pytest.approx(1 / 1.25)


def test_sequence_is_weights_are_the_product_of_token_ratios():
    log_r_BT = torch.tensor([[0.1, 0.2, 5.0], [-0.3, -0.4, -0.1]])
    mask_BT = torch.tensor([[1, 1, 0], [1, 1, 1]])
    w_BT, metrics = rollout_is_weights(
        log_r_BT, torch.zeros(2, 3), mask_BT, rollout_is="sequence", rollout_is_threshold=2.0
    )
    s0, s1 = math.exp(0.3), math.exp(-0.8)
    torch.testing.assert_close(w_BT, torch.tensor([[s0, s0, 0.0], [s1, s1, s1]]))
    assert metrics["rollout_is_max"].item() == pytest.approx(s0)
    assert metrics["rollout_is_ratio_fraction_low"].item() == pytest.approx(0.5)  # s1 < 1/2
    # Truncation at the cap, and batch normalization to mean 1 over sequences.
    w_BT, metrics = rollout_is_weights(
        log_r_BT * 10,
        torch.zeros(2, 3),
        mask_BT,
        rollout_is="sequence",
        rollout_is_threshold=2.0,
        rollout_is_batch_normalize=True,
    )
    raw = [min(math.exp(3.0), 2.0), math.exp(-8.0)]
    mean = sum(raw) / 2
    torch.testing.assert_close(w_BT[:, 0], torch.tensor([raw[0] / mean, raw[1] / mean]))
    assert metrics["rollout_is_batch_norm_factor"].item() == pytest.approx(mean)
    with pytest.raises(ValueError, match="token, sequence"):
        rollout_is_weights(log_r_BT, log_r_BT, mask_BT, rollout_is="geometric")


def test_rejection_token_k1_ratio_bounds():
    r_BT = torch.tensor([[1.0, 2.5, 0.4], [1.9, 0.6, 3.0]])
    mask_BT = torch.tensor([[1, 1, 1], [1, 1, 0]])
    new_mask_BT, metrics = rollout_rejection_mask(
        r_BT.log(), torch.zeros(2, 3), mask_BT, rollout_rs="token_k1", rollout_rs_threshold="0.5_2.0"
    )
    # Kept: 0.5 <= r <= 2 among valid tokens; the masked 3.0 stays masked.
    torch.testing.assert_close(new_mask_BT, torch.tensor([[1, 0, 0], [1, 1, 0]]))
    assert metrics["rollout_rs_masked_fraction"].item() == pytest.approx(2 / 5)
    assert metrics["rollout_rs_seq_masked_fraction"].item() == pytest.approx(1 / 2)
    # A bare number is the upper bound with lower = 1 / upper: the same here.
    same_BT, _ = rollout_rejection_mask(
        r_BT.log(), torch.zeros(2, 3), mask_BT, rollout_rs="token_k1", rollout_rs_threshold=2.0
    )
    torch.testing.assert_close(same_BT, new_mask_BT)


def test_rejection_sequence_options_and_chaining():
    log_r_BT = torch.tensor([[0.1, 0.1, 0.1], [1.0, -0.9, 0.0], [0.05, 0.0, 2.0]])
    mask_BT = torch.tensor([[1, 1, 1], [1, 1, 1], [1, 1, 0]])
    zeros = torch.zeros(3, 3)
    # seq_sum_k1: -sum log r within [log 0.5, log 2] = [-0.69, 0.69]: sums 0.3, 0.1, 0.05 -> all kept.
    m, _ = rollout_rejection_mask(
        log_r_BT, zeros, mask_BT, rollout_rs="seq_sum_k1", rollout_rs_threshold="0.5_2.0"
    )
    torch.testing.assert_close(m, mask_BT)
    # seq_max_k2: max of (log r)^2 / 2 <= 0.3: row 1 has 0.5 -> the whole sequence goes.
    m, metrics = rollout_rejection_mask(
        log_r_BT, zeros, mask_BT, rollout_rs="seq_max_k2", rollout_rs_threshold=0.3
    )
    torch.testing.assert_close(m, torch.tensor([[1, 1, 1], [0, 0, 0], [1, 1, 0]]))
    assert metrics["rollout_rs_seq_max_k2_max"].item() == pytest.approx(0.5)
    # Chained with token_k3 <= 0.004 (k3(0.1) = 0.00517 > 0.004): row 0 goes too, row 2 keeps 2 tokens.
    m, metrics = rollout_rejection_mask(
        log_r_BT, zeros, mask_BT, rollout_rs="seq_max_k2, token_k3", rollout_rs_threshold="0.3,0.004"
    )
    torch.testing.assert_close(m, torch.tensor([[0, 0, 0], [0, 0, 0], [1, 1, 0]]))
    assert metrics["rollout_rs_token_k3_masked_fraction"].item() == pytest.approx(5 / 8)
    assert metrics["rollout_rs_masked_fraction"].item() == pytest.approx(6 / 8)
    with pytest.raises(ValueError, match="one upper bound"):
        rollout_rejection_mask(log_r_BT, zeros, mask_BT, rollout_rs="token_k2", rollout_rs_threshold="0.5_2")
    with pytest.raises(ValueError, match="unknown rollout_rs option 'sequence'"):
        rollout_rejection_mask(log_r_BT, zeros, mask_BT, rollout_rs="sequence", rollout_rs_threshold=2.0)


def test_rollout_correction_combines_weights_and_rejection():
    r_BT = torch.tensor([[1.0, 2.5, 0.4]])
    mask_BT = torch.tensor([[1, 1, 1]])
    out = rollout_correction(
        r_BT.log(),
        torch.zeros(1, 3),
        mask_BT,
        rollout_is="token",
        rollout_is_threshold=2.0,
        rollout_rs="token_k1",
        rollout_rs_threshold="0.5_2.0",
    )
    # The weights are computed on the input mask and not zeroed by rejection (as verl).
    torch.testing.assert_close(out.is_weights_BT, torch.tensor([[1.0, 2.0, 0.4]]))
    torch.testing.assert_close(out.mask_BT, torch.tensor([[1, 0, 0]]))
    assert {"rollout_is_mean", "rollout_rs_masked_fraction"} <= set(out.metrics)
    off = rollout_correction(r_BT.log(), torch.zeros(1, 3), mask_BT)
    assert off.is_weights_BT is None and off.mask_BT is mask_BT and off.metrics == {}


def test_is_metrics_per_sequence_on_applied_weights():
    # Raw token weights: row 0 [2, 0.5] (truncated [1.5, 0.5], mean 1.0), row 1 [1.8] (truncated 1.5).
    ratios_BT = torch.tensor([[2.0, 0.5], [1.8, 1.0]])
    mask_BT = torch.tensor([[1, 1], [1, 0]])
    _, m = rollout_is_weights(ratios_BT.log(), torch.zeros(2, 2), mask_BT, rollout_is_threshold=1.5)
    assert m["rollout_is_seq_mean"].item() == pytest.approx((1.0 + 1.5) / 2)
    assert m["rollout_is_seq_std"].item() == pytest.approx(statistics.stdev([1.0, 1.5]))
    assert m["rollout_is_seq_max"].item() == pytest.approx(1.5)
    assert m["rollout_is_seq_min"].item() == pytest.approx(1.0)
    assert m["rollout_is_seq_max_deviation"].item() == pytest.approx(0.5)
    # Of the raw per-sequence means 1.25 and 1.8: one above 1.5, none below 1 / 1.5.
    assert m["rollout_is_seq_fraction_high"].item() == pytest.approx(0.5)
    assert m["rollout_is_seq_fraction_low"].item() == pytest.approx(0.0)


def test_sequence_statistics_count_every_row_as_verl():
    # A row with no valid token: sequence ratio 1 (log sum 0) and mean weight 0, counted as verl does.
    log_r_BT = torch.tensor([[math.log(3.0), 0.0], [math.log(0.8), 0.0], [5.0, 5.0]])
    mask_BT = torch.tensor([[1, 0], [1, 0], [0, 0]])
    _, m = rollout_is_weights(log_r_BT, torch.zeros(3, 2), mask_BT, rollout_is="sequence")
    assert m["rollout_is_min"].item() == pytest.approx(0.8)
    assert m["rollout_is_max"].item() == pytest.approx(3.0)
    assert m["rollout_is_ratio_fraction_high"].item() == pytest.approx(1 / 3)  # 3 > 2, of 3 rows
    assert m["rollout_is_seq_min"].item() == 0.0 and m["rollout_is_seq_max_deviation"].item() == 1.0
    assert m["rollout_is_seq_mean"].item() == pytest.approx((2.0 + 0.8 + 0.0) / 3)


def test_icepop_zeroes_weights_outside_both_bounds():
    # IcePop (rollout_is_threshold "lower_upper"): raw weights outside [0.5, 1.5] become 0, not truncated.
    ratios_BT = torch.tensor([[2.0, 0.5, 0.4, 1.2, 9.0]])
    mask_BT = torch.tensor([[1, 1, 1, 1, 0]])
    w_BT, m = rollout_is_weights(ratios_BT.log(), torch.zeros(1, 5), mask_BT, rollout_is_threshold="0.5_1.5")
    torch.testing.assert_close(w_BT, torch.tensor([[0.0, 0.5, 0.0, 1.2, 0.0]]))
    assert m["rollout_is_oob_ratio"].item() == pytest.approx(2 / 4)
    assert m["rollout_is_ratio_fraction_high"].item() == pytest.approx(1 / 4)  # 2.0 > 1.5
    assert m["rollout_is_ratio_fraction_low"].item() == pytest.approx(1 / 4)  # 0.4 < 0.5 (not 1 / 1.5)
    assert m["rollout_is_mean"].item() == pytest.approx((0.5 + 1.2) / 4)
    assert m["rollout_is_max"].item() == pytest.approx(1.2) and m["rollout_is_min"].item() == 0.0
    # Sequence level: whole sequences whose product of ratios leaves [0.5, 2] get weight 0.
    log_r_BT = torch.tensor([[math.log(3.0), 0.0], [math.log(0.8), math.log(1.5)], [math.log(0.2), 0.0]])
    w_BT, m = rollout_is_weights(
        log_r_BT, torch.zeros(3, 2), torch.ones(3, 2), rollout_is="sequence", rollout_is_threshold="0.5_2"
    )
    torch.testing.assert_close(w_BT, torch.tensor([[0.0, 0.0], [1.2, 1.2], [0.0, 0.0]]))
    assert m["rollout_is_oob_ratio"].item() == pytest.approx(2 / 3)
    # A plain number is TIS, as before: the same ratios truncated at 2.
    w_BT, _ = rollout_is_weights(log_r_BT, torch.zeros(3, 2), torch.ones(3, 2), rollout_is="sequence")
    torch.testing.assert_close(w_BT[:, 0], torch.tensor([2.0, 1.2, 0.2]))


def test_parse_is_threshold():
    assert parse_is_threshold(2.0) == (2.0, None)
    assert parse_is_threshold("3") == (3.0, None)
    assert parse_is_threshold("0.5_5.0") == (5.0, 0.5)
    for bad in ("abc", "5_0.5", "0_2", -1.0, True):
        with pytest.raises(ValueError, match="rollout_is_threshold"):
            parse_is_threshold(bad)


def test_metric_reduction_over_ranks():
    assert metric_reduction("rollout_is_max") == "max"
    assert metric_reduction("rollout_is_seq_max_deviation") == "max"
    assert metric_reduction("rollout_rs_token_k1_max") == "max"
    assert metric_reduction("rollout_is_seq_min") == "min"
    assert metric_reduction("rollout_is_mean") == "mean"
    assert metric_reduction("rollout_rs_seq_max_k2_masked_fraction") == "mean"
