"""The reward sandbox's deadlines with real worker processes: a hanging function, hanging samples in parallel."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from spmdrl.rewards.sandbox import score_batch
from tests.sandbox_rewards import reward_fn, reward_inputs


@pytest.mark.slow
def test_batch_deadline_bounds_a_hanging_function(rewards: Path):
    start = time.monotonic()
    result = score_batch(
        reward_fn(rewards, "sleeps"),
        reward_inputs(*["x"] * 20),
        timeout_s=1,
        batch_timeout_s=3,
        error_score=-1,
    )
    elapsed = time.monotonic() - start
    assert elapsed < 5, f"took {elapsed:.1f} s"
    assert (result.num_errors, result.num_timeouts) == (0, 20)
    assert result.scores_B.dtype == torch.float32 and result.scores_B.tolist() == [-1.0] * 20
    # The workers killed at the deadline are replaced on the next call.
    result = score_batch(reward_fn(rewards, "values"), reward_inputs("ok", "ok"), timeout_s=5, error_score=-1)
    assert result.scores_B.tolist() == [1.0, 1.0]


@pytest.mark.slow
def test_hanging_samples_time_out_in_parallel(rewards: Path):
    start = time.monotonic()
    result = score_batch(
        reward_fn(rewards, "sleeps"), reward_inputs(*["x"] * 6), timeout_s=1, error_score=-1, num_workers=6
    )
    elapsed = time.monotonic() - start
    assert result.num_timeouts == 6
    # One after another, six 1 s timeouts take at least 6 s; in parallel about 1 s plus the workers'
    # start, which a loaded machine (CI runs suites side by side) has stretched to 4.4 s.
    assert elapsed < 6, f"took {elapsed:.1f} s: the timeouts ran one after another"
