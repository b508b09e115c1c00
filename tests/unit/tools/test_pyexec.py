"""The python runner (spmdrl/tools/pyexec.py) with real child processes: output, exit codes, timeouts,
leftover processes, memory and file-size limits, a small environment."""

from __future__ import annotations

import os
import textwrap
import time
from pathlib import Path

import pytest

from spmdrl.tools.builtin import PythonTool
from spmdrl.tools.pyexec import PythonLimits, run_python

# ---------------------------------------------------------------------------------------- python tool


def test_python_output_errors_and_exit_codes() -> None:
    r = run_python("import sys\nprint('out')\nprint('err', file=sys.stderr)")
    assert (r.stdout, r.stderr, r.returncode, r.timed_out) == ("out\n", "err\n", 0, False)
    assert r.text() == "out\nerr"
    r = run_python("x = 1\n1 / x0")
    assert r.returncode == 1
    assert r.text().startswith('Traceback (most recent call last):\n  File "main.py", line 2, in <module>\n')
    assert "NameError: name 'x0' is not defined" in r.text()
    assert "spmdrl" not in r.text()  # the runner's own frame is not shown
    assert 'File "main.py", line 1' in run_python("def f(:\n  pass").text()
    assert run_python("import sys; sys.exit(3)").text() == "(exit code 3)"
    assert run_python("x = 1").text() == "(no output)"
    assert "killed by SIGSEGV" in run_python("import os, signal; os.kill(os.getpid(), signal.SIGSEGV)").text()
    assert run_python("if __name__ == '__main__': print(__file__)").text() == "main.py"
    tool = PythonTool({"timeout_s": 5})
    result = tool.execute("i", {"code": "print(6 * 7)"})
    assert result.text == "42" and result.metrics["timed_out"] == 0.0 and result.metrics["failed"] == 0.0


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie is dead, just not reaped yet
    except FileNotFoundError:
        return False


def _wait_dead(pid: int, within_s: float = 3.0) -> bool:
    deadline = time.monotonic() + within_s
    while _alive(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def test_python_timeout_kills_grandchildren(tmp_path: Path) -> None:
    pid_file = tmp_path / "pid"
    code = textwrap.dedent(
        f"""
        import subprocess, time
        child = subprocess.Popen(["sleep", "1000"])
        open({str(pid_file)!r}, "w").write(str(child.pid))
        print("started", flush=True)
        time.sleep(1000)
        """
    )
    start = time.monotonic()
    r = run_python(code, PythonLimits(timeout_s=0.7))
    assert time.monotonic() - start < 2.5
    assert (
        r.timed_out
        and r.text() == "started\nError: the code ran past its time limit of 0.7 s and was killed."
    )
    assert _wait_dead(int(pid_file.read_text()))


def test_python_leftover_background_process_is_killed(tmp_path: Path) -> None:
    pid_file = tmp_path / "pid"
    code = (
        f"import subprocess; open({str(pid_file)!r}, 'w').write(str(subprocess.Popen(['sleep', '1000']).pid))"
    )
    start = time.monotonic()
    r = run_python(code, PythonLimits(timeout_s=5))
    assert not r.timed_out and r.returncode == 0 and time.monotonic() - start < 2
    assert _wait_dead(int(pid_file.read_text()))


def test_python_memory_and_file_size_limits() -> None:
    r = run_python("x = bytearray(2 << 30)\nprint('allocated')", PythonLimits(memory_mb=256))
    assert "MemoryError" in r.stderr and "allocated" not in r.stdout
    assert r.text().endswith("(the memory limit is 256 MiB)")
    r = run_python("open('big', 'wb').write(b'x' * (2 << 20))", PythonLimits(file_size_mb=1))
    assert "File too large" in r.stderr and r.returncode == 1
    # numpy's import fits the default limit (thread pools of one)
    assert run_python("import numpy; print(numpy.ones(3).sum())").text() == "3.0"


def test_python_temp_dir_removed_and_environment_small(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = tmp_path / "root"
    root.mkdir()
    monkeypatch.setenv("SPMDRL_TEST_SECRET", "hunter2")
    code = textwrap.dedent(
        """
        import os
        print(os.getcwd())
        print(sorted(os.listdir(".")))
        os.makedirs("locked/inner")
        open("locked/inner/f", "w").write("x")
        os.chmod("locked/inner", 0)
        os.chmod("locked", 0)
        print(os.environ.get("SPMDRL_TEST_SECRET"), os.environ["CUDA_VISIBLE_DEVICES"] == "", os.environ["HOME"] == os.getcwd())
        """
    )
    r = run_python(code, PythonLimits(tmp_root=str(root)))
    cwd, listing, env = r.stdout.splitlines()
    assert Path(cwd).parent == root and listing == "['main.py']"
    assert env == "None True True"
    assert list(root.iterdir()) == []  # removed, chmod 000 directories included


def test_python_output_truncated() -> None:
    r = run_python(
        "import sys\nprint('a' * 10_000)\nprint('e' * 5000 + 'END', file=sys.stderr)",
        PythonLimits(max_output_chars=100),
    )
    assert r.stdout == "a" * 100 and r.stdout_dropped == 10_001 - 100
    assert r.stderr.endswith("END\n") and len(r.stderr) == 100
    assert r.text().startswith(
        "a" * 100 + "\n[... 9901 more bytes of output]\n[... 4904 earlier bytes of stderr]\n"
    )
    r = run_python("print('é' * 50)", PythonLimits(max_output_chars=10))
    assert r.stdout == "é" * 10 and r.stdout_dropped == 101 - 20


def test_environment_is_not_modified() -> None:
    before = dict(os.environ)
    run_python("print(1)")
    assert dict(os.environ) == before
