"""spmdrl/rl/metrics.py: reward_extra_metrics, the means of the extra keys a reward function returned in
its dict (``reward/extra/<key>``), over 2 gloo ranks whose samples returned different keys."""

from __future__ import annotations

import math

import pytest
import torch

from spmdrl.rl.metrics import reward_extra_metrics
from spmdrl.testing.spawn import run_distributed

CPU = torch.device("cpu")
NAN = math.nan


def _worker(rank: int, world_size: int) -> dict[str, float]:
    # Rank 0's samples returned "acc" and "length" (one sample without "length"); rank 1's only "acc",
    # plus "format" on one sample: rank 0 has no "format" key at all, and must still reduce it.
    extra = {
        0: {"acc": [1.0, 0.0, 1.0], "length": [10.0, NAN, 20.0]},
        1: {"acc": [1.0], "format": [NAN]},
    }[rank]
    return reward_extra_metrics(extra, CPU)


def test_means_over_ranks_with_different_keys() -> None:
    results = run_distributed(_worker, 2, timeout_s=120)
    assert results[0] == results[1]
    # "format" was only ever NaN (no sample returned a number): no metric rather than a made-up 0.
    assert results[0] == {
        "reward/extra/acc": pytest.approx(3 / 4),
        "reward/extra/length": pytest.approx(15.0),
    }


def test_single_process_and_no_extras() -> None:
    assert reward_extra_metrics({}, CPU) == {}
    assert reward_extra_metrics({"acc": [1.0, 0.0]}, CPU) == {"reward/extra/acc": 0.5}
