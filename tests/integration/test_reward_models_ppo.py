"""PPO (recipes/ppo.py, GAE with a critic) scoring with a reward model, under real torchrun (2 gloo ranks):
the rollout phase's job.model_rewards hook weights the model's score with the rule reward, and the critic
trains on that reward.

The reward model is the tiny backbone with a random scalar head, scaled up so its scores (about +-3) are
far from the rule's 0/1: a reward that skipped the model, or weighted it wrongly, cannot pass for the right
one. Each logged training sample is rescored here, in this process, by the same model as a plain
transformers module, and its training reward must be rule_weight * rule + weight * score.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from spmdrl.logging.metrics import read_metrics
from spmdrl.testing.launch import torchrun
from spmdrl.testing.small_runs import cache_dir, rescore_logged_samples, save_random_reward_model

pytestmark = pytest.mark.slow

RULE_WEIGHT, RM_WEIGHT = 0.5, 2.0


@pytest.fixture(scope="module")
def random_rm(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_random_reward_model(tmp_path_factory.mktemp("rm") / "hf_model")


def test_ppo_trains_on_the_weighted_reward_model_score(random_rm: Path, tmp_path: Path) -> None:
    out = tmp_path / "ppo"
    res = torchrun(
        [
            "-m", "spmdrl.train", "recipe=ppo_tiny", f"trainer.output_dir={out}",
            "reward_model.enable=true", f"reward_model.path={random_rm}",
            f"reward_model.weight={RM_WEIGHT}", f"reward.rule_weight={RULE_WEIGHT}",
            "reward_model.micro_batch_size_per_gpu=5",  # 16 samples per rank: 4 micro-batches, the last short
            "warmstart.total_steps=30",  # the task's answer format, so some rule rewards are 1
            "trainer.total_steps=2", "trainer.val_every=0", "trainer.save_hf=false", "trainer.save_every=0",
            "tiny_task.num_train=256", "trainer.global_batch_size=8", "rollout.n=4",
            "trainer.micro_batch_size=16",
            "critic.warmup_steps=0",  # the actor updates too: the whole PPO step runs on the new reward
            "logging.samples_every=1", "logging.samples_per_log=8",
        ],
        nproc=2,
        cwd=tmp_path,
        timeout_s=900,
        env={"SPMDRL_CACHE": str(cache_dir())},
    )  # fmt: skip
    assert res.returncode == 0, res.output[-5000:]

    rows = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        # The hook ran (its metrics are logged) and the step's mean reward is the weighted sum of means.
        assert abs(r["reward/rm_score"]) > 0.1, r
        expected = RULE_WEIGHT * r["reward/rule_score"] + RM_WEIGHT * r["reward/rm_score"]
        assert r["rollout/reward_mean"] == pytest.approx(expected, abs=1e-4)
        # The critic's value head starts at 0 and fits the return, the reward: a non-zero reward, a loss.
        assert r["critic/vf_loss"] > 0.0

    # Each logged training sample, rescored here: its reward is rule_weight * rule + weight * RM score.
    r = rescore_logged_samples(out, random_rm)
    assert [s["step"] for s in r.train] == [1] * 8 + [2] * 8
    rm_B, rule_B, logged_B = r.rm_B, r.rule_B, r.logged_B
    expected_B = RULE_WEIGHT * rule_B + RM_WEIGHT * rm_B
    assert torch.allclose(logged_B, expected_B, atol=1e-3), (logged_B, expected_B)
    assert rm_B.std() > 0.1, "the scores must tell the samples apart, or the check proves little"
