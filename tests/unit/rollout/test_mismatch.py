"""Trainer / engine logprob mismatch statistics (spmdrl/rollout/mismatch.py)."""

from __future__ import annotations

import math

import pytest
import torch

from spmdrl.rollout.mismatch import logprob_mismatch, parity_failure

# Its outcome depends on the kernels the engine picks for the CPU: CI runs it as every CPU kind.
pytestmark = pytest.mark.cpu_kinds


def test_logprob_mismatch_statistics() -> None:
    trainer = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -0.1, -9.0]])
    engine = torch.tensor([[-1.1, -2.0, -2.5], [-0.5, -0.4, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])  # the last position (|diff| 9) is padding
    stats = logprob_mismatch(trainer, engine, mask)
    diffs = [0.1, 0.0, 0.5, 0.0, 0.3]
    assert stats["tokens"] == 5
    assert stats["logprob_abs_diff_mean"] == pytest.approx(sum(diffs) / 5, abs=1e-6)
    assert stats["logprob_abs_diff_max"] == pytest.approx(0.5, abs=1e-6)
    # k3 = exp(d) - d - 1 with d = trainer - engine: >= 0, zero only where the two agree.
    d = [0.1, 0.0, -0.5, 0.0, 0.3]
    assert stats["kl_k3"] == pytest.approx(sum(math.exp(x) - x - 1 for x in d) / 5, abs=1e-6)
    assert logprob_mismatch(trainer, trainer, mask)["kl_k3"] == 0.0


def test_parity_failure_decides_on_the_reduced_mean() -> None:
    metrics = {"mismatch/logprob_abs_diff_mean": 3e-7, "mismatch/logprob_abs_diff_max": 2e-6}
    calls: list[int] = []

    def dtypes() -> str:
        calls.append(1)
        return "trainer float32, engine bfloat16"

    assert parity_failure(1e-6, metrics, 3, dtypes) is None
    assert parity_failure(0.0, {**metrics, "mismatch/logprob_abs_diff_mean": 5.0}, 3, dtypes) is None  # off
    assert parity_failure(1e-6, {"rollout/reward_mean": 1.0}, 3, dtypes) is None  # a rank without the pass
    assert not calls  # the dtypes are worked out only for a message
    msg = parity_failure(1e-6, {**metrics, "mismatch/logprob_abs_diff_mean": 1.5e-3}, 7, dtypes)
    assert msg is not None and calls == [1]
    for part in ("at step 7", "0.0015", "max 2e-06", "rollout.parity_tol=1e-06", "engine bfloat16",
                 "rollout.dtype=float32", "metrics.jsonl"):  # fmt: skip
        assert part in msg, (part, msg)
