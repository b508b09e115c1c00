"""spmdrl/logging/progress.py: the step/total, rate, ETA and key metrics of a log without a terminal."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from spmdrl.logging.metrics import MetricLogger, read_metrics
from spmdrl.logging.progress import Progress, step_line


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


# The metrics of a GRPO step as the job logs them (names from spmdrl/rl and the recipe; values arbitrary).
_RL_STEP = {
    **{f"timing/{p}_s": 0.25 for p in ("actor_update", "experience", "reward", "rollout", "step", "update")},
    **{f"actor/{k}": 0.5 for k in ("entropy", "grad_norm", "lr", "pg_clipfrac", "pg_loss", "ppo_kl")},
    **{f"mismatch/{k}": 1e-7 for k in ("kl_k3", "logprob_abs_diff_max", "logprob_abs_diff_mean")},
    **{f"perf/{k}": 4871.65 for k in ("rollout_tokens_per_s", "train_tokens_per_s", "max_memory_gb")},
    **{f"rollout/{k}": 0.125 for k in ("reward_mean", "reward_std", "response_len_mean", "truncated_frac")},
    "reward/errors": 0.0,
}


def test_without_a_terminal_a_step_is_one_short_line_of_its_key_metrics(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Not every metric on one line (an RL step logs ~40): the key ones, and where the rest are."""
    logger = MetricLogger(tmp_path, total_steps=40, backends=(), console_every=10)
    with caplog.at_level(logging.INFO, logger="spmdrl"):
        logger.log(1, _RL_STEP)
    logger.close()
    (line,) = [r.getMessage() for r in caplog.records]
    assert "\n" not in line and len(line) <= 200, line
    assert line.startswith("step 1/40 (2%)")
    assert "rollout/reward_mean=0.125" in line and "actor/pg_loss=0.5" in line
    assert "timing/" not in line and "perf/" not in line
    assert line.endswith(f"(+{len(_RL_STEP) - 3} in metrics.jsonl)")
    # ... and every metric is in the file.
    assert set(read_metrics(tmp_path / "metrics.jsonl")[0]) == {"step", *_RL_STEP}


def test_unknown_metric_names_still_show_a_few() -> None:
    line = step_line("step 3/9 (33%)", {f"mine/m{i}": float(i) for i in range(20)})
    shown = "mine/m0=0  mine/m1=1  mine/m10=10  mine/m11=11  mine/m12=12"  # sorted by name
    assert line == f"step 3/9 (33%)  {shown}  (+15 in metrics.jsonl)"


def test_the_console_backend_still_prints_every_metric_as_a_table(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    logger = MetricLogger(tmp_path, total_steps=40, backends=("console",), console_every=10)
    with caplog.at_level(logging.INFO, logger="spmdrl"):
        logger.log(1, _RL_STEP)
    logger.close()
    (table,) = [r.getMessage() for r in caplog.records]
    head, *rows = table.splitlines()
    assert head.startswith("step 1/40 (2%)")
    assert {row.split()[0] for row in rows if row.strip()} == set(_RL_STEP)
