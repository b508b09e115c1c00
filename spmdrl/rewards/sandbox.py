"""Scoring a batch with a reward function so that one bad sample cannot stop or stall the run.

A sample whose function raises, returns something that is not a finite number, or runs past the
timeout scores ``error_score`` and is counted; the first error of each call is logged with its
traceback. A function that raises :class:`~spmdrl.config.ConfigError` (say ``reward.fn=auto`` on an
unknown data source) ends the run instead: that is a misconfiguration, not a bad sample.

Why user functions run in worker processes (a fresh interpreter per worker, started by ``subprocess``):

- A Python thread cannot be stopped. A hung call left in a thread keeps burning CPU and competing
  for the GIL with the training loop for the rest of the run, and a call that holds the GIL (a
  catastrophically backtracking ``re`` pattern does) blocks the rank outright, so the timeout would
  never fire. A process can be killed (SIGKILL) at the deadline, whatever it is doing.
- A process also contains crashes (a segfaulting extension, ``os._exit``, runaway memory) and
  global-state changes (``os.chdir``, monkey-patching) that would otherwise hit the trainer.
- The worker is a new interpreter (fork + exec, as ``subprocess`` does it). ``fork`` alone would
  copy a rank that holds CUDA contexts, NCCL communicators and vLLM's threads, and a forked child
  of a multi-threaded process may deadlock on a lock another thread held at the fork.
  ``multiprocessing``'s ``spawn`` execs too, but re-imports the launching module (the recipe, torch,
  vLLM) in every worker; our worker imports only this module and the reward function.

The cost: each worker starts once per process (well under a second plus the reward module's imports)
and then stays; each call ships the inputs over a pipe. Functions are sent by pickle: module-level
functions and :class:`~spmdrl.rewards.registry.RewardFn` (which pickles as its spec) work; lambdas
and closures do not, and are refused with a clear error. The built-in rule rewards are bounded (they
search at most 300 characters), so ``trusted`` functions run inline on the fast path: exceptions are
still caught, but no timeout is enforced.
"""

from __future__ import annotations

import atexit
import logging
import math
import numbers
import os
import pickle
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from multiprocessing import connection
from typing import TYPE_CHECKING, Any

from spmdrl.config import ConfigError
from spmdrl.rewards.registry import RewardFn, RewardInput

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

# Start-up of a worker: a fresh interpreter importing the launching module and the reward module.
WORKER_START_TIMEOUT_S = 120.0
# How often a worker checks that its parent is still alive (it exits when orphaned).
_ORPHAN_POLL_S = 1.0


@dataclass
class RewardResult:
    scores_B: torch.Tensor  # float32, one score per input; error_score where a call failed
    num_errors: int  # raised, returned a bad value, or its worker died (timeouts not included)
    num_timeouts: int
    # Extra numeric keys returned in a dict: one value per input, NaN where the sample has none.
    extra: dict[str, list[float]] = field(default_factory=dict)


@dataclass
class _Outcome:
    score: float | None  # None: the call failed (see error / timed_out)
    extra: dict[str, float] = field(default_factory=dict)
    error: str | None = None
    timed_out: bool = False


def score_batch(
    fn: Callable[..., Any],
    inputs: Sequence[RewardInput],
    *,
    timeout_s: float,
    error_score: float,
    trusted: bool | None = None,
    num_workers: int = 2,
) -> RewardResult:
    """Score every input with ``fn`` (the reward signature of :mod:`spmdrl.rewards.registry`).

    ``trusted``: run inline in this process (no timeout). None: True for a built-in
    :class:`RewardFn` loaded by name, False otherwise. Untrusted functions run in up to
    ``num_workers`` worker processes kept for the life of this process; each call gets ``timeout_s``
    seconds from the moment its worker receives it. Not re-entrant across threads (a lock serializes).
    """
    if timeout_s <= 0:
        raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
    if num_workers < 1:
        raise ValueError(f"num_workers must be >= 1, got {num_workers}")
    name = describe(fn)
    if trusted is None:
        trusted = isinstance(fn, RewardFn) and fn.trusted
    if not inputs:
        outcomes: list[_Outcome] = []
    elif trusted:
        outcomes = [_call_one(fn, name, i, inp) for i, inp in enumerate(inputs)]
    else:
        blob = _pickle_fn(fn, name)
        with _POOL_LOCK:
            outcomes = _pool().run(blob, name, list(inputs), timeout_s, num_workers)
    return _collect(outcomes, name, error_score, timeout_s)


def describe(fn: Callable[..., Any]) -> str:
    """A name for ``fn`` in messages: the spec it was loaded from, or module:qualname."""
    if isinstance(fn, RewardFn):
        return fn.spec
    module = getattr(fn, "__module__", None)
    qualname = getattr(fn, "__qualname__", None)
    return f"{module}:{qualname}" if module and qualname else repr(fn)


def _call_one(fn: Callable[..., Any], name: str, index: int, inp: RewardInput) -> _Outcome:
    try:
        value = fn(inp.response, inp.ground_truth, data_source=inp.data_source, extra_info=inp.extra_info)
    except (ConfigError, KeyboardInterrupt):
        raise
    except BaseException:  # noqa: BLE001 - SystemExit from user code is a failed sample too
        return _Outcome(
            None, error=f"reward function {name} raised on sample {index}:\n{traceback.format_exc()}"
        )
    return _check_value(value, name, index)


def _as_finite(value: Any) -> float | None:
    # numbers.Real covers int, float, bool and numpy scalars; strings, None and tensors are refused.
    if not isinstance(value, numbers.Real):
        return None
    f = float(value)
    return f if math.isfinite(f) else None


def _check_value(value: Any, name: str, index: int) -> _Outcome:
    expected = "expected a finite float, or a dict with a finite float 'score' key and numeric extras"
    where = f"reward function {name} returned"
    if isinstance(value, dict):
        if "score" not in value:
            return _Outcome(
                None,
                error=f"{where} a dict without a 'score' key (keys {sorted(value)}) "
                f"for sample {index}; {expected}",
            )
        extra: dict[str, float] = {}
        for key, v in value.items():
            f = _as_finite(v)
            if f is None:
                return _Outcome(
                    None,
                    error=f"{where} {type(v).__name__} {v!r} for key {key!r} of sample {index}; {expected}",
                )
            if key != "score":
                extra[str(key)] = f
        return _Outcome(float(value["score"]), extra=extra)
    score = _as_finite(value)
    if score is None:
        return _Outcome(
            None, error=f"{where} {type(value).__name__} {value!r} for sample {index}; {expected}"
        )
    return _Outcome(score)


def _pickle_fn(fn: Callable[..., Any], name: str) -> bytes:
    try:
        return pickle.dumps(fn)
    except Exception as e:
        raise ConfigError(
            f"reward function {name} cannot be sent to a worker process ({type(e).__name__}: {e}); "
            "define it at module level in an importable module or a .py file and load it with "
            "load_reward_fn('my_pkg.my_mod:score' or 'path/to/file.py:score')"
        ) from e


def _collect(outcomes: list[_Outcome], name: str, error_score: float, timeout_s: float) -> RewardResult:
    import torch  # here, not at the top: worker processes import this module and need no torch

    failed = [(i, o) for i, o in enumerate(outcomes) if o.score is None]
    num_timeouts = sum(o.timed_out for _, o in failed)
    num_errors = len(failed) - num_timeouts
    if failed:
        first_index, first = failed[0]
        log.warning(
            "reward function %s: %d of %d samples failed (%d errors, %d timeouts over %.3g s), scored %s; "
            "first failure (sample %d):\n%s",
            name,
            len(failed),
            len(outcomes),
            num_errors,
            num_timeouts,
            timeout_s,
            error_score,
            first_index,
            first.error,
        )
    keys = sorted({k for o in outcomes for k in o.extra})
    extra = {k: [o.extra.get(k, math.nan) for o in outcomes] for k in keys}
    scores = [error_score if o.score is None else o.score for o in outcomes]
    return RewardResult(
        scores_B=torch.tensor(scores, dtype=torch.float32),
        num_errors=num_errors,
        num_timeouts=num_timeouts,
        extra=extra,
    )


# ---------------------------------------------------------------------------------------------------
# Worker processes
# ---------------------------------------------------------------------------------------------------
# Messages, parent -> worker: ("load", sys_path, fn_blob), ("call", index, RewardInput), None (stop).
# Worker -> parent: ("loaded",), ("load_error", traceback), ("result", index, _Outcome),
# ("config_error", index, message).


def _worker_entry(fd: int, parent_pid: int) -> None:
    """The worker process's main loop (started by _Worker with ``python -c``)."""
    conn = connection.Connection(fd)
    # Ctrl-C reaches the whole process group; the parent decides what happens, the worker carries on.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    threading.Thread(target=_exit_when_orphaned, args=(parent_pid,), daemon=True).start()
    fn: Callable[..., Any] | None = None
    name = ""
    while True:
        try:
            msg = conn.recv()
        except EOFError:
            return
        if msg is None:
            return
        if msg[0] == "load":
            _, sys_path, blob = msg
            sys.path[:] = sys_path  # the parent's, now: it may have grown since this worker started
            try:
                fn = pickle.loads(blob)
                name = describe(fn)
                conn.send(("loaded",))
            except BaseException:  # noqa: BLE001 - reported to the parent, which raises it
                conn.send(("load_error", traceback.format_exc()))
        else:
            _, index, inp = msg
            assert fn is not None, "a call arrived before the function was loaded"
            try:
                conn.send(("result", index, _call_one(fn, name, index, inp)))
            except ConfigError as e:
                conn.send(("config_error", index, str(e)))


def _exit_when_orphaned(parent_pid: int) -> None:
    # If the rank dies without cleaning up (SIGKILL, os._exit), a worker stuck in user code would
    # live on; once orphaned, it is re-parented and getppid() changes.
    while os.getppid() == parent_pid:
        time.sleep(_ORPHAN_POLL_S)
    os._exit(0)


class _Worker:
    def __init__(self) -> None:
        parent_sock, child_sock = socket.socketpair()
        # The worker finds this package (and reward modules) where this process finds them.
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        fd = child_sock.fileno()
        code = f"from spmdrl.rewards.sandbox import _worker_entry; _worker_entry({fd}, {os.getpid()})"
        self.proc = subprocess.Popen([sys.executable, "-c", code], pass_fds=[fd], env=env)
        child_sock.close()
        self.conn = connection.Connection(parent_sock.detach())
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
        self.proc.kill()
        self.exit_code(wait_s=5)
        self.conn.close()


class _Pool:
    def __init__(self) -> None:
        self.workers: list[_Worker] = []

    def run(
        self, blob: bytes, name: str, inputs: list[RewardInput], timeout_s: float, n: int
    ) -> list[_Outcome]:
        m = min(n, len(inputs))
        while len(self.workers) < m:
            self.workers.append(_Worker())
        try:
            return self._run(blob, name, inputs, timeout_s, m)
        except BaseException:
            # A worker still busy or loading would answer into the next call; start afresh instead.
            for k in range(m):
                if self.workers[k].state != "idle":
                    self.workers[k].kill()
                    self.workers[k] = _Worker()
            raise

    def _run(
        self, blob: bytes, name: str, inputs: list[RewardInput], timeout_s: float, m: int
    ) -> list[_Outcome]:
        outcomes: list[_Outcome | None] = [None] * len(inputs)
        pending = deque(range(len(inputs)))
        for k in range(m):
            if self.workers[k].blob != blob:
                self._load(k, blob)
        while pending or any(self.workers[k].state != "idle" for k in range(m)):
            for k in range(m):
                w = self.workers[k]
                if w.state == "idle" and pending:
                    i = pending.popleft()
                    w.state, w.task, w.deadline = "busy", i, time.monotonic() + timeout_s
                    if not w.send(("call", i, inputs[i])):
                        outcomes[i] = self._died(k, name)
            waiting = {self.workers[k].conn: k for k in range(m) if self.workers[k].state != "idle"}
            wait_s = max(0.0, min(self.workers[k].deadline for k in waiting.values()) - time.monotonic())
            for conn in connection.wait(list(waiting), timeout=wait_s):
                k = waiting[conn]  # type: ignore[index]
                w = self.workers[k]
                try:
                    msg = w.conn.recv()
                except (EOFError, OSError):
                    if w.state != "busy":
                        raise RuntimeError(
                            f"a reward worker process exited while loading {name} (exit code {w.exit_code(wait_s=5)})"
                        ) from None
                    outcomes[w.task] = self._died(k, name)
                    continue
                self._handle(w, msg, name, outcomes)
            now = time.monotonic()
            for k in waiting.values():
                w = self.workers[k]
                if w.state == "idle" or now < w.deadline:
                    continue
                if w.state == "loading":
                    raise RuntimeError(
                        f"a reward worker process did not load {name} within {WORKER_START_TIMEOUT_S:.0f} s"
                    )
                outcomes[w.task] = _Outcome(
                    None,
                    timed_out=True,
                    error=f"reward function {name} ran past {timeout_s:.3g} s on sample {w.task}; "
                    "its worker process was killed",
                )
                self._replace(k, blob)
        assert all(o is not None for o in outcomes), "every sample gets an outcome"
        return outcomes  # type: ignore[return-value]

    def _handle(self, w: _Worker, msg: tuple[Any, ...], name: str, outcomes: list[_Outcome | None]) -> None:
        kind = msg[0]
        w.state = "idle"
        if kind == "loaded":
            return
        if kind == "load_error":
            w.blob = None
            raise ConfigError(f"reward function {name} could not be loaded in a worker process:\n{msg[1]}")
        if kind == "config_error":
            raise ConfigError(msg[2])
        outcomes[msg[1]] = msg[2]

    def _load(self, k: int, blob: bytes) -> None:
        w = self.workers[k]
        w.blob, w.state, w.deadline = blob, "loading", time.monotonic() + WORKER_START_TIMEOUT_S
        if not w.send(("load", list(sys.path), blob)):
            raise RuntimeError(f"a reward worker process is gone (exit code {w.exit_code(wait_s=5)})")

    def _died(self, k: int, name: str) -> _Outcome:
        w = self.workers[k]
        outcome = _Outcome(
            None,
            error=f"the worker process running reward function {name} on sample {w.task} exited "
            f"(exit code {w.exit_code(wait_s=5)})",
        )
        assert w.blob is not None
        self._replace(k, w.blob)
        return outcome

    def _replace(self, k: int, blob: bytes) -> None:
        """Kill worker ``k`` and start a fresh one in its slot, loading ``blob``."""
        self.workers[k].kill()
        self.workers[k] = _Worker()
        self._load(k, blob)

    def shutdown(self) -> None:
        for w in self.workers:
            w.send(None)
        for w in self.workers:
            if w.exit_code(wait_s=1) is None:
                w.kill()
            w.conn.close()
        self.workers.clear()


_POOL_LOCK = threading.Lock()
_POOL: _Pool | None = None


def _pool() -> _Pool:
    global _POOL
    if _POOL is None:
        _POOL = _Pool()
        atexit.register(_POOL.shutdown)
    return _POOL
