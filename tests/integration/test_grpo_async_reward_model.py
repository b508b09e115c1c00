"""Reward models under parallel.placement=async (recipes/grpo_async.py), real torchrun with 4 gloo ranks:
2 trainer ranks, 2 rollout ranks. The reward model is sharded (FSDP2) over the rollout ranks only and the
judge runs on their engines; the weighted reward travels to the trainer ranks with the rows, and the
model rewards' metrics (reward/rm_score, ...) reach rank 0's log with them.

The reward model is the tiny backbone with a random scalar head, scaled up so its scores (about +-3) are
far from the rule's 0/1 (tests/integration/test_reward_models_ppo.py does the same). Each logged training
sample is rescored here, in this process: its reward must be rule_weight * rule + weight * RM score +
judge_weight * a digit (the judge's regex reads one digit of its reply; an unparsed reply scores 0).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from spmdrl.logging.metrics import read_metrics
from spmdrl.testing.launch import torchrun
from spmdrl.testing.small_runs import SMALL_GRPO, cache_dir, rescore_logged_samples, save_random_reward_model

pytestmark = pytest.mark.slow

RULE_WEIGHT, RM_WEIGHT, JUDGE_WEIGHT = 0.5, 2.0, 0.1

# tests/integration/test_grpo_async.py's small settings (no warm-start, a gradient at every step).
COMMON = SMALL_GRPO


@pytest.fixture(scope="module")
def random_rm(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_random_reward_model(tmp_path_factory.mktemp("rm") / "hf_model")


def test_reward_model_and_judge_on_the_rollout_ranks(random_rm: Path, tmp_path: Path) -> None:
    out = tmp_path / "async_rm"
    res = torchrun(
        [
            "-m", "spmdrl.train", "recipe=grpo_async_tiny", f"trainer.output_dir={out}", *COMMON,
            # k = 1 (the recipe's): batch i + 1 is generated and scored while update i runs.
            "trainer.total_steps=2", "trainer.val_every=0",
            "reward_model.enable=true", f"reward_model.path={random_rm}", "reward_model.placement=separate",
            f"reward_model.weight={RM_WEIGHT}", f"reward.rule_weight={RULE_WEIGHT}",
            "reward_model.micro_batch_size_per_gpu=5",  # 16 samples per rollout rank: 4 micro-batches
            "reward_model.judge.enable=true", f"reward_model.judge.weight={JUDGE_WEIGHT}",
            "reward_model.judge.template='Grade the answer {response} to {prompt}. Score:'",
            r"reward_model.judge.score_regex='(\d)'",  # a digit of the reply, where it writes one
            "reward_model.judge.temperature=1.0",  # the random policy writes a digit now and then when sampled
            "reward.max_error_frac=1.0",  # most replies will not parse: the run must go on
            "logging.samples_every=1", "logging.samples_per_log=8",
        ],
        nproc=4,
        cwd=tmp_path,
        timeout_s=600,
        env={"SPMDRL_CACHE": str(cache_dir())},
    )  # fmt: skip
    assert res.returncode == 0, res.output[-5000:]

    # Built on the rollout ranks only: the run says so, and rank 0 (a trainer rank, the one that logs at
    # INFO) never loaded it.
    derived = json.loads((out / "derived.json").read_text())
    assert derived["reward_model"] == "rollout: ranks 2-3 (FSDP 2)", derived
    assert derived["placement"].startswith("async: actor: ranks 0-1"), derived
    assert "[rank0]" in res.output and not re.search(r"reward model .*: micro-batch", res.output)

    rows = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2]
    n = 8 * 4
    for r in rows:
        # Measured on the rollout ranks, reduced over them, carried with the rows to rank 0's log.
        assert abs(r["reward/rm_score"]) > 0.1, r
        assert 0.0 <= r["reward/rule_score"] <= 1.0 and "reward/rm_truncated_frac" in r
        parsed = r["reward/judge_parsed_frac"]
        # Every sample went to the judge: the ones whose reply did not parse are the step's errors.
        assert r["reward/errors"] == pytest.approx(round((1 - parsed) * n))
        judge_mean = r.get("reward/judge_score", 0.0) * parsed  # unparsed replies score error_score = 0
        # The trainer ranks' rewards (what they train on) are the weighted sum the rollout ranks made.
        expected = RULE_WEIGHT * r["reward/rule_score"] + RM_WEIGHT * r["reward/rm_score"]
        assert r["rollout/reward_mean"] == pytest.approx(expected + JUDGE_WEIGHT * judge_mean, abs=1e-4)
        assert r["actor/grad_norm"] > 0
    assert rows[1]["async/policy_age_mean"] == 1  # generated and scored while update 1 ran
    assert any(r["reward/judge_parsed_frac"] > 0 for r in rows), "no judge reply parsed: no score arrived"

    # Each logged training sample, rescored here: rule_weight * rule + weight * RM + judge_weight * digit.
    r = rescore_logged_samples(out, random_rm)
    assert [s["step"] for s in r.train] == [1] * 8 + [2] * 8
    rm_B, rule_B, logged_B = r.rm_B, r.rule_B, r.logged_B
    assert rm_B.std() > 0.1, "the scores must tell the samples apart, or the check proves little"
    digit_B = (logged_B - RULE_WEIGHT * rule_B - RM_WEIGHT * rm_B) / JUDGE_WEIGHT
    assert torch.allclose(digit_B, digit_B.round(), atol=1e-2), digit_B
    assert bool(((digit_B.round() >= 0) & (digit_B.round() <= 9)).all()), digit_B
