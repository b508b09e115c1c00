"""``spmdrl.distributed.env.wait_for`` on 2 gloo processes: a rank waiting for work one rank does (a model's
files, an export) reports that it still waits, and a writer that never comes ends the wait with an error
naming what it waited for, instead of the silent two-hour wait a mismatched call (a rank that never
resolves the files it is waited on for) used to give."""

from __future__ import annotations

import logging
import time

from spmdrl.testing.spawn import run_distributed


def _worker(rank: int, world: int) -> dict:
    from spmdrl.distributed import env

    seen: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            seen.append(record.getMessage())

    env.log.addHandler(Keep())
    out: dict = {}
    # A writer 1 s late: the waiting rank reports and then goes on.
    if rank == 0:
        time.sleep(1.0)
    env.wait_for("late", writer=rank == 0, report_every_s=0.3)
    out["late_reports"] = [m for m in seen if "'late'" in m]
    # A writer that never comes: rank 0 never writes this one (it stays up: it hosts the store).
    if rank == 0:
        time.sleep(2.5)
    else:
        t0 = time.monotonic()
        try:
            env.wait_for("never", writer=False, timeout_min=1 / 60, report_every_s=0.3)
            out["error"] = None
        except RuntimeError as e:
            out["error"] = str(e)
        out["waited_s"] = time.monotonic() - t0
    return out


def test_a_waiting_rank_reports_and_a_writer_that_never_comes_is_an_error() -> None:
    res = run_distributed(_worker, 2, timeout_s=120)
    assert res[0]["late_reports"] == []  # the writer waits for nothing
    assert res[1]["late_reports"] and "still waiting for 'late' (call 1)" in res[1]["late_reports"][0]
    assert res[1]["error"] is not None and "rank 1 waited" in res[1]["error"]
    assert "'never'" in res[1]["error"] and "never finished" in res[1]["error"]
    assert 0.9 <= res[1]["waited_s"] < 10
