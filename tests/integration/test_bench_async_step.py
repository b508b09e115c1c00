"""benchmarks/async_step.py's run path: two real jobs of a synchronous recipe (grpo_tiny on 2 ranks, k=0),
without and with the latency tail (its launcher, spmdrl.testing.latency_tail), read back into the table
and the JSON. grpo_tiny logs no async/* keys, so the policy age is '-'; the tail job's rollout phase holds
the tail's wait and logs it (rollout/wait_s)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
TAIL_S = 2.0


def test_runs_a_recipe_without_and_with_the_latency_tail(tmp_path: Path) -> None:
    cmd = [
        sys.executable,
        str(REPO / "benchmarks" / "async_step.py"),
        *("--recipe", "grpo_tiny", "--nproc", "2", "--steps", "2", "--staleness", "0"),
        *("--tail-prompts", "1", "--tail-seconds", str(TAIL_S), "--json", str(tmp_path / "a.json")),
        *("--timeout", "600"),
    ]
    small = [
        "warmstart.total_steps=8",
        "tiny_task.num_train=256",
        "tiny_task.num_test=16",
        "trainer.global_batch_size=8",
        "rollout.n=4",
        "trainer.micro_batch_size=32",
        "trainer.val_every=2",
    ]
    for o in small:
        cmd += ["--set", o]
    env = {
        **os.environ,
        "SPMDRL_CACHE": os.environ.get("SPMDRL_CACHE", str(Path.home() / ".cache" / "spmdrl")),
    }
    res = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=1500)
    assert res.returncode == 0, (res.stdout + res.stderr)[-5000:]

    doc = json.loads((tmp_path / "a.json").read_text())
    assert doc["benchmark"] == "async_step" and doc["failed_jobs"] == []
    figs = {f["name"]: f for f in doc["figures"]}
    for name in ("k0", "k0_tail"):
        for figure in ("steps_per_hour", "steady_steps_per_hour"):
            assert figs[f"async_step/{name}/{figure}"]["ratio"] == pytest.approx(1.0)  # against itself
        assert f"async_step/{name}/policy_age_mean" not in figs  # a synchronous recipe
        assert 0.0 <= figs[f"async_step/{name}/val_accuracy"]["value"] <= 1.0
    # The tail is in the rollout phase and logged; without it, nothing is.
    assert "async_step/k0/tail_s" not in figs
    assert "async_step/k0_tail/tail_s" in figs, (
        "the tail's launcher never wrapped the job's Rollout (build_rollout)"
    )
    assert figs["async_step/k0_tail/tail_s"]["value"] >= TAIL_S
    assert figs["async_step/k0_tail/rollout_s"]["value"] >= TAIL_S
    assert figs["async_step/k0_tail/step_s"]["value"] >= TAIL_S

    rows = [line.split() for line in res.stdout.splitlines() if line.split()[:1] == ["0"]]
    assert [r[1] for r in rows] == ["off", "1x2s"], res.stdout
    assert all(r[3] == r[5] == "1.00" and r[9:11] == ["-", "-"] for r in rows), res.stdout
