"""Scoring a batch with a reward function so that one bad sample cannot stop or stall the run.

A sample whose function raises, returns something that is not a finite number (in the float32 of
the scores tensor), or whose worker process dies, scores ``error_score`` and counts as an error; one
that runs past ``timeout_s``, or is not done by the batch deadline (``batch_timeout_s``), scores
``error_score`` and counts as a timeout. The first failure of each call is logged with its
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

What a worker is confined by (none of it is a security boundary; see docs/rewards.md):

- Its own session, hence its own process group: ``os.killpg(os.getpgrp(), ...)`` in user code
  reaches the worker, not the trainer, and a timeout kills the whole group, so subprocesses the
  function started die with it (unless they left the group themselves).
- ``RLIMIT_AS`` (``memory_mb``) and ``RLIMIT_FSIZE`` (``file_size_mb``), set before the function is
  unpickled (so before its module is imported): a runaway allocation raises ``MemoryError`` and a
  runaway write ``OSError`` in user code, both scored errors.
- The environment of this process minus the trainer's rendezvous (``MASTER_ADDR``, ``MASTER_PORT``,
  ``TORCHELASTIC_*``), so a reward that initializes torch.distributed cannot join the training job.

Parallelism and deadlines: samples are handed to ``num_workers`` workers as they come free, so a
function that hangs on every sample costs about ``ceil(N / num_workers)`` times ``timeout_s`` (plus
a worker restart each), and never more than ``batch_timeout_s``: at that deadline the samples still
running or waiting time out and the running workers are killed. Killed or dead workers are replaced
when a sample needs one (in this call, or lazily in the next).

The cost: each worker starts once (well under a second plus the reward module's imports) and then
stays; each call ships the inputs over a pipe. Functions are sent by pickle: module-level functions
and :class:`~spmdrl.rewards.registry.RewardFn` (which pickles as its spec) work; lambdas and
closures do not, and are refused with a clear error. The built-in rule rewards are bounded (they
search at most 300 characters), so ``trusted`` functions run inline on the fast path: exceptions are
still caught, but no timeout (per sample or per batch) and no resource limit is enforced.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import math
import numbers
import os
import pickle
import resource
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from multiprocessing import connection
from typing import TYPE_CHECKING, Any

from spmdrl.errors import ConfigError
from spmdrl.rewards.registry import (
    DATA_SOURCE_FNS,
    REWARD_FNS,
    RewardFn,
    RewardInput,
    auto_score,
    load_reward_fn,
)

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

# Start-up of a worker: a fresh interpreter importing the launching module and the reward module.
WORKER_START_TIMEOUT_S = 120.0
# How often a worker checks that its parent is still alive (it exits when orphaned).
_ORPHAN_POLL_S = 1.0
# How long killing a worker waits to reap it. One stuck in the kernel (a hung network file system)
# is left for subprocess to reap later rather than holding up the batch.
_REAP_WAIT_S = 1.0
# The trainer's rendezvous, kept from workers: a reward that calls init_process_group() must not
# join (or hang on) the training job. RANK, LOCAL_RANK and WORLD_SIZE stay: rewards may read them.
_DROPPED_ENV = frozenset({"MASTER_ADDR", "MASTER_PORT"})
_DROPPED_ENV_PREFIXES = ("TORCHELASTIC_",)
THREAD_ENV = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")
# A returned value is quoted in error messages up to this many characters.
_REPR_CHARS = 200
_EXPECTED = "expected a finite float, or a dict with a finite float 'score' key and finite numeric extras"


@dataclass
class RewardResult:
    """A batch's rewards and the samples that got no score. Each sample counts once in ``num_errors`` +
    ``num_timeouts`` (reward/errors, the budget of reward.max_error_frac), whatever failed on it;
    the judge's and the reward model's parts are broken out so that the stop names the source to fix."""

    scores_B: torch.Tensor  # float32, one score per input; error_score where a call failed
    # Raised, returned a bad value, or its worker died (timeouts not included); with the judge
    # (spmdrl/rl/model_rewards.py), also the samples reward.fn scored but whose judge reply did not parse,
    # and with the reward model, those it alone gave a NaN/inf score.
    num_errors: int
    num_timeouts: int  # ran past timeout_s, or not done by the batch deadline
    # Extra numeric keys returned in a dict: one value per input, NaN where the sample has none.
    extra: dict[str, list[float]] = field(default_factory=dict)
    # Which samples reward.fn gave no score (bool, per input); None where only the counts are known
    # (rows kept by dynamic sampling, rows rebuilt on a trainer rank). The judge reads it so that a
    # sample failed by both is counted once.
    failed_B: torch.Tensor | None = None
    # Judge replies that did not parse (reward_model.judge.*), one per sample judged.
    num_judge_errors: int = 0
    # Of those, the ones on samples reward.fn scored: the part of num_errors the judge alone caused.
    num_judge_only: int = 0
    # Reward-model scores that were NaN or inf (reward_model.*), one per sample scored.
    num_rm_nonfinite: int = 0
    # Of those, the ones on samples that reward.fn scored and the judge did not fail: the part of
    # num_errors the reward model alone caused.
    num_rm_only: int = 0

    @property
    def num_fn_failed(self) -> int:
        """The samples reward.fn gave no score (errors and timeouts)."""
        return self.num_errors + self.num_timeouts - self.num_judge_only - self.num_rm_only


@dataclass
class _Outcome:
    score: float | None  # None: the call failed (see error / timed_out)
    extra: dict[str, float] = field(default_factory=dict)
    error: str | None = None
    timed_out: bool = False


@dataclass(frozen=True)
class _Limits:
    """Resource limits of a worker process in MiB; 0: unlimited."""

    memory_mb: int  # RLIMIT_AS: address space, not resident memory
    file_size_mb: int  # RLIMIT_FSIZE: the largest file it may write


def score_batch(
    fn: Callable[..., Any],
    inputs: Sequence[RewardInput],
    *,
    timeout_s: float,
    error_score: float,
    trusted: bool | None = None,
    num_workers: int = 2,
    batch_timeout_s: float | None = None,
    memory_mb: int = 4096,
    file_size_mb: int = 64,
) -> RewardResult:
    """Score every input with ``fn`` (the reward signature of :mod:`spmdrl.rewards.registry`).

    ``trusted``: run inline in this process (no timeout, no limits). None: True for a built-in
    :class:`RewardFn` loaded by name, False otherwise. Untrusted functions run in up to
    ``num_workers`` worker processes kept for the life of this process; each call gets ``timeout_s``
    seconds from the moment its worker receives it, and the whole batch ``batch_timeout_s`` seconds
    from now (None: no batch deadline). ``memory_mb`` and ``file_size_mb`` limit each worker's
    address space and file writes (0: unlimited). Not re-entrant across threads (a lock serializes).
    """
    _check_args(timeout_s, batch_timeout_s, num_workers, memory_mb, file_size_mb)
    deadline = math.inf if batch_timeout_s is None else time.monotonic() + batch_timeout_s
    name = describe(fn)
    if trusted is None:
        trusted = isinstance(fn, RewardFn) and fn.trusted
    # What scores each sample: fn; or, for a trusted fn that dispatches (reward.fn=auto), the rule of the
    # sample's data source when that rule is not trusted (math-verify): those samples go to the workers.
    rules = {ds: _untrusted_rule(fn, ds) for ds in {inp.data_source for inp in inputs}} if trusted else {}
    runs: list[Callable[..., Any]] = [rules.get(inp.data_source) or fn for inp in inputs]
    outcomes: list[_Outcome | None] = [
        _call_one(fn, name, i, inp) if trusted and run is fn else None
        for i, (inp, run) in enumerate(zip(inputs, runs, strict=True))
    ]
    for run in dict.fromkeys(r for r, o in zip(runs, outcomes, strict=True) if o is None):
        run_name = describe(run)
        job = _Job(
            blob=_pickle_fn(run, run_name),
            name=run_name,
            inputs=list(inputs),
            timeout_s=timeout_s,
            batch_timeout_s=batch_timeout_s,
            deadline=deadline,
            limits=_Limits(memory_mb, file_size_mb),
            indices=[
                i for i, (r, o) in enumerate(zip(runs, outcomes, strict=True)) if o is None and r == run
            ],
        )
        with _POOL_LOCK:
            scored = _pool().run(job, num_workers)
        for i in job.indices:
            outcomes[i] = scored[i]
    return _collect(outcomes, name, error_score, timeout_s, batch_timeout_s)  # type: ignore[arg-type]


def _untrusted_rule(fn: Callable[..., Any], data_source: str) -> RewardFn | None:
    """For reward.fn=auto: the rule of ``data_source`` if it is registered untrusted (it then runs in a
    worker, not inline with auto), else None."""
    if not (isinstance(fn, RewardFn) and fn.fn is auto_score):
        return None
    rule = DATA_SOURCE_FNS.get(data_source)
    for name in REWARD_FNS:
        if REWARD_FNS[name] is rule and not REWARD_FNS.get(name).trusted:
            return load_reward_fn(name)
    return None


def _check_args(
    timeout_s: float, batch_timeout_s: float | None, num_workers: int, memory_mb: int, file_size_mb: int
) -> None:
    if timeout_s <= 0:
        raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
    if batch_timeout_s is not None and batch_timeout_s <= 0:
        raise ValueError(f"batch_timeout_s must be > 0 (or None: no batch deadline), got {batch_timeout_s}")
    if num_workers < 1:
        raise ValueError(f"num_workers must be >= 1, got {num_workers}")
    if memory_mb < 0 or file_size_mb < 0:
        raise ValueError(
            f"memory_mb and file_size_mb must be >= 0 (0: unlimited), got {memory_mb}, {file_size_mb}"
        )


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


def _check_value(value: Any, name: str, index: int) -> _Outcome:
    where = f"reward function {name} returned"
    if isinstance(value, dict):
        if "score" not in value:
            return _Outcome(
                None,
                error=f"{where} a dict without a 'score' key (keys {_short_repr(sorted(map(str, value)))}) "
                f"for sample {index}; {_EXPECTED}",
            )
        extra: dict[str, float] = {}
        for key, v in value.items():
            if key != "score" and not isinstance(v, numbers.Real):
                continue  # text (verl functions return the parsed answer too): not a metric, left out
            f = _as_finite(v)
            if f is None:
                return _Outcome(
                    None,
                    error=f"{where} {type(v).__name__} {_short_repr(v)} for key {_short_repr(key)} "
                    f"of sample {index}; {_EXPECTED}",
                )
            if key != "score":
                extra[str(key)] = f
        return _Outcome(_as_finite(value["score"]), extra=extra)  # finite: checked with the extras
    score = _as_finite(value)
    if score is None:
        return _Outcome(
            None, error=f"{where} {type(value).__name__} {_short_repr(value)} for sample {index}; {_EXPECTED}"
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


def _fit_dtype(outcomes: list[_Outcome], name: str, dtype: torch.dtype) -> list[_Outcome]:
    """Scores finite as Python floats but not in ``dtype`` (1e39 in float32) are errors too."""
    import torch

    scores = torch.tensor([0.0 if o.score is None else o.score for o in outcomes], dtype=dtype)
    fits = torch.isfinite(scores).tolist()
    return [
        o
        if ok
        else _Outcome(
            None,
            error=f"reward function {name} returned {o.score!r} for sample {i}, not finite as {dtype}; {_EXPECTED}",
        )
        for i, (o, ok) in enumerate(zip(outcomes, fits, strict=True))
    ]


def _collect(
    outcomes: list[_Outcome], name: str, error_score: float, timeout_s: float, batch_timeout_s: float | None
) -> RewardResult:
    import torch  # here, not at the top: worker processes import this module and need no torch

    outcomes = _fit_dtype(outcomes, name, torch.float32)
    failed = [(i, o) for i, o in enumerate(outcomes) if o.score is None]
    num_timeouts = sum(o.timed_out for _, o in failed)
    num_errors = len(failed) - num_timeouts
    if failed:
        first_index, first = failed[0]
        log.warning(
            "reward function %s: %d of %d samples failed (%d errors, %d timeouts; timeout_s=%.3g, "
            "batch_timeout_s=%s), scored %s; first failure (sample %d):\n%s",
            name,
            len(failed),
            len(outcomes),
            num_errors,
            num_timeouts,
            timeout_s,
            batch_timeout_s,
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
        failed_B=torch.tensor([o.score is None for o in outcomes], dtype=torch.bool),
    )


# ---------------------------------------------------------------------------------------------------
# Worker processes
# ---------------------------------------------------------------------------------------------------
# Messages, parent -> worker: ("load", sys_path, fn_blob), ("call", index, RewardInput), None (stop).
# Worker -> parent: ("loaded",), ("load_error", traceback), ("result", index, _Outcome),
# ("config_error", index, message).


def _worker_entry(fd: int, parent_pid: int, memory_mb: int = 0, file_size_mb: int = 0) -> None:
    """The worker process's main loop (started by _Worker with ``python -c``)."""
    limits = _Limits(memory_mb, file_size_mb)
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


def _set_limits(limits: _Limits) -> None:
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
    limits: _Limits,
) -> None:
    try:
        outcome = _call_one(fn, name, index, inp)
    except ConfigError as e:
        conn.send(("config_error", index, str(e)))
        return
    except BaseException:  # noqa: BLE001 - a KeyboardInterrupt raised by user code: a failed sample
        outcome = _Outcome(
            None, error=f"reward function {name} raised on sample {index}:\n{traceback.format_exc()}"
        )
    if limits.memory_mb and outcome.error and "\nMemoryError" in outcome.error:
        outcome.error += f"(this worker's {_limits_hint(limits)})"
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
    def __init__(self, limits: _Limits) -> None:
        parent_sock, child_sock = socket.socketpair()
        fd = child_sock.fileno()
        code = (
            "from spmdrl.rewards.sandbox import _worker_entry; "
            f"_worker_entry({fd}, {os.getpid()}, {limits.memory_mb}, {limits.file_size_mb})"
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
class _Job:
    """One score_batch call on the pool: what to run, its limits and deadlines, what came back."""

    blob: bytes
    name: str
    inputs: list[RewardInput]
    timeout_s: float
    batch_timeout_s: float | None
    deadline: float  # time.monotonic() by which the batch is over; inf: no batch deadline
    limits: _Limits
    # The samples of ``inputs`` this job scores (with reward.fn=auto, the others may be scored inline).
    indices: list[int]
    outcomes: list[_Outcome | None] = field(init=False)
    pending: deque[int] = field(init=False)  # samples not yet handed to a worker

    def __post_init__(self) -> None:
        self.outcomes = [None] * len(self.inputs)
        self.pending = deque(self.indices)

    def timed_out(self, index: int, why: str) -> None:
        self.outcomes[index] = _Outcome(
            None, timed_out=True, error=f"reward function {self.name} on sample {index}: {why}"
        )


class _Pool:
    """Worker processes kept for the life of this process. A slot is None until a sample needs it."""

    def __init__(self) -> None:
        self.slots: list[_Worker | None] = []

    def run(self, job: _Job, num_workers: int) -> list[_Outcome]:
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

    def _loop(self, job: _Job, m: int) -> None:
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

    def _dispatch(self, job: _Job, m: int) -> None:
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

    def _worker_for(self, job: _Job, k: int) -> _Worker:
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

    def _receive(self, job: _Job, k: int) -> None:
        w = self.slots[k]
        assert w is not None
        try:
            msg = w.conn.recv()
        except (EOFError, OSError):
            if w.state != "busy":
                raise RuntimeError(
                    f"a reward worker process exited while loading {job.name} "
                    f"({exit_status(w.exit_code(wait_s=5))}; {_limits_hint(job.limits)})"
                ) from None
            job.outcomes[w.task] = self._died(job, k)
            return
        kind = msg[0]
        w.state = "idle"
        if kind == "load_error":
            w.blob = None
            raise ConfigError(
                f"reward function {job.name} could not be loaded in a worker process "
                f"({_limits_hint(job.limits)}):\n{msg[1]}"
            )
        if kind == "config_error":
            raise ConfigError(msg[2])
        if kind == "result":
            job.outcomes[msg[1]] = msg[2]

    def _expire(self, job: _Job, m: int) -> None:
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

    def _stop(self, job: _Job, m: int) -> None:
        """At the batch deadline, samples still running or waiting time out; running workers die."""
        why = f"not done by the batch deadline (batch_timeout_s={job.batch_timeout_s})"
        for k, w in self._workers(m):
            if w.state == "busy":
                job.timed_out(w.task, f"{why}; its worker process was killed")
                self._drop(k)
        while job.pending:
            job.timed_out(job.pending.popleft(), f"{why}; never started")

    def _died(self, job: _Job, k: int) -> _Outcome:
        w = self.slots[k]
        assert w is not None
        self._drop(k)  # its group too: what the function started may outlive it
        return _Outcome(
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


def _limits_hint(limits: _Limits) -> str:
    memory = f"{limits.memory_mb} MiB" if limits.memory_mb else "unlimited"
    return f"address space limit {memory}: reward.worker_memory_mb"


_POOL_LOCK = threading.Lock()
_POOL: _Pool | None = None


def _pool() -> _Pool:
    global _POOL
    if _POOL is None:
        _POOL = _Pool()
        atexit.register(_POOL.shutdown)
    return _POOL
