"""Run a real ``torchrun`` job from a test and capture what it printed."""

from __future__ import annotations

import os
import subprocess
import sys
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
    """``python -m torch.distributed.run --nproc_per_node=nproc <args>``; stdout and stderr together."""
    import time

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
    proc = subprocess.run(
        cmd,
        cwd=cwd,
        env=full_env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=timeout_s,
    )
    return JobResult(proc.returncode, proc.stdout, time.monotonic() - t0)
