"""spmdrl/testing/prefork.py: test jobs forked from a fork server that has done the imports; what may be
forked from it, a job's exit code and output as torchrun gives them, a failed rank ending the job."""

from __future__ import annotations

import os
import time

import pytest

from spmdrl.testing import prefork
from spmdrl.testing.spawn import free_port


def _job_env(**extra: str) -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", **extra}


def test_what_is_read_at_import_decides_whether_a_job_is_forked(monkeypatch: pytest.MonkeyPatch) -> None:
    prefork.context()  # started, so that what its imports set is known
    assert prefork.compatible(_job_env())
    assert prefork.can_run(["-m", "spmdrl.train", "recipe=grpo_tiny"], _job_env())
    assert not prefork.can_run(["my_recipe.py", "recipe=grpo_tiny"], _job_env())  # a script: real torchrun
    # The latency tail's launcher runs spmdrl.train's main too; any other module: real torchrun.
    assert prefork.can_run(
        ["-m", "spmdrl.testing.latency_tail", "--prompts", "1", "--seconds", "2"], _job_env()
    )
    assert not prefork.can_run(["-m", "my.module", "recipe=grpo_tiny"], _job_env())
    for changed in ("OMP_NUM_THREADS", "ATEN_CPU_CAPABILITY", "HF_HUB_OFFLINE", "VLLM_LOGGING_LEVEL"):
        assert not prefork.compatible(_job_env(**{changed: "7"})), changed
    # A variable the fork server's imports set themselves (vLLM's sets PYTORCH_NVML_BASED_CUDA_CHECK=1):
    # a job that has it as they left it (a test process that imported vLLM too) is forked; one that has it
    # otherwise is not.
    monkeypatch.setattr(
        prefork, "_server_env_after", {**prefork._server_env_after, "PYTORCH_SET_BY_IMPORT": "1"}
    )
    assert prefork.compatible(_job_env(PYTORCH_SET_BY_IMPORT="1"))
    assert not prefork.compatible(_job_env(PYTORCH_SET_BY_IMPORT="0"))


def test_a_job_prints_as_torchrun_would_and_exits_0() -> None:
    code, output, timed_out = prefork.run_job(
        ["-m", "spmdrl.train", "--help"], nproc=2, cwd=None, env=_job_env(), port=free_port(), timeout_s=60
    )
    assert (code, timed_out) == (0, False)
    assert output.count("usage: torchrun --nproc_per_node=N -m spmdrl.train") == 2  # both ranks, one stream


def test_a_failed_rank_ends_the_job_with_exit_1() -> None:
    """Rank 0 refuses the config and exits 2; rank 1 would wait 5 s before reporting the same
    (spmdrl.config_exit) but is ended first, as torchrun ends it, and the job exits 1 as torchrun does."""
    t0 = time.monotonic()
    code, output, timed_out = prefork.run_job(
        ["-m", "spmdrl.train", "recipe=grpo_tiny", "trainer.totl_steps=3"],
        nproc=2,
        cwd=None,
        env=_job_env(),
        port=free_port(),
        timeout_s=60,
    )
    assert (code, timed_out) == (1, False)
    assert output.count("unknown config key 'trainer.totl_steps'") == 1, output
    assert time.monotonic() - t0 < 5, "rank 1 should have been ended, not waited for"


def test_run_train_returns_what_a_process_would() -> None:
    res = prefork.run_train(["--check", "recipe=sft_tiny", "trainer.micro_batch_size=1.5"])
    assert res.returncode == 2 and res.stdout == "" and "trainer.micro_batch_size" in res.stderr
