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
) -> JobResult:
    """``python -m torch.distributed.run --nproc_per_node=nproc <args>``; stdout and stderr together.

    The job runs in a session of its own, and whatever ends the wait (its timeout, a test's timeout, a
    Ctrl-C) kills that whole session: torchrun's workers included, which killing torchrun alone would
    leave running, holding both cores through the tests after it.
    """
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc_per_node={nproc}",
        "--master_addr=127.0.0.1",
        f"--master_port={free_port()}",
        *args,
    ]
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
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
