"""Test jobs and test ranks that start from a process which has already imported torch, transformers,
the recipes and vLLM.

A 2-rank ``torchrun -m spmdrl.train`` job on 2 CPU cores spent ~12 s before its recipe ran (torchrun's own
import of torch, ~3 s, then each rank's import of torch, transformers and the recipe stack, ~8 s with both
cores busy) and another 4-7 s importing vLLM; the suite starts dozens of jobs and spawned groups. Here a
fork server (``multiprocessing``'s forkserver, started once per test session) imports that stack once
(spmdrl.testing.prefork_imports) and every job's ranks are forked from it: new processes, copies of a parent
that has done nothing but import, each running ``spmdrl.train.main`` under the environment torchrun would
give it (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``/``MASTER_PORT``,
``TORCHELASTIC_RUN_ID``, ``TORCHELASTIC_RESTART_COUNT=0``) and the job's own variables. Isolation is the
fork's: one job's state never reaches another's, and a rank's failure is that job's, with the rank's own
traceback in its output. spmdrl.testing.spawn.run_distributed forks its ranks from the same server.

What it does not do, and the tests that need it use real torchrun (``spmdrl.testing.launch.torchrun(...,
launcher="torchrun")``): torchrun's restarts (--max-restarts), its error files and closing summary (how a
config error is reported once and last), several nodes. Like torchrun it ends a job's other ranks once one
fails (SIGTERM, then SIGKILL after a grace period) and exits 1 if any rank failed.

The fork server starts with the session's environment plus ``OMP_NUM_THREADS=1`` (what every test job
gets). A job whose environment sets a variable that is read at import differently from that
(``_IMPORT_TIME_ENV``, ``_IMPORT_TIME_PREFIXES``: OpenMP, oneDNN, the CPU kind, the hub, vLLM's) cannot be
forked from it and starts fresh interpreters instead, as does everything when ``SPMDRL_TEST_LAUNCHER=torchrun``.
"""

from __future__ import annotations

import atexit
import contextlib
import importlib
import multiprocessing
import multiprocessing.connection
import os
import signal
import subprocess
import sys
import threading
import time
import traceback
import uuid
from pathlib import Path
from typing import Any

# Imported by the fork server before it forks any process (spmdrl.testing.prefork_imports says what).
PRELOAD = ["spmdrl.testing.prefork_imports"]

# Variables read when torch, OpenMP or oneDNN load (or by spmdrl.testing.cpu_kind at start): a job that sets one
# differently from the fork server's environment cannot be forked from it.
_IMPORT_TIME_ENV = (
    "OMP_NUM_THREADS",
    "MKL_NUM_THREADS",
    "ATEN_CPU_CAPABILITY",
    "ONEDNN_MAX_CPU_ISA",
    "SPMDRL_CPU_KIND",
    "PYTHONPATH",
    "LD_PRELOAD",
)
# Families of variables read at import: vLLM's (its logging, for one, is configured then), the hub's
# (huggingface_hub's constants), torch's, transformers', the thread and kernel libraries'.
_IMPORT_TIME_PREFIXES = (
    "VLLM_",
    "HF_",
    "HUGGINGFACE_",
    "TRANSFORMERS_",
    "TORCH_",
    "PYTORCH_",
    "OMP_",
    "KMP_",
    "MKL_",
    "ONEDNN_",
    "DNNL_",
)
_SERVER_ENV = {"OMP_NUM_THREADS": "1"}
_GRACE_S = 10.0

_lock = threading.Lock()
_context: multiprocessing.context.ForkServerContext | None = None
_server_env: dict[str, str] = {}  # the environment the fork server started with
_server_env_after: dict[str, str] = {}  # ... and what it was once the preload had imported everything
_ENV_FILE = "SPMDRL_PREFORK_ENV_FILE"  # where spmdrl.testing.prefork_imports writes the latter


class _InheritedFd:
    """This process's file descriptor ``fd``, handed to a process the fork server forks (pickled with the
    process's arguments; multiprocessing passes the descriptor over the server's socket)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def __reduce__(self) -> tuple:
        from multiprocessing import reduction

        return (_detach, (reduction.DupFd(self.fd),))


def _detach(dup: Any) -> int:
    return dup.detach()


def caller_streams() -> tuple[Any, Any]:
    """This process's stdout and stderr (file descriptors 1 and 2, wherever they point now: a test's
    captured output), for :func:`attach_streams` in a forked process. The fork server's own are where the
    process that started it printed when it did, which is not where a later test's output belongs."""
    return _InheritedFd(1), _InheritedFd(2)


def attach_streams(stdout: int, stderr: int) -> None:
    """In a forked process: print to the descriptors :func:`caller_streams` handed over."""
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(stdout, 1)
    os.dup2(stderr, 2)
    os.close(stdout)
    os.close(stderr)


# The modules a forked job may run (``-m <module>``): each has ``main(argv)`` and imports nothing the fork
# server has not (the latency tail's launcher runs spmdrl.train's main with a wrapped Rollout).
FORKABLE_MODULES = ("spmdrl.train", "spmdrl.testing.latency_tail")


def can_run(argv: list[str], env: dict[str, str]) -> bool:
    """Whether a job ``torchrun <argv>`` in the environment ``env`` (the whole of it) can be forked:
    ``-m <one of FORKABLE_MODULES>``, and every import-time variable as the fork server has it."""
    if len(argv) < 2 or argv[0] != "-m" or argv[1] not in FORKABLE_MODULES:
        return False
    return compatible(env)


def compatible(env: dict[str, str]) -> bool:
    """Whether a process with the environment ``env`` (the whole of it) can be forked from the fork
    server: Linux, and every variable read at import as the fork server had it."""
    if sys.platform != "linux":
        return False
    # What vLLM's import sees: the variables spmdrl.rollout.vllm_process sets before it, under each's own.
    vllm_import = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_LOGGING_LEVEL": "WARNING"}
    before = {**vllm_import, **(_server_env or {**os.environ, **_SERVER_ENV})}
    # The imports set some themselves (vLLM: PYTORCH_NVML_BASED_CUDA_CHECK=1); a job that has them as the
    # imports left them (the test process, once it imported vLLM too) would import the same way.
    after = {**vllm_import, **_server_env_after} if _server_env_after else before
    job = {**vllm_import, **env}
    keys = {*_IMPORT_TIME_ENV, *(k for k in {*job, *before, *after} if k.startswith(_IMPORT_TIME_PREFIXES))}
    return all(job.get(k) in (before.get(k), after.get(k)) for k in keys)


def context() -> multiprocessing.context.ForkServerContext:
    """The session's fork server, started on first use with the preloaded modules."""
    global _context, _server_env, _server_env_after
    with _lock:
        if _context is None:
            import json
            import tempfile

            ctx = multiprocessing.get_context("forkserver")
            ctx.set_forkserver_preload(PRELOAD)
            fd, env_file = tempfile.mkstemp(prefix="spmdrl-prefork-env-", suffix=".json")
            os.close(fd)
            os.unlink(env_file)  # written whole by the fork server once its imports are done
            from multiprocessing import forkserver
            from unittest import mock

            # The server inherits this process's environment when it starts; this one's is put back after.
            with mock.patch.dict(os.environ, {**_SERVER_ENV, _ENV_FILE: env_file}):
                _server_env = {k: v for k, v in os.environ.items() if k != _ENV_FILE}
                forkserver.ensure_running()
            deadline = time.monotonic() + 600
            pid = forkserver._forkserver._forkserver_pid
            while not os.path.exists(env_file):
                if pid is not None and os.waitpid(pid, os.WNOHANG)[0] == pid:
                    raise RuntimeError("the tests' fork server died during its imports (its error is above)")
                if time.monotonic() > deadline:
                    raise RuntimeError("the tests' fork server did not finish its imports in 600 s")
                time.sleep(0.05)
            with open(env_file) as f:
                _server_env_after = json.load(f)
            os.unlink(env_file)
            _context = ctx
        return _context


def run_job(
    argv: list[str], *, nproc: int, cwd: Path | None, env: dict[str, str], port: int, timeout_s: float
) -> tuple[int, str, bool]:
    """Runs ``torchrun --nproc_per_node=nproc <argv>`` as forked ranks in the environment ``env`` (the
    whole of it); returns (exit code, what the ranks printed, whether it timed out). The exit code is
    torchrun's: 0, or 1 if any rank failed. The ranks write to one file, appending, so their lines
    interleave as they do on torchrun's shared stdout."""
    import tempfile

    ctx = context()
    run_id = uuid.uuid4().hex[:12]
    fd, name = tempfile.mkstemp(prefix=f"spmdrl-prefork-{run_id}-", suffix=".log")
    os.close(fd)
    log = Path(name)
    base = {
        **env,
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "WORLD_SIZE": str(nproc),
        "LOCAL_WORLD_SIZE": str(nproc),
        "GROUP_RANK": "0",
        "TORCHELASTIC_RUN_ID": f"prefork-{run_id}",
        "TORCHELASTIC_RESTART_COUNT": "0",
        "TORCHELASTIC_MAX_RESTARTS": "0",
    }
    procs = []
    for rank in range(nproc):
        rank_env = {**base, "RANK": str(rank), "LOCAL_RANK": str(rank)}
        p = ctx.Process(
            target=_rank_main,
            args=(argv[2:], rank_env, str(cwd or os.getcwd()), name, None, argv[1]),
            name=f"spmdrl-rank{rank}",
        )
        p.start()
        procs.append(p)
    timed_out = False
    try:
        timed_out = not _wait(procs, timeout_s)
    finally:
        for p in procs:  # a timeout, an interrupt: every rank's session goes, its children included
            if p.exitcode is None:
                _kill(p, signal.SIGKILL)
            p.join()
    codes = [p.exitcode for p in procs]
    output = log.read_text(errors="replace")
    log.unlink(missing_ok=True)
    return (0 if all(c == 0 for c in codes) else 1), output, timed_out


def _wait(procs: list, timeout_s: float) -> bool:
    """Waits for every rank; once one fails, the others get SIGTERM and after a grace SIGKILL (torchrun's
    way). False on a timeout."""
    deadline = time.monotonic() + timeout_s
    failed_at: float | None = None
    while any(p.exitcode is None for p in procs):
        now = time.monotonic()
        if now > deadline:
            return False
        if failed_at is None and any(p.exitcode not in (None, 0) for p in procs):
            failed_at = now
            for p in procs:
                if p.exitcode is None:
                    _kill(p, signal.SIGTERM)
        elif failed_at is not None and now - failed_at > _GRACE_S:
            for p in procs:
                if p.exitcode is None:
                    _kill(p, signal.SIGKILL)
        multiprocessing.connection.wait([p.sentinel for p in procs if p.exitcode is None], timeout=0.2)
    return True


def _kill(p: multiprocessing.process.BaseProcess, sig: int) -> None:
    """The rank's whole session (it is a session leader: _rank_main), so that its children go too."""
    try:
        os.killpg(p.pid, sig)
    except (ProcessLookupError, PermissionError):
        with contextlib.suppress(ProcessLookupError):
            os.kill(p.pid, sig)


def run_train(
    args: list[str], *, cwd: Path | None = None, env: dict[str, str] | None = None, timeout_s: float = 180.0
) -> subprocess.CompletedProcess[str]:
    """``python -m spmdrl.train <args>`` as one process forked from the fork server, stdout and stderr
    apart, as ``subprocess.run(..., capture_output=True, text=True)`` returns them: for the tests of the
    command line's single-process modes (``--check``, ``--cfg job``). ``env``: variables on top of this
    process's environment. A test of what is imported (or not) before the answer needs a fresh
    interpreter instead: here everything is."""
    import tempfile

    ctx = context()
    full_env = {**os.environ, **_SERVER_ENV, **(env or {})}
    with tempfile.TemporaryDirectory(prefix="spmdrl-prefork-") as tmp:
        out, err = Path(tmp, "stdout"), Path(tmp, "stderr")
        out.touch()
        err.touch()
        p = ctx.Process(target=_rank_main, args=(args, full_env, str(cwd or os.getcwd()), str(out), str(err)))
        p.start()
        p.join(timeout_s)
        if p.exitcode is None:
            _kill(p, signal.SIGKILL)
            p.join()
            raise subprocess.TimeoutExpired(["spmdrl.train", *args], timeout_s, output=out.read_text())
        _kill(p, signal.SIGKILL)  # what the process left running in its session
        return subprocess.CompletedProcess(
            ["python", "-m", "spmdrl.train", *args], p.exitcode, out.read_text(), err.read_text()
        )


def _rank_main(
    args: list[str],
    env: dict[str, str],
    cwd: str,
    out: str,
    err: str | None = None,
    module: str = "spmdrl.train",
) -> None:
    """One process forked from the fork server: the given environment (a rank's, as torchrun gives it),
    working directory, stdout into ``out`` and stderr into ``err`` (or ``out`` too), appending; then
    ``python -m <module> <args>`` (spmdrl.train, or another of FORKABLE_MODULES)."""
    os.setsid()
    for fd_no, path in ((1, out), (2, err or out)):
        fd = os.open(path, os.O_WRONLY | os.O_APPEND)
        os.dup2(fd, fd_no)
        os.close(fd)
    sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115 - the process's own streams
    sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    entry = importlib.import_module(module)

    sys.argv = [entry.__file__, *args]
    code = 0
    try:
        entry.main(args)
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:  # noqa: BLE001 - as an uncaught exception ends a script: its traceback, exit 1
        traceback.print_exc()
        code = 1
    # What the interpreter's exit would do (a forked process ends by os._exit): the exit handlers the
    # job registered, then the streams.
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
