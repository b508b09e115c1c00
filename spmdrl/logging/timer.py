"""Wall-clock time per phase of a step: ``with timer("rollout"): ...`` instead of paired ``t0 =`` lines.

Each phase is also a ``torch.profiler.record_function`` range named ``phase/<name>``, so a profiled step
(logging.profile_steps) attributes its host time and its device time to the same phases the timing/*
metrics name (spmdrl.logging.profiler's phase table). Outside a profiler a range costs a few
microseconds, a handful of times per step.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

from torch.profiler import record_function

# The profiler ranges' prefix (spmdrl.logging.profiler reads phases back by it).
PHASE_PREFIX = "phase/"


class PhaseTimer:
    """Seconds per named phase (``<name>_s``), added up if a phase runs more than once."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self._start = time.perf_counter()

    @contextlib.contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            with record_function(PHASE_PREFIX + name):
                yield
        finally:
            key = f"{name}_s"
            self.seconds[key] = self.seconds.get(key, 0.0) + time.perf_counter() - t0

    def maybe(self, name: str, timed: bool) -> contextlib.AbstractContextManager[None]:
        """``self(name)`` when ``timed``, else nothing (a phase that only sometimes does work)."""
        return self(name) if timed else contextlib.nullcontext()

    def add(self, name: str, seconds: float) -> None:
        """A phase timed elsewhere (a part of another phase, say)."""
        self.seconds[f"{name}_s"] = self.seconds.get(f"{name}_s", 0.0) + seconds

    def elapsed(self) -> float:
        """Seconds since the timer was made (the whole step)."""
        return time.perf_counter() - self._start
