"""Run a real ``torchrun`` job from a test and capture what it printed."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from spmdrl.testing import prefork
from spmdrl.testing.spawn import free_port


@dataclass(frozen=True)
class JobResult:
    returncode: int
    output: str
    wall_s: float


def torchrun(
    args: list[str],
    *,
    nproc: int = 2,
    cwd: Path | None = None,
    timeout_s: float = 600.0,
    env: dict[str, str] | None = None,
    launcher: str = "auto",
) -> JobResult:
    """``python -m torch.distributed.run --nproc_per_node=nproc <args>``; stdout and stderr together.

    ``launcher="auto"`` forks an ``-m spmdrl.train`` job's ranks from the session's fork server, whose
    imports are done (spmdrl.testing.prefork: ~10 s less per job on 2 cores), unless
    ``SPMDRL_TEST_LAUNCHER=torchrun`` is set or the job's environment changes what is read at import;
    ``launcher="torchrun"`` always runs real torchrun, for the tests of what torchrun itself does (its
    restarts, its closing summary of a failure).

    The job runs in a session of its own, and whatever ends the wait (its timeout, a test's timeout, a
    Ctrl-C) kills that whole session: torchrun's workers included, which killing torchrun alone would
    leave running, holding both cores through the tests after it.
    """
    if launcher not in ("auto", "torchrun"):
        raise ValueError(f"launcher={launcher!r}: auto or torchrun")
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    if (
        launcher == "auto"
        and os.environ.get("SPMDRL_TEST_LAUNCHER", "auto") != "torchrun"
        and prefork.can_run(args, full_env)
    ):
        t0 = time.monotonic()
        code, output, timed_out = prefork.run_job(
            args, nproc=nproc, cwd=cwd, env=full_env, port=free_port(), timeout_s=timeout_s
        )
        if timed_out:
            raise subprocess.TimeoutExpired(["torchrun", *args], timeout_s, output=output)
        return JobResult(code, output, time.monotonic() - t0)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc_per_node={nproc}",
        "--master_addr=127.0.0.1",
        f"--master_port={free_port()}",
        *args,
    ]
    t0 = time.monotonic()
    with subprocess.Popen(
        cmd,
        cwd=cwd,
        env=full_env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    ) as proc:
        try:
            output, _ = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired as e:
            _kill_session(proc)
            output, _ = proc.communicate()
            raise subprocess.TimeoutExpired(cmd, timeout_s, output=output) from e
        finally:
            # Whatever ended the wait (an interrupt, a test's timeout), and a worker that outlived
            # torchrun: the session goes.
            _kill_session(proc)
    return JobResult(proc.returncode, output, time.monotonic() - t0)


def _kill_session(proc: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)


def offline_trackers_env() -> dict[str, str]:
    """The environment of a job that logs to wandb and MLflow without a server: wandb offline (its run
    under output_dir/wandb/), MLflow's file store under output_dir (no tracking URI), and the shared
    model cache, so the job does not rebuild the tiny model."""
    return {
        "SPMDRL_CACHE": os.environ.get("SPMDRL_CACHE", str(Path.home() / ".cache" / "spmdrl")),
        "WANDB_MODE": "offline",
        "WANDB_SILENT": "true",
        "MLFLOW_TRACKING_URI": "",
    }
