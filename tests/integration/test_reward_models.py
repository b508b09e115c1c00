"""Reward models under real torchrun (2 gloo ranks): recipe=rm_tiny trains a scalar-head Qwen2 with the
Bradley-Terry loss, its held-out pairwise accuracy rises and its export loads as a transformers
sequence-classification model; then GRPO steps score with that model (FSDP2-sharded on both ranks) and
with the generative judge on the run's own vLLM engine.

The tiny policy is no judge (its replies are arithmetic, not grades): the judge part checks the plumbing (the engine is
called for every sample, what parses arrives as a score, the rest counts as errors), not the quality.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from spmdrl.logging.metrics import read_metrics
from spmdrl.testing.launch import torchrun

pytestmark = pytest.mark.slow


def _run(cwd: Path, out: Path, recipe: str, *overrides: str) -> None:
    res = torchrun(
        ["-m", "spmdrl.train", f"recipe={recipe}", f"trainer.output_dir={out}", *overrides],
        nproc=2,
        cwd=cwd,
        timeout_s=900,
        env={"SPMDRL_CACHE": os.environ.get("SPMDRL_CACHE", str(Path.home() / ".cache" / "spmdrl"))},
    )
    assert res.returncode == 0, res.output[-5000:]


@pytest.fixture(scope="module")
def rm_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("rm")
    out = tmp / "run"
    _run(
        tmp,
        out,
        "rm_tiny",
        "warmstart.enabled=false",
        # The hand-made pairs only: no engine, no policy to sample (rm_tiny samples its own; docs/rewards.md).
        "rm.pairs=synthetic",
        "trainer.total_steps=40",
        "trainer.val_every=20",
        # Operands 0-2: answers 0-4, so a wrong answer is often out of range, a cue the random backbone
        # picks up within 40 steps (the arithmetic itself takes it far longer; docs/rewards.md).
        "tiny_task.max_operand=2",
        "tiny_task.num_train=1024",
        "tiny_task.num_test=64",
        "optim.lr=3e-3",
        "logging.profile_steps=[2]",
    )
    return out


@pytest.mark.guarantee("recipe:rm_tiny")
def test_rm_tiny_learns_and_exports(rm_run: Path) -> None:
    # logging.profile_steps: step 2 traced, on each rank.
    traced = sorted(p.name for p in (rm_run / "profile" / "step-2").iterdir())
    assert traced == ["rank-0.json.gz", "rank-0.txt", "rank-1.json.gz", "rank-1.txt"]
    rows = read_metrics(rm_run / "metrics.jsonl")
    val = [(r["step"], r["val/pairwise_accuracy"]) for r in rows if "val/pairwise_accuracy" in r]
    assert val[0] == (0, 0.5), "the untrained head scores every response 0: a tie, half right"
    assert max(acc for _, acc in val[1:]) >= 0.6, val
    assert [s for s, _ in val] == [0, 20, 40]
    assert all("train/loss" in r for r in rows if r["step"] > 0)

    from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer

    export = rm_run / "hf_model"
    config = AutoConfig.from_pretrained(export)
    assert config.architectures == ["Qwen2ForSequenceClassification"]
    assert config.num_labels == 1 and config.pad_token_id is not None
    model = AutoModelForSequenceClassification.from_pretrained(export).eval()
    tok = AutoTokenizer.from_pretrained(export)
    text = tok.apply_chat_template(
        [
            {"role": "user", "content": "Tom has 2 apples and gets 3 more."},
            {"role": "assistant", "content": "#### 5"},
        ],
        tokenize=False,
    )
    with torch.no_grad():
        score = model(**tok(text, return_tensors="pt")).logits
    assert score.shape == (1, 1) and torch.isfinite(score).all() and float(score) != 0.0


@pytest.mark.guarantee("recipe:rm_tiny")
def test_grpo_steps_with_reward_model_and_judge(rm_run: Path, tmp_path: Path) -> None:
    out = tmp_path / "grpo"
    _run(
        tmp_path,
        out,
        "grpo_rm_tiny",
        f"reward_model.path={rm_run / 'hf_model'}",
        # The model at weight 1 and the judge, no rule (the recipe's rule + 0.3 * model), as checked below.
        "reward.rule_weight=0",
        "reward_model.weight=1",
        "reward_model.micro_batch_size_per_gpu=5",  # 16 samples per rank: 4 micro-batches, the last short
        # A short warm-start: the policy then writes the task's digits, which the judge's regex reads.
        "warmstart.total_steps=30",
        "trainer.total_steps=2",
        "trainer.val_every=0",
        "trainer.save_hf=false",
        "tiny_task.num_train=256",
        "trainer.global_batch_size=8",
        "rollout.n=4",
        "trainer.micro_batch_size=16",
        "reward_model.judge.enable=true",
        "reward_model.judge.weight=0.1",
        "reward_model.judge.template='Grade the answer {response} to {prompt}. Score:'",
        r"reward_model.judge.score_regex='(\d)'",  # a digit of the reply, where it writes one
        "reward_model.judge.max_tokens=16",
        "reward.max_error_frac=1.0",  # most replies will not parse: the run must go on
        "logging.samples_every=0",
    )
    rows = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        n = 8 * 4
        assert r["reward/rule_score"] >= 0.0
        parsed = r["reward/judge_parsed_frac"]
        # Every sample went to the judge: the ones whose reply did not parse are the step's errors.
        assert r["reward/errors"] == pytest.approx(round((1 - parsed) * n))
        judge_mean = r.get("reward/judge_score", 0.0) * parsed  # unparsed replies score error_score = 0
        # reward = 0 * rule + 1 * rm + 0.1 * judge, averaged over the step's samples.
        assert r["rollout/reward_mean"] == pytest.approx(r["reward/rm_score"] + 0.1 * judge_mean, abs=1e-4)
    assert any(r["reward/judge_parsed_frac"] > 0 for r in rows), "no judge reply parsed: no score arrived"
