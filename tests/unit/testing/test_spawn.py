"""spmdrl.testing.spawn.side_by_side: independent jobs at once where the cores allow, results in order."""

from __future__ import annotations

import os
import sys
import threading

import pytest

from spmdrl.testing import spawn


def _pair(monkeypatch: pytest.MonkeyPatch, cores: int, ranks_each: int) -> list[bool]:
    """Two calls, the first waiting (up to 1 s) for the second to start: whether each saw the other."""
    monkeypatch.setattr(spawn, "usable_cores", lambda: cores)
    second_started = threading.Event()

    def first() -> bool:
        return second_started.wait(timeout=1.0)

    def second() -> bool:
        second_started.set()
        return True

    return spawn.side_by_side([first, second], ranks_each)


def test_two_one_rank_jobs_run_at_once_on_two_cores(monkeypatch: pytest.MonkeyPatch) -> None:
    assert _pair(monkeypatch, cores=2, ranks_each=1) == [True, True]


@pytest.mark.parametrize(("cores", "ranks_each"), [(1, 1), (2, 2), (3, 2)])
def test_one_at_a_time_where_the_cores_hold_one_job(
    monkeypatch: pytest.MonkeyPatch, cores: int, ranks_each: int
) -> None:
    # The second call starts only after the first has given up waiting for it.
    assert _pair(monkeypatch, cores, ranks_each) == [False, True]


def test_results_in_the_calls_order_and_a_failure_is_raised(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(spawn, "usable_cores", lambda: 4)
    assert spawn.side_by_side([lambda i=i: i * i for i in range(5)]) == [0, 1, 4, 9, 16]

    def broken() -> int:
        raise ValueError("job 2 failed")

    with pytest.raises(ValueError, match="job 2 failed"):
        spawn.side_by_side([lambda: 1, broken])


def test_usable_cores_is_the_affinity() -> None:
    import os

    assert spawn.usable_cores() == len(os.sched_getaffinity(0)) >= 1


def test_a_failure_is_raised_while_the_others_still_run(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(spawn, "usable_cores", lambda: 2)
    release, finished = threading.Event(), threading.Event()

    def long_job() -> int:
        release.wait(timeout=10.0)
        finished.set()
        return 1

    def broken() -> int:
        raise RuntimeError("rank 0 failed")

    with pytest.raises(RuntimeError, match="rank 0 failed"):
        spawn.side_by_side([long_job, broken])
    assert not finished.is_set(), "raised only after the long job ended"
    release.set()


def _prints(rank: int, world: int) -> int:
    print(f"rank {rank} says hello")
    print(f"rank {rank} warns", file=sys.stderr)
    return os.getpid()


def test_a_rank_prints_where_the_test_prints(capfd: pytest.CaptureFixture[str]) -> None:
    """A forked rank's stdout and stderr reach the calling test's (captured) output, not the stream of
    whichever test started the fork server; and each rank is a process of its own."""
    pids = spawn.run_distributed(_prints, 2)
    out, err = capfd.readouterr()
    assert "rank 0 says hello" in out and "rank 1 says hello" in out, out
    assert "rank 1 warns" in err, err
    assert len(set(pids)) == 2 and os.getpid() not in pids
