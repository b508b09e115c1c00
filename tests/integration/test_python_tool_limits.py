"""The python tool's CPU-time limit, with a real child process that spins until it is killed."""

from __future__ import annotations

import time

import pytest

from spmdrl.tools.pyexec import PythonLimits, run_python


@pytest.mark.slow
def test_python_cpu_limit() -> None:
    start = time.monotonic()
    r = run_python("while True: pass", PythonLimits(cpu_s=1, timeout_s=30))
    assert not r.timed_out and time.monotonic() - start < 15  # 1 s of CPU: longer on a busy machine
    assert r.text() == "Error: the code used more than 1 s of CPU time and was killed."
