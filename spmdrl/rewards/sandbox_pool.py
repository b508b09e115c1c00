"""The worker processes that run untrusted reward functions for :mod:`spmdrl.rewards.sandbox`: started
when a sample needs one, kept for the life of this process, handed samples as they come free, killed
at a sample's timeout or the batch deadline. The parent's side of the pipe protocol; the worker's, and
the messages, are in :mod:`spmdrl.rewards.sandbox_worker`.
"""

from __future__ import annotations

import atexit
import contextlib
import math
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from multiprocessing import connection
from typing import Any

from spmdrl.errors import ConfigError
from spmdrl.rewards.registry import RewardInput
from spmdrl.rewards.sandbox_worker import Limits, Outcome, limits_hint

# Start-up of a worker: a fresh interpreter importing the launching module and the reward module.
WORKER_START_TIMEOUT_S = 120.0
# How long killing a worker waits to reap it. One stuck in the kernel (a hung network file system)
# is left for subprocess to reap later rather than holding up the batch.
_REAP_WAIT_S = 1.0
# The trainer's rendezvous, kept from workers: a reward that calls init_process_group() must not
# join (or hang on) the training job. RANK, LOCAL_RANK and WORLD_SIZE stay: rewards may read them.
_DROPPED_ENV = frozenset({"MASTER_ADDR", "MASTER_PORT"})
_DROPPED_ENV_PREFIXES = ("TORCHELASTIC_",)
THREAD_ENV = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")


def _worker_env() -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in _DROPPED_ENV and not k.startswith(_DROPPED_ENV_PREFIXES)
    }
    # The worker finds this package (and reward modules) where this process finds them.
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    # One sample at a time needs no thread pool; and OpenBLAS reserves tens of MiB of address space
    # per core, which on a many-core node alone would exceed the default RLIMIT_AS.
    for key in THREAD_ENV:
        env.setdefault(key, "1")
    return env


def exit_status(code: int | None) -> str:
    if code is None:
        return "still running"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


class _Worker:
    def __init__(self, limits: Limits) -> None:
        parent_sock, child_sock = socket.socketpair()
        fd = child_sock.fileno()
        code = (
            "from spmdrl.rewards.sandbox_worker import worker_entry; "
            f"worker_entry({fd}, {os.getpid()}, {limits.memory_mb}, {limits.file_size_mb})"
        )
        # A session, hence a process group, of its own: a killpg() in user code cannot reach the
        # trainer, and kill() takes down what the function started along with the worker.
        self.proc = subprocess.Popen(
            [sys.executable, "-c", code], pass_fds=[fd], env=_worker_env(), start_new_session=True
        )
        child_sock.close()
        self.conn = connection.Connection(parent_sock.detach())
        self.limits = limits
        self.blob: bytes | None = None  # the function it has loaded (or is loading)
        self.state = "idle"  # "loading" | "idle" | "busy"
        self.task = -1
        self.deadline = math.inf

    def send(self, msg: Any) -> bool:
        try:
            self.conn.send(msg)
            return True
        except (BrokenPipeError, ConnectionResetError, EOFError, OSError):
            return False

    def exit_code(self, wait_s: float = 0.0) -> int | None:
        try:
            return self.proc.wait(timeout=wait_s)
        except subprocess.TimeoutExpired:
            return None

    def kill(self) -> None:
        """SIGKILL the worker's process group: the worker and whatever it started that stayed in it."""
        if self.proc.returncode is None:  # not reaped yet, so its pid still names its group
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, signal.SIGKILL)
        self.exit_code(wait_s=_REAP_WAIT_S)
        self.conn.close()


@dataclass
class Job:
    """One score_batch call on the pool: what to run, its limits and deadlines, what came back."""

    blob: bytes
    name: str
    inputs: list[RewardInput]
    timeout_s: float
    batch_timeout_s: float | None
    deadline: float  # time.monotonic() by which the batch is over; inf: no batch deadline
    limits: Limits
    # The samples of ``inputs`` this job scores (with reward.fn=auto, the others may be scored inline).
    indices: list[int]
    outcomes: list[Outcome | None] = field(init=False)
    pending: deque[int] = field(init=False)  # samples not yet handed to a worker

    def __post_init__(self) -> None:
        self.outcomes = [None] * len(self.inputs)
        self.pending = deque(self.indices)

    def timed_out(self, index: int, why: str) -> None:
        self.outcomes[index] = Outcome(
            None, timed_out=True, error=f"reward function {self.name} on sample {index}: {why}"
        )


class _Pool:
    """Worker processes kept for the life of this process. A slot is None until a sample needs it."""

    def __init__(self) -> None:
        self.slots: list[_Worker | None] = []

    def run(self, job: Job, num_workers: int) -> list[Outcome]:
        """The outcome of each of ``job.indices`` (at its index; the others stay None)."""
        m = min(num_workers, len(job.indices))
        self.slots += [None] * (m - len(self.slots))
        try:
            self._loop(job, m)
        except BaseException:
            # A worker still busy or loading would answer into the next call; start afresh instead.
            for k, w in self._workers(m):
                if w.state != "idle":
                    self._drop(k)
            raise
        self._stop(job, m)
        assert all(job.outcomes[i] is not None for i in job.indices), "every sample gets an outcome"
        return job.outcomes  # type: ignore[return-value]

    def _workers(self, m: int) -> Iterator[tuple[int, _Worker]]:
        return ((k, w) for k, w in enumerate(self.slots[:m]) if w is not None)

    def _loop(self, job: Job, m: int) -> None:
        """Until every sample is scored or the batch deadline passes."""
        while True:
            self._dispatch(job, m)
            active = {w.conn: (k, w) for k, w in self._workers(m) if w.state != "idle"}
            if not job.pending and all(w.state != "busy" for _, w in active.values()):
                return  # a worker still loading finishes in the next call
            now = time.monotonic()
            if now >= job.deadline:
                return
            if not active:
                continue  # every send failed: those samples are settled, their slots empty; restart them
            wake = min([job.deadline] + [w.deadline for _, w in active.values()])
            for conn in connection.wait(list(active), timeout=max(0.0, wake - now)):
                self._receive(job, active[conn][0])  # type: ignore[index]
            self._expire(job, m)

    def _dispatch(self, job: Job, m: int) -> None:
        """Hand each idle worker its next sample, (re)starting workers while samples wait."""
        for k in range(m):
            if not job.pending:
                return
            w = self._worker_for(job, k)
            if w.state != "idle":
                continue
            i = job.pending.popleft()
            w.state, w.task, w.deadline = "busy", i, time.monotonic() + job.timeout_s
            if not w.send(("call", i, job.inputs[i])):
                job.outcomes[i] = self._died(job, k)

    def _worker_for(self, job: Job, k: int) -> _Worker:
        """Slot ``k``'s worker, loaded with the job's function or loading it."""
        w = self.slots[k]
        # Loading another function, its "loaded" would read as this one's; other limits need a new process.
        if w is not None and (w.limits != job.limits or (w.state == "loading" and w.blob != job.blob)):
            self._drop(k)
            w = None
        if w is None:
            w = self.slots[k] = _Worker(job.limits)
        if w.state == "idle" and w.blob != job.blob:
            w.blob, w.state, w.deadline = job.blob, "loading", time.monotonic() + WORKER_START_TIMEOUT_S
            if not w.send(("load", list(sys.path), job.blob)):
                raise RuntimeError(f"a reward worker process is gone ({exit_status(w.exit_code(wait_s=5))})")
        return w

    def _receive(self, job: Job, k: int) -> None:
        w = self.slots[k]
        assert w is not None
        try:
            msg = w.conn.recv()
        except (EOFError, OSError):
            if w.state != "busy":
                raise RuntimeError(
                    f"a reward worker process exited while loading {job.name} "
                    f"({exit_status(w.exit_code(wait_s=5))}; {limits_hint(job.limits)})"
                ) from None
            job.outcomes[w.task] = self._died(job, k)
            return
        kind = msg[0]
        w.state = "idle"
        if kind == "load_error":
            w.blob = None
            raise ConfigError(
                f"reward function {job.name} could not be loaded in a worker process "
                f"({limits_hint(job.limits)}):\n{msg[1]}"
            )
        if kind == "config_error":
            raise ConfigError(msg[2])
        if kind == "result":
            job.outcomes[msg[1]] = msg[2]

    def _expire(self, job: Job, m: int) -> None:
        """Kill the workers past their sample's timeout."""
        now = time.monotonic()
        for k, w in self._workers(m):
            if w.state == "idle" or now < w.deadline:
                continue
            if w.state == "loading":
                raise RuntimeError(
                    f"a reward worker process did not load {job.name} within {WORKER_START_TIMEOUT_S:.0f} s"
                )
            job.timed_out(w.task, f"ran past timeout_s={job.timeout_s:.3g} s; its worker process was killed")
            self._drop(k)

    def _stop(self, job: Job, m: int) -> None:
        """At the batch deadline, samples still running or waiting time out; running workers die."""
        why = f"not done by the batch deadline (batch_timeout_s={job.batch_timeout_s})"
        for k, w in self._workers(m):
            if w.state == "busy":
                job.timed_out(w.task, f"{why}; its worker process was killed")
                self._drop(k)
        while job.pending:
            job.timed_out(job.pending.popleft(), f"{why}; never started")

    def _died(self, job: Job, k: int) -> Outcome:
        w = self.slots[k]
        assert w is not None
        self._drop(k)  # its group too: what the function started may outlive it
        return Outcome(
            None,
            error=f"the worker process running reward function {job.name} on sample {w.task} exited "
            f"({exit_status(w.proc.returncode)})",
        )

    def _drop(self, k: int) -> None:
        """Kill slot ``k``'s worker; the slot starts a fresh one when a sample next needs it."""
        w = self.slots[k]
        assert w is not None
        w.kill()
        self.slots[k] = None

    def shutdown(self) -> None:
        for k, w in enumerate(self.slots):
            if w is not None:
                self._drop(k)
        self.slots.clear()


POOL_LOCK = threading.Lock()
_POOL: _Pool | None = None


def shared_pool() -> _Pool:
    global _POOL
    if _POOL is None:
        _POOL = _Pool()
        atexit.register(_POOL.shutdown)
    return _POOL
