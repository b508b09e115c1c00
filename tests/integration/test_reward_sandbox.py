"""The reward sandbox's deadlines with real worker processes: a hanging function, hanging samples in parallel."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from spmdrl.rewards import sandbox
from spmdrl.rewards.registry import RewardFn, RewardInput, load_reward_fn
from spmdrl.rewards.sandbox import score_batch

REWARDS = """
import math
import os
import signal
import subprocess
import time


def sleeps(response, ground_truth, *, data_source, extra_info):
    time.sleep(1000)


def values(response, ground_truth, *, data_source, extra_info):
    if response == "ok":  # the worker's pid: a sample after a bad value shows whether it was restarted
        return {"score": 1.0, "pid": float(os.getpid())}
    return {
        "big_int": 10**400,  # too large for a float
        "float32_overflow": 1e39,  # finite as a Python float, inf as float32
        "dict_float32_overflow": {"score": -1e39},
        "nan": math.nan,
        "inf": -math.inf,
    }[response]


def exits(response, ground_truth, *, data_source, extra_info):
    if response == "exit":
        os._exit(3)
    return 1.0


def kills_its_group(response, ground_truth, *, data_source, extra_info):
    if response == "killpg":
        os.killpg(os.getpgrp(), signal.SIGKILL)
    return 1.0


def starts_a_child_and_hangs(response, ground_truth, *, data_source, extra_info):
    child = subprocess.Popen(["sleep", "1000"])
    with open(extra_info["pid_file"], "w") as f:
        f.write(str(child.pid))
    time.sleep(1000)


def allocates(response, ground_truth, *, data_source, extra_info):
    if response == "alloc":
        return float(len(bytes(8 << 30)))  # 8 GiB (calloc: not touched, so cheap when it is allowed)
    return {"score": 1.0, "pid": float(os.getpid())}


def writes(response, ground_truth, *, data_source, extra_info):
    if response == "write":
        with open(extra_info["path"], "wb") as f:
            f.write(b"x" * (2 << 20))
    return {"score": 1.0, "pid": float(os.getpid())}


def environment(response, ground_truth, *, data_source, extra_info):
    rendezvous = [k for k in os.environ if k in ("MASTER_ADDR", "MASTER_PORT") or k.startswith("TORCHELASTIC_")]
    return {
        "score": 1.0,
        "rendezvous": float(len(rendezvous)),
        "rank": float(os.environ["RANK"]),
        "nccl": float(os.environ["NCCL_DEBUG"] == "WARN"),
    }
"""


@pytest.fixture
def rewards(tmp_path: Path) -> Iterator[Path]:
    """The file of reward functions; each test starts and ends with no worker processes."""
    path = tmp_path / "sandbox_rewards.py"
    path.write_text(REWARDS)
    sandbox._pool().shutdown()
    yield path
    sandbox._pool().shutdown()


def _fn(path: Path, name: str) -> RewardFn:
    return load_reward_fn(f"{path}:{name}")


def _inputs(*responses: str, **extra_info: str) -> list[RewardInput]:
    return [RewardInput(r, "19", "spmdrl/tiny_arith", dict(extra_info)) for r in responses]


@pytest.mark.slow
def test_batch_deadline_bounds_a_hanging_function(rewards: Path):
    start = time.monotonic()
    result = score_batch(
        _fn(rewards, "sleeps"), _inputs(*["x"] * 20), timeout_s=1, batch_timeout_s=3, error_score=-1
    )
    elapsed = time.monotonic() - start
    assert elapsed < 5, f"took {elapsed:.1f} s"
    assert (result.num_errors, result.num_timeouts) == (0, 20)
    assert result.scores_B.dtype == torch.float32 and result.scores_B.tolist() == [-1.0] * 20
    # The workers killed at the deadline are replaced on the next call.
    result = score_batch(_fn(rewards, "values"), _inputs("ok", "ok"), timeout_s=5, error_score=-1)
    assert result.scores_B.tolist() == [1.0, 1.0]


@pytest.mark.slow
def test_hanging_samples_time_out_in_parallel(rewards: Path):
    start = time.monotonic()
    result = score_batch(
        _fn(rewards, "sleeps"), _inputs(*["x"] * 6), timeout_s=1, error_score=-1, num_workers=6
    )
    elapsed = time.monotonic() - start
    assert result.num_timeouts == 6
    # One after another, six 1 s timeouts take at least 6 s; in parallel about 1 s plus the workers'
    # start, which a loaded machine (CI runs suites side by side) has stretched to 4.4 s.
    assert elapsed < 6, f"took {elapsed:.1f} s: the timeouts ran one after another"
