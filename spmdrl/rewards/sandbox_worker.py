"""One reward call, and the worker process that makes them for :mod:`spmdrl.rewards.sandbox`.

The call and the checks of what it returned run the same inline (trusted functions) and in a worker; the
worker's side of the pipe protocol (below), its resource limits, and its exit when orphaned are here.
A worker process imports this module and the reward function only (no torch); the parent's side, the
pool of workers, is :mod:`spmdrl.rewards.sandbox_pool`.
"""

from __future__ import annotations

import contextlib
import math
import numbers
import os
import pickle
import resource
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing import connection
from typing import Any

from spmdrl.errors import ConfigError
from spmdrl.rewards.registry import RewardFn, RewardInput

# How often a worker checks that its parent is still alive (it exits when orphaned).
_ORPHAN_POLL_S = 1.0
# A returned value is quoted in error messages up to this many characters.
_REPR_CHARS = 200
EXPECTED = "expected a finite float, or a dict with a finite float 'score' key and finite numeric extras"


@dataclass
class Outcome:
    score: float | None  # None: the call failed (see error / timed_out)
    extra: dict[str, float] = field(default_factory=dict)
    error: str | None = None
    timed_out: bool = False


@dataclass(frozen=True)
class Limits:
    """Resource limits of a worker process in MiB; 0: unlimited."""

    memory_mb: int  # RLIMIT_AS: address space, not resident memory
    file_size_mb: int  # RLIMIT_FSIZE: the largest file it may write


def describe(fn: Callable[..., Any]) -> str:
    """A name for ``fn`` in messages: the spec it was loaded from, or module:qualname."""
    if isinstance(fn, RewardFn):
        return fn.spec
    module = getattr(fn, "__module__", None)
    qualname = getattr(fn, "__qualname__", None)
    return f"{module}:{qualname}" if module and qualname else repr(fn)


def call_one(fn: Callable[..., Any], name: str, index: int, inp: RewardInput) -> Outcome:
    try:
        value = fn(inp.response, inp.ground_truth, data_source=inp.data_source, extra_info=inp.extra_info)
    except (ConfigError, KeyboardInterrupt):
        raise
    except BaseException:  # noqa: BLE001 - SystemExit from user code is a failed sample too
        return Outcome(
            None, error=f"reward function {name} raised on sample {index}:\n{traceback.format_exc()}"
        )
    return _check_value(value, name, index)


def _as_finite(value: Any) -> float | None:
    # numbers.Real covers int, float, bool and numpy scalars; strings, None and tensors are refused.
    if not isinstance(value, numbers.Real):
        return None
    try:
        f = float(value)
    except Exception:  # noqa: BLE001 - 10**400 (OverflowError), or a broken __float__
        return None
    return f if math.isfinite(f) else None


def _short_repr(value: Any) -> str:
    try:
        text = repr(value)
    except Exception as e:  # noqa: BLE001 - an int past sys.get_int_max_str_digits(), a broken __repr__
        text = f"<{type(value).__name__} whose repr raised {type(e).__name__}>"
    return text if len(text) <= _REPR_CHARS else f"{text[:_REPR_CHARS]}... ({len(text)} characters)"


def _check_value(value: Any, name: str, index: int) -> Outcome:
    where = f"reward function {name} returned"
    if isinstance(value, dict):
        if "score" not in value:
            return Outcome(
                None,
                error=f"{where} a dict without a 'score' key (keys {_short_repr(sorted(map(str, value)))}) "
                f"for sample {index}; {EXPECTED}",
            )
        extra: dict[str, float] = {}
        for key, v in value.items():
            if key != "score" and not isinstance(v, numbers.Real):
                continue  # text (verl functions return the parsed answer too): not a metric, left out
            f = _as_finite(v)
            if f is None:
                return Outcome(
                    None,
                    error=f"{where} {type(v).__name__} {_short_repr(v)} for key {_short_repr(key)} "
                    f"of sample {index}; {EXPECTED}",
                )
            if key != "score":
                extra[str(key)] = f
        return Outcome(_as_finite(value["score"]), extra=extra)  # finite: checked with the extras
    score = _as_finite(value)
    if score is None:
        return Outcome(
            None, error=f"{where} {type(value).__name__} {_short_repr(value)} for sample {index}; {EXPECTED}"
        )
    return Outcome(score)


# Messages, parent -> worker: ("load", sys_path, fn_blob), ("call", index, RewardInput), None (stop).
# Worker -> parent: ("loaded",), ("load_error", traceback), ("result", index, Outcome),
# ("config_error", index, message).


def worker_entry(fd: int, parent_pid: int, memory_mb: int = 0, file_size_mb: int = 0) -> None:
    """The worker process's main loop (started by _Worker with ``python -c``)."""
    limits = Limits(memory_mb, file_size_mb)
    _set_limits(limits)  # before any user code: that comes with "load"
    conn = connection.Connection(fd)
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
            fn, name = _worker_load(conn, msg[1], msg[2])
        else:
            assert fn is not None, "a call arrived before the function was loaded"
            _worker_call(conn, fn, name, msg[1], msg[2], limits)


def _set_limits(limits: Limits) -> None:
    if limits.memory_mb:
        _set_rlimit(resource.RLIMIT_AS, limits.memory_mb << 20)
    if limits.file_size_mb:
        # Past RLIMIT_FSIZE the kernel sends SIGXFSZ, whose default action kills the worker. Ignored,
        # the write fails with OSError (EFBIG) in user code instead: a scored error.
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        _set_rlimit(resource.RLIMIT_FSIZE, limits.file_size_mb << 20)


def _set_rlimit(which: int, value: int) -> None:
    _, hard = resource.getrlimit(which)
    if hard != resource.RLIM_INFINITY:
        value = min(value, hard)  # an unprivileged process cannot raise its hard limit
    # The hard limit too, so that user code cannot lift it again.
    resource.setrlimit(which, (value, value))


def _worker_load(conn: connection.Connection, sys_path: list[str], blob: bytes) -> tuple[Any, str]:
    sys.path[:] = sys_path  # the parent's, now: it may have grown since this worker started
    try:
        fn = pickle.loads(blob)
        name = describe(fn)
    except BaseException:  # noqa: BLE001 - reported to the parent, which raises it
        conn.send(("load_error", traceback.format_exc()))
        return None, ""
    conn.send(("loaded",))
    return fn, name


def _worker_call(
    conn: connection.Connection,
    fn: Callable[..., Any],
    name: str,
    index: int,
    inp: RewardInput,
    limits: Limits,
) -> None:
    try:
        outcome = call_one(fn, name, index, inp)
    except ConfigError as e:
        conn.send(("config_error", index, str(e)))
        return
    except BaseException:  # noqa: BLE001 - a KeyboardInterrupt raised by user code: a failed sample
        outcome = Outcome(
            None, error=f"reward function {name} raised on sample {index}:\n{traceback.format_exc()}"
        )
    if limits.memory_mb and outcome.error and "\nMemoryError" in outcome.error:
        outcome.error += f"(this worker's {limits_hint(limits)})"
    conn.send(("result", index, outcome))


def _exit_when_orphaned(parent_pid: int) -> None:
    # If the rank dies without cleaning up (SIGKILL, os._exit), a worker stuck in user code would
    # live on; once orphaned, it is re-parented and getppid() changes.
    while os.getppid() == parent_pid:
        time.sleep(_ORPHAN_POLL_S)
    # The worker leads its own process group: this takes what the function started along with it.
    with contextlib.suppress(OSError):
        os.killpg(os.getpgrp(), signal.SIGKILL)
    os._exit(0)


def limits_hint(limits: Limits) -> str:
    memory = f"{limits.memory_mb} MiB" if limits.memory_mb else "unlimited"
    return f"address space limit {memory}: reward.worker_memory_mb"
