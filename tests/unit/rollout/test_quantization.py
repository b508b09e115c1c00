"""rollout.quantization: what each device may run, refused before anything is built; the check's tolerance
for a quantized engine; and the gap the rollout correction leaves (mismatch/corrected_*)."""

from __future__ import annotations

import math

import pytest
import torch

from spmdrl.algos.correction import rollout_correction
from spmdrl.errors import ConfigError
from spmdrl.rollout.config import RolloutConfig
from spmdrl.rollout.engine import check_engine_config
from spmdrl.rollout.mismatch import corrected_mismatch, logprob_mismatch
from spmdrl.rollout.quantization import FP8_CHECK_TOL, check_quantization, check_tol


def test_fp8_is_refused_on_a_cpu_with_the_reason_and_the_cpu_alternative() -> None:
    with pytest.raises(ConfigError) as e:
        check_engine_config(RolloutConfig(quantization="fp8", dtype="bfloat16"), "cpu")
    msg = str(e.value)
    assert "rollout.quantization=fp8 cannot run on cpu" in msg
    assert "static_scaled_fp8_quant" in msg and "rollout.dtype=bfloat16" in msg


def test_fp8_needs_a_16_bit_engine() -> None:
    check_quantization("fp8", "bfloat16", "cuda")  # runs
    with pytest.raises(ConfigError, match="rollout.dtype resolves to float32: set rollout.dtype=bfloat16"):
        check_quantization("fp8", "float32", "cuda")


def test_unknown_method_names_the_known_ones() -> None:
    with pytest.raises(ConfigError, match="not one of none, fp8"):
        check_quantization("int4", "bfloat16", "cuda")


def test_none_runs_everywhere_and_keeps_the_configured_check_tolerance() -> None:
    check_quantization("none", "float32", "cpu")
    assert check_tol("none", 1e-9) == 1e-9
    assert check_tol("fp8", 1e-9) == FP8_CHECK_TOL
    assert check_tol("fp8", 0.5) == 0.5  # a looser configured tolerance wins


def _gap(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    engine = -torch.rand(8, 16, generator=g) * 3
    trainer = engine + torch.randn(8, 16, generator=g) * 0.3  # a low-precision engine's gap
    mask = torch.ones(8, 16)
    mask[:, 12:] = 0
    return trainer, engine, mask


def test_untruncated_token_weights_leave_no_gap() -> None:
    trainer, engine, mask = _gap()
    corr = rollout_correction(trainer, engine, mask, rollout_is="token", rollout_is_threshold=1e9)
    before = logprob_mismatch(trainer, engine, mask)
    after = corrected_mismatch(trainer, engine, corr.mask_BT, corr.is_weights_BT, sequence_level=False)
    assert before["logprob_abs_diff_mean"] > 0.1
    assert after["corrected_logprob_abs_diff_mean"] < 1e-5
    assert after["corrected_kl_k3"] < 1e-9


def test_truncated_weights_leave_the_part_above_the_threshold() -> None:
    trainer, engine, mask = _gap()
    threshold = 1.2
    corr = rollout_correction(trainer, engine, mask, rollout_is="token", rollout_is_threshold=threshold)
    after = corrected_mismatch(trainer, engine, corr.mask_BT, corr.is_weights_BT, sequence_level=False)
    log_r = (trainer - engine)[mask.bool()]
    expected = (log_r - log_r.clamp(max=math.log(threshold))).abs().mean()
    assert after["corrected_logprob_abs_diff_mean"] == pytest.approx(float(expected), rel=1e-5)
    assert (
        0
        < after["corrected_logprob_abs_diff_mean"]
        < logprob_mismatch(trainer, engine, mask)["logprob_abs_diff_mean"]
    )


def test_rejection_alone_measures_the_plain_gap_on_the_kept_tokens() -> None:
    trainer, engine, mask = _gap()
    corr = rollout_correction(trainer, engine, mask, rollout_rs="token_k1", rollout_rs_threshold="0.9_1.1")
    after = corrected_mismatch(trainer, engine, corr.mask_BT, None, sequence_level=False)
    kept = corr.mask_BT.bool()
    assert 0 < kept.sum() < mask.sum()
    assert after["corrected_logprob_abs_diff_mean"] == pytest.approx(
        float((trainer - engine)[kept].abs().mean()), rel=1e-5
    )
    assert after["corrected_logprob_abs_diff_mean"] <= math.log(1.1) + 1e-6


def test_sequence_weights_are_compared_with_each_sequences_summed_ratio() -> None:
    trainer, engine, mask = _gap()
    corr = rollout_correction(trainer, engine, mask, rollout_is="sequence", rollout_is_threshold=1e9)
    after = corrected_mismatch(trainer, engine, corr.mask_BT, corr.is_weights_BT, sequence_level=True)
    assert after["corrected_logprob_abs_diff_mean"] < 1e-4
