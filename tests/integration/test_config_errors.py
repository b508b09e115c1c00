"""A configuration or data error under a real torchrun with 2 ranks: its message is printed exactly once,
it is the end of the output (torchrun's closing summary shows it as the root cause, not a link to
PyTorch's docs), the failing worker's exit code is 2 and torchrun's is 1."""

from __future__ import annotations

from pathlib import Path

import pytest

from spmdrl.testing.launch import torchrun

pytestmark = pytest.mark.slow

TYPO = "spmdrl: config error: unknown config key 'trainer.totl_steps'. Did you mean 'trainer.total_steps'"


def _last_lines(output: str, n: int) -> str:
    return "\n".join(output.rstrip().splitlines()[-n:])


@pytest.mark.guarantee("errors:config")
def test_typo_is_reported_once_and_last(tmp_path: Path) -> None:
    res = torchrun(
        ["-m", "spmdrl.train", "recipe=grpo_tiny", "trainer.totl_steps=3"],
        nproc=2,
        cwd=tmp_path,
        timeout_s=300,
        launcher="torchrun",  # what torchrun's closing summary shows is the point
    )
    assert res.returncode == 1  # torchrun's, for any failed worker
    assert res.output.count("unknown config key 'trainer.totl_steps'") == 1, res.output
    # The summary's root cause: rank 0's exit code and its error file, the message as its traceback, and
    # nothing after it but the summary's border.
    tail = _last_lines(res.output, 4)
    assert "exitcode  : 2" in tail and f"traceback : {TYPO}" in tail, res.output
    assert res.output.rstrip().splitlines()[-1].strip("=") == ""
    assert "pytorch.org/docs" not in res.output
    # Ranks other than 0 wait and are stopped by torchrun: none of them reports.
    assert "rank 1 failed" not in res.output


@pytest.mark.guarantee("errors:config")
def test_missing_data_file_is_reported_once_and_last(tmp_path: Path) -> None:
    res = torchrun(
        ["-m", "spmdrl.train", "recipe=sft_tiny", "data.train_files=[nowhere.parquet]"],
        nproc=2,
        cwd=tmp_path,
        timeout_s=300,
        launcher="torchrun",  # what torchrun's closing summary shows is the point
    )
    assert res.returncode == 1
    message = "data file nowhere.parquet does not exist; check data.train_files"
    assert res.output.count(message) == 1, res.output
    assert message in _last_lines(res.output, 2)
    assert "exitcode  : 2" in _last_lines(res.output, 4)
