"""spmdrl/config_exit.py: a config error exits 2 with its message on stderr, or, under torchrun, in the
worker's error file, which torch's own launcher code reads back as the failure's root cause.

The launcher's side is torch.distributed.elastic's ProcessFailure / ChildFailedError, the classes torchrun
builds its closing summary with; the integration test (tests/integration/test_config_errors.py) runs a real
torchrun."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

from spmdrl.config_exit import EXIT_CONFIG_ERROR

MESSAGE = "unknown config key 'trainer.totl_steps'. Did you mean 'trainer.total_steps'?"


def _exit_with_config_error(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    code = f"from spmdrl.config_exit import exit_config_error; exit_config_error({MESSAGE!r})"
    clean = {k: v for k, v in os.environ.items() if k not in ("RANK", "TORCHELASTIC_ERROR_FILE")}
    return subprocess.run(
        [sys.executable, "-c", code], env={**clean, **env}, capture_output=True, text=True, timeout=60
    )


def test_without_torchrun_the_message_goes_to_stderr_once() -> None:
    res = _exit_with_config_error({})
    assert res.returncode == EXIT_CONFIG_ERROR == 2
    assert res.stderr == f"spmdrl: config error: {MESSAGE}\n" and res.stdout == ""


def test_under_torchrun_the_message_is_the_error_files_root_cause(tmp_path: Path) -> None:
    error_file = tmp_path / "error.json"
    res = _exit_with_config_error({"RANK": "0", "TORCHELASTIC_ERROR_FILE": str(error_file)})
    assert res.returncode == 2
    assert res.stderr == ""  # torchrun's summary prints it, last: not twice
    assert json.loads(error_file.read_text())["message"]["message"] == f"spmdrl: config error: {MESSAGE}"

    failure = ProcessFailure(local_rank=0, pid=1234, exitcode=2, error_file=str(error_file))
    summary = ChildFailedError("spmdrl.train", {0: failure}).format_msg()
    lines = summary.strip().splitlines()
    # The summary's last line is its border; the one before it, the root cause's traceback: our message.
    assert lines[-2] == f"  traceback : spmdrl: config error: {MESSAGE}"
    assert "pytorch.org" not in summary


def test_an_unwritable_error_file_falls_back_to_stderr(tmp_path: Path) -> None:
    res = _exit_with_config_error({"RANK": "0", "TORCHELASTIC_ERROR_FILE": str(tmp_path / "no" / "dir.json")})
    assert res.returncode == 2 and res.stderr == f"spmdrl: config error: {MESSAGE}\n"
