"""A broken reward-model checkpoint (its scalar head NaN) under real torchrun: GRPO stops at step 1 with the
reward model named as the source, colocated (2 gloo ranks) and under parallel.placement=async (4 ranks:
the counts travel from the rollout ranks to the trainer ranks with the rows); with reward.max_error_frac=1.0
the run goes on, every sample counted in reward/errors, on finite rewards (docs/rewards.md#generative-judge).
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForSequenceClassification

from spmdrl.logging.metrics import read_metrics
from spmdrl.testing.launch import torchrun
from spmdrl.testing.small_runs import SMALL_GRPO, cache_dir, save_random_reward_model

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def nan_rm(tmp_path_factory: pytest.TempPathFactory) -> Path:
    rm = save_random_reward_model(tmp_path_factory.mktemp("rm") / "hf_model")
    model = AutoModelForSequenceClassification.from_pretrained(rm)
    with torch.no_grad():
        model.score.weight.fill_(float("nan"))
    model.save_pretrained(rm)
    return rm


def _run(tmp_path: Path, recipe: str, nproc: int, *overrides: str) -> tuple[int, str, Path]:
    out = tmp_path / "run"
    res = torchrun(
        ["-m", "spmdrl.train", f"recipe={recipe}", f"trainer.output_dir={out}", *SMALL_GRPO, *overrides],
        nproc=nproc,
        cwd=tmp_path,
        timeout_s=600,
        env={"SPMDRL_CACHE": str(cache_dir())},
    )
    return res.returncode, res.output, out


def test_colocated_run_stops_naming_the_reward_model(nan_rm: Path, tmp_path: Path) -> None:
    rc, output, _ = _run(
        tmp_path,
        "grpo_tiny",
        2,
        "reward_model.enable=true",
        f"reward_model.path={nan_rm}",
        "trainer.val_every=0",
    )
    assert rc != 0
    assert "step 1: 32 of 32 samples (100%) got no score, above reward.max_error_frac=0.5" in output, output[
        -5000:
    ]
    assert f"  - 32 reward-model scores were NaN/inf (reward_model.path={nan_rm})" in output
    assert "reward model: 16 of 16 scores were NaN/inf" in output  # each rank's warning


def test_async_run_stops_on_the_trainer_ranks_with_the_counts_of_the_rows(
    nan_rm: Path, tmp_path: Path
) -> None:
    rc, output, _ = _run(
        tmp_path,
        "grpo_async_tiny",
        4,
        "reward_model.enable=true",
        f"reward_model.path={nan_rm}",
        "reward_model.placement=separate",
        "trainer.val_every=0",
    )
    assert rc != 0
    assert "step 1: 32 of 32 samples (100%) got no score" in output, output[-5000:]
    assert f"  - 32 reward-model scores were NaN/inf (reward_model.path={nan_rm})" in output


def test_under_a_lax_limit_the_run_trains_on_error_score(nan_rm: Path, tmp_path: Path) -> None:
    rc, output, out = _run(
        tmp_path,
        "grpo_tiny",
        2,
        "reward_model.enable=true",
        f"reward_model.path={nan_rm}",
        "reward.max_error_frac=1.0",
        "trainer.total_steps=2",
        "trainer.val_every=0",
    )
    assert rc == 0, output[-5000:]
    rows = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert r["reward/errors"] == 32 and "reward/rm_score" not in r  # no finite score to average
        assert math.isfinite(r["rollout/reward_mean"]) and math.isfinite(r["actor/pg_loss"])
