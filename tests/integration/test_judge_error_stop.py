"""A GRPO run (2 ranks, the tiny model, its in-process vLLM engine as the judge) whose reward.fn fails on one
rank and whose judge replies never parse stops at its first step with each source named and counted, a
sample failed by both counted once (spmdrl/rl/samples.py::check_reward_errors)."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from spmdrl.testing.launch import torchrun

pytestmark = pytest.mark.slow

# The sandbox keeps RANK in the worker's environment: rank 0's samples fail, rank 1's score.
RANK0_RAISES = textwrap.dedent(
    """
    import os

    def score(response, ground_truth, *, data_source, extra_info):
        if os.environ["RANK"] == "0":
            raise ValueError("rank 0's reward service is down")
        return 1.0
    """
)


def test_reward_fn_and_judge_failures_are_named_each_with_its_count(tmp_path: Path) -> None:
    (tmp_path / "half.py").write_text(RANK0_RAISES)
    res = torchrun(
        [
            "-m",
            "spmdrl.train",
            "recipe=grpo_tiny",
            f"trainer.output_dir={tmp_path / 'run'}",
            "warmstart.enabled=false",
            "trainer.total_steps=2",
            "trainer.val_every=0",
            "tiny_task.num_train=64",
            "trainer.global_batch_size=8",
            "rollout.n=2",
            f"reward.fn={tmp_path / 'half.py'}:score",
            "reward_model.judge.enable=true",
            r"reward_model.judge.score_regex='QQQ(\d)'",  # never in the tiny model's replies
            "reward_model.judge.max_tokens=4",
        ],
        nproc=2,
        cwd=tmp_path,
        timeout_s=300,
    )
    out = res.output
    assert res.returncode != 0
    # 8 samples per rank: rank 0's fail in reward.fn and in the judge, rank 1's in the judge alone.
    assert "step 1: 16 of 16 samples (100%) got no score, above reward.max_error_frac=0.5" in out, out[-3000:]
    assert "  - 8 from reward.fn=" in out and "rank 0's reward service is down" in out
    assert "  - 16 judge replies that did not parse (reward_model.judge.*; 8 of them on samples" in out
    assert "judge: 8 of 8 replies did not parse" in out  # each rank's first reply, logged
