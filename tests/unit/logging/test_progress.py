"""spmdrl/logging/progress.py: the step/total, rate and ETA of a log without a terminal."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from spmdrl.logging.metrics import MetricLogger
from spmdrl.logging.progress import Progress


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_rate_and_eta_from_the_steps_this_process_ran() -> None:
    clock = _Clock()
    p = Progress(total_steps=200, clock=clock)
    assert p.line(0) == "step 0/200 (0%)"
    clock.now += 26.2  # 20 steps at 1.31 s
    assert p.line(20) == "step 20/200 (10%)  1.31 s/step  elapsed 0:00:26  ETA 0:03:56"
    clock.now += 1.31 * 180
    assert p.line(200).endswith("ETA 0:00:00") and p.line(200).startswith("step 200/200 (100%)")


def test_a_resumed_run_times_only_its_own_steps() -> None:
    clock = _Clock()
    p = Progress(total_steps=100, start_step=90, clock=clock)
    assert p.line(90) == "step 90/100 (90%)"  # nothing timed yet: no ETA
    clock.now += 4.0
    assert p.line(92) == "step 92/100 (92%)  2 s/step  elapsed 0:00:04  ETA 0:00:16"


def test_the_metric_logger_writes_progress_lines_without_a_terminal(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Under pytest stderr is not a terminal: the console lines are the progress lines (no tqdm bar)."""
    logger = MetricLogger(tmp_path, total_steps=20, backends=(), console_every=10)
    with caplog.at_level(logging.INFO, logger="spmdrl"):
        for step in range(1, 21):
            logger.log(step, {"train/loss": 1.0 / step})
    logger.close()
    lines = [r.getMessage() for r in caplog.records]
    assert [line.split("  ")[0] for line in lines] == [
        "step 1/20 (5%)",
        "step 10/20 (50%)",
        "step 20/20 (100%)",
    ]
    assert "ETA 0:00:00" in lines[-1] and "train/loss=0.05" in lines[-1]


def test_a_resumed_run_logs_its_first_step_to_the_console(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    logger = MetricLogger(tmp_path, total_steps=20, backends=(), console_every=10, resume_step=4)
    with caplog.at_level(logging.INFO, logger="spmdrl"):
        for step in range(5, 21):
            logger.log(step, {"train/loss": 1.0})
    logger.close()
    heads = [r.getMessage().split("  ")[0] for r in caplog.records]
    assert heads == ["step 5/20 (25%)", "step 10/20 (50%)", "step 20/20 (100%)"]
