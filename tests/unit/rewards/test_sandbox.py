"""The reward sandbox's failure modes (spmdrl/rewards/sandbox.py), with real worker processes: bad values,
crashes, escapes, limits."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import time
from pathlib import Path

from spmdrl.rewards.sandbox import score_batch
from tests.sandbox_rewards import reward_fn, reward_inputs


def _gone(pid: int, wait_s: float = 3.0) -> bool:
    """Whether ``pid`` is dead (a zombie counts: init may be slow to reap it, or not reap at all)."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        with contextlib.suppress(OSError):
            # /proc/<pid>/stat: "pid (comm) state ..."; comm may hold spaces and parentheses.
            if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
                return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)


def test_bad_values_are_scored_errors_without_restarting_the_worker(rewards: Path, caplog):
    bad = ["big_int", "float32_overflow", "dict_float32_overflow", "nan", "inf"]
    with caplog.at_level(logging.WARNING, logger="spmdrl.rewards.sandbox"):
        result = score_batch(
            reward_fn(rewards, "values"),
            reward_inputs("ok", *bad, "ok"),
            timeout_s=5,
            error_score=-1,
            num_workers=1,
        )
    assert result.scores_B.tolist() == [1.0] + [-1.0] * len(bad) + [1.0]
    assert (result.num_errors, result.num_timeouts) == (len(bad), 0)
    first_pid, last_pid = result.extra["pid"][0], result.extra["pid"][-1]
    assert first_pid == last_pid, "the worker was restarted"
    assert "returned int 1000000" in caplog.text  # the first failure, quoted


def test_worker_that_exits_is_an_error_and_is_replaced(rewards: Path):
    fn = reward_fn(rewards, "exits")
    result = score_batch(fn, reward_inputs("exit"), timeout_s=5, error_score=-1, num_workers=1)
    assert (result.scores_B.tolist(), result.num_errors, result.num_timeouts) == ([-1.0], 1, 0)
    result = score_batch(fn, reward_inputs("a", "b"), timeout_s=5, error_score=-1, num_workers=1)
    assert (result.scores_B.tolist(), result.num_errors) == ([1.0, 1.0], 0)


def test_killpg_in_user_code_cannot_reach_the_trainer(rewards: Path):
    fn = reward_fn(rewards, "kills_its_group")
    result = score_batch(fn, reward_inputs("a", "killpg", "b"), timeout_s=5, error_score=-1, num_workers=1)
    # Still here: the worker's process group is not this process's.
    assert result.scores_B.tolist() == [1.0, -1.0, 1.0]
    assert (result.num_errors, result.num_timeouts) == (1, 0)


def test_timeout_kills_what_the_function_started(rewards: Path, tmp_path: Path):
    pid_file = tmp_path / "child_pid"
    result = score_batch(
        reward_fn(rewards, "starts_a_child_and_hangs"),
        reward_inputs("x", pid_file=str(pid_file)),
        timeout_s=1,
        error_score=-1,
    )
    assert result.num_timeouts == 1
    child = int(pid_file.read_text())
    try:
        assert _gone(child), "the function's subprocess outlived the timeout"
    finally:
        if not _gone(child, wait_s=0):
            os.kill(child, signal.SIGKILL)


def test_memory_limit_turns_a_huge_allocation_into_a_scored_error(rewards: Path, caplog):
    with caplog.at_level(logging.WARNING, logger="spmdrl.rewards.sandbox"):
        result = score_batch(
            reward_fn(rewards, "allocates"),
            reward_inputs("a", "alloc", "b"),
            timeout_s=10,
            error_score=-1,
            num_workers=1,
            memory_mb=1024,
        )
    assert result.scores_B.tolist() == [1.0, -1.0, 1.0]
    assert (result.num_errors, result.num_timeouts) == (1, 0)
    assert "MemoryError" in caplog.text and "reward.worker_memory_mb" in caplog.text
    assert result.extra["pid"][0] == result.extra["pid"][2], "the worker was restarted"


def test_file_size_limit_turns_a_huge_write_into_a_scored_error(rewards: Path, tmp_path: Path, caplog):
    with caplog.at_level(logging.WARNING, logger="spmdrl.rewards.sandbox"):
        result = score_batch(
            reward_fn(rewards, "writes"),
            reward_inputs("a", "write", "b", path=str(tmp_path / "big")),
            timeout_s=10,
            error_score=-1,
            num_workers=1,
            file_size_mb=1,
        )
    assert result.scores_B.tolist() == [1.0, -1.0, 1.0]
    assert (result.num_errors, result.num_timeouts) == (1, 0)
    assert "File too large" in caplog.text  # OSError(EFBIG), not death by SIGXFSZ
    assert result.extra["pid"][0] == result.extra["pid"][2], "the worker was restarted"


def test_worker_environment_has_no_rendezvous(rewards: Path, monkeypatch):
    for key, value in {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "29500",
        "TORCHELASTIC_RUN_ID": "job",
        "RANK": "5",
        "NCCL_DEBUG": "WARN",
    }.items():
        monkeypatch.setenv(key, value)
    result = score_batch(reward_fn(rewards, "environment"), reward_inputs("a"), timeout_s=10, error_score=-1)
    assert result.num_errors == 0
    assert result.extra == {"rendezvous": [0.0], "rank": [5.0], "nccl": [1.0]}
