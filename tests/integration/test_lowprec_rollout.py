"""recipe=grpo_lowprec_tiny end to end (--all, about 3 minutes): a bf16 engine, a float32 trainer and TIS
learn the tiny task as the float32 engine does (docs/rollout.md#low-precision-rollout), and every step logs
the gap before the correction and the (smaller) gap after it."""

from __future__ import annotations

import os
from pathlib import Path

from spmdrl.logging.metrics import read_metrics
from spmdrl.testing.launch import torchrun


def test_grpo_lowprec_tiny_learns_with_the_correction_logged(tmp_path: Path) -> None:
    out = tmp_path / "run"
    res = torchrun(
        [
            "-m",
            "spmdrl.train",
            "recipe=grpo_lowprec_tiny",
            f"trainer.output_dir={out}",
            "trainer.save_hf=false",
        ],
        nproc=2,
        cwd=tmp_path,
        timeout_s=1200,
        env={"SPMDRL_CACHE": os.environ.get("SPMDRL_CACHE", str(Path.home() / ".cache" / "spmdrl"))},
    )
    assert res.returncode == 0, res.output[-5000:]
    rows = read_metrics(out / "metrics.jsonl")
    val = [r["val/accuracy"] for r in rows if "val/accuracy" in r]
    assert max(val[-2:]) - val[0] >= 0.25, val
    steps = [r for r in rows if "mismatch/logprob_abs_diff_mean" in r]
    assert len(steps) == 40
    for r in steps:
        # A bf16 engine against a float32 trainer: a gap from rounding alone, which the weights correct.
        assert 1e-4 < r["mismatch/logprob_abs_diff_mean"] < 0.02, r
        assert r["mismatch/corrected_logprob_abs_diff_mean"] <= r["mismatch/logprob_abs_diff_mean"], r
