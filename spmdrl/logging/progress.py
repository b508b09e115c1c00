"""Progress lines for logs without a terminal (Slurm, nohup): step/total, the rate, the time left and the
step's key metrics.

A terminal gets tqdm's bar (spmdrl.logging.metrics) with the key metrics beside it; a log file gets one
short line instead, so a user tailing a job's log sees how far it is, when it will end and how it goes:

    step 20/200 (10%)  1.31 s/step  elapsed 0:00:26  ETA 0:03:56  train/loss=1.27  (+3 in metrics.jsonl)

Every metric is in metrics.jsonl and the other backends; ``logging.backends`` with ``console`` prints them
all as a table under the progress line (spmdrl.logging.console).

The rate is measured over the steps this process ran (a resumed run's earlier steps took no time here),
so the first line after a start or a resume has no ETA until a second step has been timed.
"""

from __future__ import annotations

import datetime
import time
from collections.abc import Callable

# The metrics a step line shows, where the step has them, in this order (the rest: metrics.jsonl).
KEY_METRICS = (
    "train/loss",
    "rollout/reward_mean",
    "val/loss",
    "val/accuracy",
    "val/reward_mean",
    "actor/pg_loss",
    "actor/grad_norm",
    "train/grad_norm",
    "critic/grad_norm",
)
MAX_SHOWN = 5


def key_metrics(metrics: dict[str, float]) -> dict[str, float]:
    """At most MAX_SHOWN of ``metrics``: those of KEY_METRICS present, else (a recipe of its own names) the
    first keys in sorted order."""
    keys = [k for k in KEY_METRICS if k in metrics] or sorted(metrics)
    return {k: metrics[k] for k in keys[:MAX_SHOWN]}


def step_line(progress: str, metrics: dict[str, float]) -> str:
    """``progress`` (:meth:`Progress.line`), the key metrics, and how many more the step logged."""
    shown = key_metrics(metrics)
    values = "  ".join(f"{k}={v:.4g}" for k, v in shown.items())
    rest = len(metrics) - len(shown)
    more = f"  (+{rest} in metrics.jsonl)" if rest else ""
    return "  ".join(p for p in (progress, values) if p) + more


def _hms(seconds: float) -> str:
    return str(datetime.timedelta(seconds=round(seconds)))


class Progress:
    """Counts steps from ``start_step`` (a resumed run's checkpoint) towards ``total_steps``."""

    def __init__(
        self, total_steps: int, start_step: int = 0, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.total_steps = total_steps
        self._clock = clock
        self._first_step = start_step
        self._t0 = self._clock()

    def line(self, step: int) -> str:
        """``step N/T (P%)``, and the seconds per step and ETA once a step of this process has finished."""
        total = max(self.total_steps, 1)
        text = f"step {step}/{self.total_steps} ({100 * step // total}%)"
        done = step - self._first_step
        if done <= 0:
            return text
        elapsed = self._clock() - self._t0
        per_step = elapsed / done
        left = max(self.total_steps - step, 0) * per_step
        return f"{text}  {per_step:.3g} s/step  elapsed {_hms(elapsed)}  ETA {_hms(left)}"
