"""spmdrl/rl/metrics.py: step_metrics' keys and values from known samples, timings and logprobs
(hand-computed), in one process and reduced over 2 gloo ranks; the peak-memory readings."""

from __future__ import annotations

import inspect
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from spmdrl.config import AlgorithmConfig, Config, RolloutConfig
from spmdrl.logging.timer import PhaseTimer
from spmdrl.rewards.sandbox import RewardResult
from spmdrl.rl import metrics as metrics_mod
from spmdrl.rl.batch import PolicyBatch
from spmdrl.rl.metrics import host_peak_memory_gb, peak_memory_gb, step_metrics
from spmdrl.rl.samples import ScoredSamples
from spmdrl.rollout.engine import Generation
from spmdrl.testing.spawn import run_distributed

CPU = torch.device("cpu")
NAMESPACES = {"rollout", "reward", "perf", "timing", "mismatch"}


def _cfg() -> Config:
    return Config(rollout=RolloutConfig(n=2), algorithm=AlgorithmConfig(ppo_epochs=2))


def _samples(
    scores: list[float], lengths: list[int], reasons: list[str], errors: int, timeouts: int
) -> ScoredSamples:
    gens = [
        Generation(prompt_index=i // 2, token_ids=[5] * n, logprobs=[-0.1] * n, finish_reason=r)
        for i, (n, r) in enumerate(zip(lengths, reasons, strict=True))
    ]
    scores_B = torch.tensor(scores)
    return ScoredSamples(
        prompts=[],  # step_metrics reads the generations and scores only
        gens=gens,
        rewards=RewardResult(scores_B, errors, timeouts),
        responses=[""] * len(gens),
        scores_B=scores_B,
        metrics={"rollout/tool_calls_mean": 1.5},
    )


def _timer(**seconds: float) -> PhaseTimer:
    timer = PhaseTimer()
    for name, s in seconds.items():
        timer.add(name, s)
    return timer


def _actor_part() -> tuple[PolicyBatch, torch.Tensor, torch.Tensor]:
    attn = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]])  # 7 tokens
    resp = torch.tensor([[0, 1, 1, 0], [0, 1, 1, 1]], dtype=torch.bool)
    engine = torch.tensor([[0.0, -1.0, -2.0, 0.0], [0.0, -0.5, -1.5, -3.0]])
    old = torch.tensor([[0.0, -1.1, -2.0, 0.0], [0.0, -0.2, -1.5, -10.0]])
    # Sampled: not row 1's last token (rejected later, say), whose logprobs differ by 7.
    sampled = torch.tensor([[0, 1, 1, 0], [0, 1, 0, 0]], dtype=torch.bool)
    batch = PolicyBatch(
        input_ids_BT=torch.ones(2, 4, dtype=torch.long) * attn,
        attention_mask_BT=attn,
        response_mask_BT=resp,
        engine_logprobs_BT=engine,
        advantages_BT=torch.zeros(2, 4),
    )
    return batch, sampled, old


def test_step_metrics_values_and_keys_single_process() -> None:
    samples = _samples(
        scores=[1.0, 0.0, 1.0, 1.5],
        lengths=[3, 5, 2, 6],
        reasons=["stop", "length", "stop", "length"],
        errors=1,
        timeouts=2,
    )
    timer = _timer(
        rollout=2.0, reward=0.25, actor_update=1.75, critic_update=0.5, update=2.25, not_a_phase=9.0
    )
    before = host_peak_memory_gb()
    m = step_metrics(
        _cfg().rollout.n, _cfg().algorithm.ppo_epochs, samples, timer, CPU, _actor_part(), resident_gb=0.75
    )
    after = host_peak_memory_gb()

    assert {k.split("/")[0] for k in m} == NAMESPACES
    mean = (1.0 + 0.0 + 1.0 + 1.5) / 4
    assert m["rollout/reward_mean"] == pytest.approx(mean)
    assert m["rollout/reward_std"] == pytest.approx(math.sqrt((1 + 0 + 1 + 2.25) / 4 - mean**2))
    assert m["rollout/response_len_mean"] == pytest.approx(16 / 4)
    assert m["rollout/truncated_frac"] == pytest.approx(0.5)
    # Solved: every sample of the group scored >= 1 (the second group only).
    assert m["rollout/solved_group_frac"] == pytest.approx(0.5)
    # reward/errors counts timeouts too.
    assert m["reward/errors"] == 3 and m["reward/timeouts"] == 2
    assert m["rollout/tool_calls_mean"] == 1.5  # the rollout's own metrics pass through
    assert m["perf/rollout_tokens_per_s"] == pytest.approx(16 / 2.0)
    # Only phases that ran, and only PHASES.
    assert {k for k in m if k.startswith("timing/")} == {
        "timing/rollout_s",
        "timing/reward_s",
        "timing/actor_update_s",
        "timing/critic_update_s",
        "timing/update_s",
    }
    assert m["timing/rollout_s"] == 2.0 and m["timing/update_s"] == 2.25
    assert m["perf/update_overlap"] == pytest.approx((1.75 + 0.5) / 2.25)
    # On CPU the peak is the process's resident set; no separate host figure.
    assert before <= m["perf/max_memory_gb"] <= after and m["perf/max_memory_gb"] > 0
    assert "perf/max_host_memory_gb" not in m
    assert m["perf/update_start_memory_gb"] == 0.75
    # Mismatch over the sampled tokens only: |d| = 0.1, 0.0, 0.3 (not row 1's last token's 7.0).
    d = [-0.1, 0.0, 0.3]  # trainer - engine
    assert m["mismatch/logprob_abs_diff_mean"] == pytest.approx(0.4 / 3, rel=1e-5)
    assert m["mismatch/logprob_abs_diff_max"] == pytest.approx(0.3, rel=1e-5)
    assert m["mismatch/kl_k3"] == pytest.approx(sum(math.exp(x) - x - 1 for x in d) / 3, rel=1e-4)
    # 7 tokens x 2 PPO epochs over the actor update's time.
    assert m["perf/train_tokens_per_s"] == pytest.approx(14 / 1.75)


def test_step_metrics_without_actor_part_or_optional_figures() -> None:
    samples = _samples([0.0, 0.0], [4, 4], ["stop", "stop"], errors=0, timeouts=0)
    m = step_metrics(_cfg().rollout.n, _cfg().algorithm.ppo_epochs, samples, _timer(rollout=1.0), CPU, None)
    assert not any(k.startswith("mismatch/") for k in m)
    assert "perf/train_tokens_per_s" not in m
    assert "perf/update_overlap" not in m  # no critic update
    assert "perf/update_start_memory_gb" not in m
    assert [k for k in m if k.startswith("timing/")] == ["timing/rollout_s"]
    assert m["rollout/reward_std"] == 0.0 and m["rollout/solved_group_frac"] == 0.0


def _two_rank_worker(rank: int, world: int) -> dict:
    # Rank 0: 2 prompts, one solved; rank 1: 1 prompt, solved, slower rollout, no actor update.
    if rank == 0:
        samples = _samples([1.0, 0.0, 1.0, 1.0], [2, 4, 6, 8], ["stop"] * 4, errors=1, timeouts=0)
        timer = _timer(rollout=1.0, actor_update=2.0)
    else:
        samples = _samples([1.0, 2.0], [10, 10], ["length", "stop"], errors=0, timeouts=1)
        timer = _timer(rollout=4.0, reward=0.5)
    return step_metrics(
        _cfg().rollout.n,
        _cfg().algorithm.ppo_epochs,
        samples,
        timer,
        CPU,
        _actor_part(),
        resident_gb=float(rank + 1),
    )


def test_step_metrics_reduces_over_ranks() -> None:
    results = run_distributed(_two_rank_worker, 2, timeout_s=120)
    assert results[0] == results[1]  # every rank logs the same numbers
    m = results[0]
    scores = [1.0, 0.0, 1.0, 1.0, 1.0, 2.0]
    mean = sum(scores) / 6
    assert m["rollout/reward_mean"] == pytest.approx(mean)
    assert m["rollout/reward_std"] == pytest.approx(math.sqrt(sum(s * s for s in scores) / 6 - mean**2))
    assert m["rollout/response_len_mean"] == pytest.approx(40 / 6)
    assert m["rollout/truncated_frac"] == pytest.approx(1 / 6)
    assert m["rollout/solved_group_frac"] == pytest.approx(2 / 3)
    assert m["reward/errors"] == 2 and m["reward/timeouts"] == 1
    # The slowest rank's time per phase, whichever rank ran it.
    assert m["timing/rollout_s"] == 4.0 and m["timing/reward_s"] == 0.5 and m["timing/actor_update_s"] == 2.0
    assert m["perf/rollout_tokens_per_s"] == pytest.approx(40 / 4.0)
    assert m["perf/update_start_memory_gb"] == 2.0  # the largest rank's
    # Both ranks hold the actor: its tokens (7 x 2 epochs each) and mismatch cover both.
    assert m["perf/train_tokens_per_s"] == pytest.approx(28 / 2.0)
    assert m["mismatch/logprob_abs_diff_mean"] == pytest.approx(0.4 / 3, rel=1e-5)


def test_peak_memory_on_cpu_is_the_resident_peak() -> None:
    held = torch.ones(64 * 2**20 // 4)  # 64 MiB, touched
    # The resident set first: the process may still grow between two reads (its threads allocate), and a
    # peak read later can only be higher.
    status = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines())
    rss_gb = int(status["VmRSS"].split()[0]) / 2**20
    got = peak_memory_gb(CPU)
    assert set(got) == {"memory_gb"}
    assert rss_gb <= got["memory_gb"] <= host_peak_memory_gb()
    del held


def test_host_peak_is_the_processs_own_not_its_launchers() -> None:
    """A child started from a large process reports its own small peak (ru_maxrss would report the
    parent's, carried over through fork and exec)."""
    held = torch.ones(512 * 2**20 // 4)  # this process's peak is now above 0.5 GiB
    parent = host_peak_memory_gb()
    src = "from pathlib import Path\n" + inspect.getsource(metrics_mod.host_peak_memory_gb)
    src += "\nprint(host_peak_memory_gb())\n"
    child = float(
        subprocess.run([sys.executable, "-c", src], capture_output=True, text=True, check=True).stdout
    )
    del held
    assert parent > 0.5
    assert 0 < child < 0.2, child
