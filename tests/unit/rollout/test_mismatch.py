"""Trainer / engine logprob mismatch statistics (spmdrl/rollout/mismatch.py)."""

from __future__ import annotations

import math

import pytest
import torch

from spmdrl.rollout.mismatch import logprob_mismatch

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
