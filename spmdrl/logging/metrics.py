"""Metric outputs: metrics.jsonl (always), the backends of ``logging.backends`` (tensorboard, console,
wandb, mlflow; spmdrl.logging.backends) and a progress bar, written by rank 0 only.

Reductions across ranks live in spmdrl.distributed.reduce; by the time values reach a logger they are
plain floats that every rank agrees on. Other ranks get a :class:`NullLogger`, so call sites need
no ``if rank == 0``.
"""

from __future__ import annotations

import json
import logging
import math
import sys
import time
from pathlib import Path
from typing import Any

from spmdrl.logging.console import format_table
from spmdrl.logging.progress import Progress, key_metrics, step_line
from spmdrl.logging.trackers import Tracking, open_tracker

log = logging.getLogger("spmdrl")


class NullLogger:
    """Logs nothing: what non-zero ranks get."""

    def log(self, step: int, metrics: dict[str, float]) -> None:
        pass

    def close(self) -> None:
        pass


class MetricLogger(NullLogger):
    def __init__(
        self,
        output_dir: Path,
        *,
        total_steps: int,
        backends: tuple[str, ...] = ("tensorboard",),
        progress_bar: bool = True,
        console_every: int = 10,
        resume_step: int = 0,
        tracking: Tracking | None = None,
    ) -> None:
        self.output_dir = output_dir
        self.console_every = max(console_every, 1)
        self._table = "console" in backends
        # Line-buffered so `tail -f metrics.jsonl` works; closed in close().
        self._jsonl = open(output_dir / "metrics.jsonl", "a", buffering=1)  # noqa: SIM115
        self._tb: Any = None
        if "tensorboard" in backends:
            from torch.utils.tensorboard import SummaryWriter

            # A resumed run rewrites the steps after its checkpoint: tensorboard drops its old events.
            purge = resume_step + 1 if resume_step else None
            self._tb = SummaryWriter(log_dir=str(output_dir / "tensorboard"), purge_step=purge)
        self._trackers: list[Any] = []
        for name in ("wandb", "mlflow"):
            if name in backends:
                if tracking is None:
                    raise ValueError(
                        f"the {name} backend needs tracking settings (the run's name and parameters)"
                    )
                self._trackers.append(open_tracker(name, output_dir, tracking))
        self._bar: Any = None
        if progress_bar and sys.stderr.isatty():
            from tqdm import tqdm

            self._bar = tqdm(total=total_steps, desc="train", dynamic_ncols=True)
        self._start = time.time()
        # Without a terminal (Slurm, nohup) the console lines say how far the run is and when it ends.
        self._progress = Progress(total_steps, start_step=resume_step)
        # The first step this process logs goes to the console too (step 1, or the one after a resume's
        # checkpoint), so a restarted job's log shows at once where it picked up.
        self._first_step = resume_step + 1

    def log(self, step: int, metrics: dict[str, float]) -> None:
        clean = {k: float(v) for k, v in metrics.items()}
        self._jsonl.write(json.dumps({"step": step, **{k: _json_safe(v) for k, v in clean.items()}}) + "\n")
        if self._tb is not None:
            for k, v in clean.items():
                self._tb.add_scalar(k, v, step)
        for tracker in self._trackers:
            tracker.log(step, clean)
        due = step % self.console_every == 0 or step == self._first_step
        if self._table and due:
            # Under a progress bar the bar says how far the run is; without one, the table's header does.
            header = "" if self._bar is not None else self._progress.line(step)
            log.info("%s", format_table(step, clean, header))
        if self._bar is not None:
            self._bar.n = step
            self._bar.set_postfix(_short(clean), refresh=True)
        elif due and not self._table:
            # One short line, as the bar's: the key metrics; every one is in metrics.jsonl.
            log.info("%s", step_line(self._progress.line(step), clean))

    def close(self) -> None:
        self._jsonl.close()
        if self._tb is not None:
            self._tb.close()
        for tracker in self._trackers:
            tracker.close()
        if self._bar is not None:
            self._bar.close()


def _json_safe(v: float) -> float | str:
    return v if math.isfinite(v) else str(v)


def _fmt(v: float) -> str:
    return f"{v:.4g}"


def _short(metrics: dict[str, float]) -> dict[str, str]:
    # The same key metrics a log without a terminal shows on its step lines (spmdrl.logging.progress).
    return {k: _fmt(v) for k, v in key_metrics(metrics).items()}


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """The rows of a metrics.jsonl (for plots, tests and users' notebooks). A line that is not JSON (the
    last one, cut short by a kill mid-write) is skipped."""
    rows = []
    with open(path) as f:
        for line in f:
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(row, dict):
                rows.append(row)
    return rows


def truncate_after(path: Path, step: int) -> int:
    """Keep the rows of a JSON-lines file (metrics.jsonl, samples.jsonl) up to ``step``; drop later ones and
    broken lines. A run resuming from the checkpoint of ``step`` logs the later steps again. Returns the
    number of rows dropped."""
    if not path.exists():
        return 0
    lines = path.read_text().splitlines()
    kept = []
    for line in lines:
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(row, dict) and int(row.get("step", 0)) <= step:
            kept.append(line)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(k + "\n" for k in kept))
    tmp.replace(path)
    return len(lines) - len(kept)


def rewind_logs(directory: Path, step: int) -> int:
    """A run that continues after ``step`` (its checkpoint's; -1: from the start) logs the later steps again:
    ``directory``'s metrics.jsonl and samples.jsonl keep their rows up to ``step``. Returns the rows dropped."""
    return truncate_after(directory / "metrics.jsonl", step) + truncate_after(
        directory / "samples.jsonl", step
    )
