"""Progress lines for logs without a terminal (Slurm, nohup): step/total, the rate and the time left.

A terminal gets tqdm's bar (spmdrl.logging.metrics); a log file gets these instead, on the lines the console
already writes, so a user tailing a job's log sees how far it is and when it will end:

    step 20/200 (10%)  1.31 s/step  elapsed 0:00:26  ETA 0:03:56

The rate is measured over the steps this process ran (a resumed run's earlier steps took no time here),
so the first line after a start or a resume has no ETA until a second step has been timed.
"""

from __future__ import annotations

import datetime
import time
from collections.abc import Callable


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
