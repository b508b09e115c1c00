"""Running model-written Python in a child process with limits: the engine of the ``python`` tool.

Each run is a fresh interpreter (``sys.executable``), started by ``subprocess`` (fork + exec, safe
from the trainer's many threads; no ``preexec_fn``), in:

- **its own session, hence process group**, killed with SIGKILL when the code passes its wall-time
  limit, and again after it exits, so the subprocesses it started (``subprocess``, ``os.fork``,
  ``multiprocessing``) die with it, unless they left the group themselves (``setsid``);
- **resource limits** set by the child before the code runs, inherited by what it starts:
  ``RLIMIT_AS`` (address space: a large allocation raises ``MemoryError``), ``RLIMIT_CPU`` (SIGXCPU,
  then SIGKILL a second later), ``RLIMIT_FSIZE`` (a write past it fails with ``OSError``: it also
  bounds the captured output) and no core dumps;
- **a temporary working directory**, also its ``HOME`` and ``TMPDIR``, removed afterwards; the code
  is written there as ``main.py``, so tracebacks read ``File "main.py", line 3``;
- **a small environment**: ``PATH``, the locale, ``PYTHONPATH``, one thread per BLAS/OpenMP pool and
  ``CUDA_VISIBLE_DEVICES=""`` (the trainer's GPUs stay out of reach of ``import torch``); not the
  trainer's other variables, so tokens and keys in the environment are not printed by accident;
- **stdout and stderr in unnamed temporary files** (no pipe a leftover grandchild could hold open),
  of which the first (stdout) and last (stderr) ``max_output_chars`` characters are kept;
- **a parent-death signal**: if the trainer dies, the child is killed with it (Linux).

What it does **not** isolate (this is not a security boundary; see docs/tools.md): the code runs as
the same user as the trainer, with the same network access, and can read every file the trainer can
and write every file it may write (checkpoints too) outside its directory; it can start processes that
leave its process group and so outlive the limit; ``RLIMIT_AS`` bounds each process, not their sum,
and says nothing of the number of processes or of disk use beyond each file's size. Training on
untrusted prompts, run the tool inside a container or VM with no network, a scratch file system and
cgroup limits, or replace it with a tool that calls such a sandbox.
"""

from __future__ import annotations

import atexit
import contextlib
import math
import os
import select
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import IO

from spmdrl.rewards.sandbox_pool import THREAD_ENV, exit_status

# How long killing a run waits to reap it (one stuck in the kernel is left to subprocess's cleanup).
_REAP_WAIT_S = 1.0
# Without pidfd_open (Linux < 5.3), how often the wait for the child's exit polls.
_POLL_S = 0.01
# Passed through from the trainer's environment; everything else is left out.
_KEPT_ENV = ("PATH", "LANG", "LC_ALL", "LC_CTYPE", "TZ", "PYTHONPATH")

# The child's first code: limits, parent-death signal, then main.py as __main__. Standard library only.
_RUNNER = r"""
def _spmdrl_run():
    import os, resource, signal, sys, traceback

    def limit(which, soft, hard):
        cur = resource.getrlimit(which)[1]
        if cur != resource.RLIM_INFINITY:  # an unprivileged process cannot raise its hard limit
            soft, hard = min(soft, cur), min(hard, cur)
        resource.setrlimit(which, (soft, hard))  # the hard limit too: the code cannot lift it

    memory_mb, cpu_s, file_size_mb, parent = (int(a) for a in sys.argv[1:5])
    try:
        import ctypes
        ctypes.CDLL(None).prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG
    except Exception:
        pass
    if os.getppid() != parent:  # the trainer died before the signal was set
        os._exit(1)
    if memory_mb:
        limit(resource.RLIMIT_AS, memory_mb << 20, memory_mb << 20)
    if cpu_s:
        limit(resource.RLIMIT_CPU, cpu_s, cpu_s + 1)
    if file_size_mb:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with OSError instead
        limit(resource.RLIMIT_FSIZE, file_size_mb << 20, file_size_mb << 20)
    limit(resource.RLIMIT_CORE, 0, 0)
    sys.argv = ["main.py"]
    g = globals()
    g.pop("_spmdrl_run")
    g["__file__"] = "main.py"
    try:
        with open("main.py", encoding="utf-8") as f:
            code = compile(f.read(), "main.py", "exec")
        exec(code, g)
    except SystemExit:
        raise
    except BaseException as e:
        # Without this frame: the traceback starts in main.py.
        traceback.print_exception(type(e), e, e.__traceback__.tb_next)
        sys.exit(1)


_spmdrl_run()
"""


@dataclass
class PythonLimits:
    """Limits of one run; 0 means unlimited for the resource limits."""

    timeout_s: float = 10.0  # wall time, from the start of the interpreter
    cpu_s: int = 10  # RLIMIT_CPU, seconds of CPU time (per process)
    memory_mb: int = 1024  # RLIMIT_AS, MiB of address space (per process), not resident memory
    file_size_mb: int = 16  # RLIMIT_FSIZE, MiB: the largest file it may write, stdout and stderr too
    max_output_chars: int = 4096  # kept of stdout (its start) and of stderr (its end)
    tmp_root: str = ""  # where its working directory is made; "": the system's temporary directory
    env: dict[str, str] = field(default_factory=dict)  # set in its environment, over the defaults

    def check(self) -> None:
        if not self.timeout_s > 0 or math.isinf(self.timeout_s):
            raise ValueError(f"timeout_s must be a finite number > 0, got {self.timeout_s}")
        for key in ("cpu_s", "memory_mb", "file_size_mb"):
            if getattr(self, key) < 0:
                raise ValueError(f"{key} must be >= 0 (0: unlimited), got {getattr(self, key)}")
        if self.max_output_chars < 1:
            raise ValueError(f"max_output_chars must be >= 1, got {self.max_output_chars}")


@dataclass
class PythonRun:
    stdout: str  # its first max_output_chars characters
    stderr: str  # its last max_output_chars characters
    returncode: int  # negative: killed by that signal
    timed_out: bool  # ran past timeout_s and was killed
    wall_s: float
    limits: PythonLimits
    stdout_dropped: int = 0  # bytes not kept
    stderr_dropped: int = 0

    def text(self) -> str:
        """What the model reads: the output, then what went wrong, if anything."""
        limits = self.limits
        parts = []
        if self.stdout:
            parts.append(
                self.stdout
                + (f"\n[... {self.stdout_dropped} more bytes of output]" if self.stdout_dropped else "")
            )
        if self.stderr:
            parts.append(
                (f"[... {self.stderr_dropped} earlier bytes of stderr]\n" if self.stderr_dropped else "")
                + self.stderr
            )
        if self.timed_out:
            parts.append(f"Error: the code ran past its time limit of {limits.timeout_s:g} s and was killed.")
        elif self.returncode == -signal.SIGXCPU:
            parts.append(f"Error: the code used more than {limits.cpu_s} s of CPU time and was killed.")
        elif self.returncode < 0:
            parts.append(f"Error: the process was {exit_status(self.returncode)}.")
        elif self.returncode > 0 and not self.stderr:
            parts.append(f"(exit code {self.returncode})")
        if limits.memory_mb and "MemoryError" in self.stderr:
            parts.append(f"(the memory limit is {limits.memory_mb} MiB)")
        return "\n".join(p.rstrip("\n") for p in parts) if parts else "(no output)"


def run_python(code: str, limits: PythonLimits | None = None) -> PythonRun:
    """Run ``code`` as described in the module docstring; never raises for anything the code does."""
    limits = limits or PythonLimits()
    limits.check()
    workdir = tempfile.mkdtemp(prefix="spmdrl-python-", dir=limits.tmp_root or None)
    try:
        with open(os.path.join(workdir, "main.py"), "w", encoding="utf-8") as f:
            f.write(code)
        # Unnamed (unlinked) files: the code cannot see them in its directory.
        with tempfile.TemporaryFile(dir=workdir) as out, tempfile.TemporaryFile(dir=workdir) as err:
            start = time.monotonic()
            proc = subprocess.Popen(
                [sys.executable, "-u", "-c", _RUNNER]
                + [str(v) for v in (limits.memory_mb, limits.cpu_s, limits.file_size_mb, os.getpid())],
                cwd=workdir,
                env=_child_env(workdir, limits),
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=err,
                start_new_session=True,
            )
            with _LIVE_LOCK:
                _LIVE.add(proc)
            try:
                timed_out = not _wait_exit(proc.pid, limits.timeout_s)
            finally:
                _kill_group(proc)
                with _LIVE_LOCK:
                    _LIVE.discard(proc)
            wall_s = time.monotonic() - start
            stdout, stdout_dropped = _read(out, limits.max_output_chars, head=True)
            stderr, stderr_dropped = _read(err, limits.max_output_chars, head=False)
    finally:
        _remove_tree(workdir)
    return PythonRun(
        stdout=stdout,
        stderr=stderr,
        returncode=proc.returncode if proc.returncode is not None else -signal.SIGKILL,
        timed_out=timed_out,
        wall_s=wall_s,
        limits=limits,
        stdout_dropped=stdout_dropped,
        stderr_dropped=stderr_dropped,
    )


def _child_env(workdir: str, limits: PythonLimits) -> dict[str, str]:
    env = {k: os.environ[k] for k in _KEPT_ENV if k in os.environ}
    env.update(
        HOME=workdir,
        TMPDIR=workdir,
        PYTHONIOENCODING="utf-8",
        PYTHONDONTWRITEBYTECODE="1",
        PYTHONNOUSERSITE="1",
        CUDA_VISIBLE_DEVICES="",
        MPLBACKEND="Agg",
    )
    # One thread per pool: fast enough for tool-sized work, and OpenBLAS reserves address space per
    # thread, which on a many-core node alone would exceed the memory limit.
    env.update({k: "1" for k in THREAD_ENV})
    env.update(limits.env)
    return env


def _wait_exit(pid: int, timeout_s: float) -> bool:
    """Wait up to ``timeout_s`` for ``pid`` to exit, without reaping it: until it is reaped its pid
    (the id of its process group) cannot be reused, so the killpg that follows cannot hit a stranger."""
    try:
        fd = os.pidfd_open(pid)
    except (AttributeError, OSError):
        fd = -1
    if fd >= 0:
        try:
            poller = select.poll()  # not select(): the trainer's fds may number past FD_SETSIZE
            poller.register(fd, select.POLLIN)
            return bool(poller.poll(math.ceil(timeout_s * 1000)))
        finally:
            os.close(fd)
    deadline = time.monotonic() + timeout_s
    while os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is None:
        if time.monotonic() >= deadline:
            return False
        time.sleep(_POLL_S)
    return True


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    """SIGKILL the run's process group (the code's leftovers too), then reap the child."""
    if proc.returncode is None:  # not reaped: its pid still names its group
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=_REAP_WAIT_S)


def _read(f: IO[bytes], max_chars: int, *, head: bool) -> tuple[str, int]:
    """(The first or last ``max_chars`` characters of ``f``, the number of bytes left out)."""
    size = os.fstat(f.fileno()).st_size
    budget = 4 * max_chars  # UTF-8: at most 4 bytes a character
    f.seek(0 if head else max(0, size - budget))
    data = f.read(budget)
    text = data.decode("utf-8", errors="replace")
    kept = text[:max_chars] if head else text[-max_chars:]
    if len(data) == size and len(kept) == len(text):
        return kept, 0
    return kept, max(0, size - len(kept.encode("utf-8", errors="replace")))


def _remove_tree(path: str) -> None:
    try:
        shutil.rmtree(path)
    except OSError:
        # The code may have taken its own permissions away (chmod 000 on a directory): give them back,
        # without following symlinks out of the directory, and try again.
        with contextlib.suppress(OSError):
            os.chmod(path, 0o700)
        for root, dirs, files in os.walk(path):  # top-down: a directory is fixed before it is entered
            for name in dirs + files:
                p = os.path.join(root, name)
                with contextlib.suppress(OSError):
                    if not stat.S_ISLNK(os.lstat(p).st_mode):
                        os.chmod(p, 0o700)
        shutil.rmtree(path, ignore_errors=True)


# Runs in flight, killed if the trainer exits while they run (an exception, sys.exit): their own
# sessions would otherwise outlive it.
_LIVE: set[subprocess.Popen[bytes]] = set()
_LIVE_LOCK = threading.Lock()


@atexit.register
def _kill_live() -> None:
    with _LIVE_LOCK:
        for proc in list(_LIVE):
            if proc.returncode is None:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(proc.pid, signal.SIGKILL)
