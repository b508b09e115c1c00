"""Running one measured job (a torchrun of the recipe) from a benchmark, its output into a log file.

Imported by the scripts next to it (``python benchmarks/x.py`` puts this folder on ``sys.path``).
"""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path


def run_logged(cmd: list[str], log_path: Path, timeout: float) -> int | None:
    """Runs ``cmd`` into ``log_path``; its exit code, None past ``timeout``. On a timeout the whole
    process group goes: torchrun's ranks left running would slow down the runs after it."""
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            return proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            return None
