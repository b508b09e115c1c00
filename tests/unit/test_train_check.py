"""``python -m spmdrl.train --check``: one process, no torchrun, no model; one line and exit 0 on a good
config, the error and exit 2 on a bad one; a misspelled key answers before torch is imported.

The checks that import the recipe (and so torch) run as a process forked from the tests' fork server,
whose imports are done (spmdrl.testing.prefork.run_train: ~0.5 s instead of ~9 s); the typo and --help
run in fresh interpreters, since what they promise is about what is imported."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

from spmdrl.rollout.vllm_version import installed_vllm
from spmdrl.testing.prefork import run_train

# python -m spmdrl.train, reporting on stderr at exit whether torch was imported.
_DRIVER = textwrap.dedent(
    """
    import runpy, sys
    try:
        runpy.run_module("spmdrl.train", run_name="__main__", alter_sys=True)
    finally:
        print("torch imported:", "torch" in sys.modules, file=sys.stderr)
    """
)


def _check(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", _DRIVER, "--check", *args],
        capture_output=True,
        text=True,
        timeout=180,
        cwd=cwd,
    )


def _forked_check(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return run_train(["--check", *args], cwd=cwd)


def _lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if not line.startswith("torch imported:")]


def test_a_good_config_exits_0_with_one_line() -> None:
    res = _forked_check("recipe=grpo_tiny", "trainer.total_steps=2")
    assert res.returncode == 0, res.stderr
    dist, version = installed_vllm() or ("?", "?")
    assert _lines(res.stdout) == [
        "spmdrl: config ok: recipe grpo_tiny (entry grpo); data (tiny:train, tiny:test); "
        "model.path=tiny (built in); reward.fn=auto on data_source 'spmdrl/tiny_arith'; "
        f"engine {dist} {version}; plan not checked: the world size is unknown (add --world-size N)"
    ]
    assert _lines(res.stderr) == []


def test_a_typo_exits_2_before_torch_is_imported() -> None:
    res = _check("recipe=grpo_tiny", "trainer.totl_steps=2")
    assert res.returncode == 2
    errors = _lines(res.stderr)
    assert len(errors) == 1, res.stderr
    assert errors[0].startswith(
        "spmdrl: config error: unknown config key 'trainer.totl_steps'. Did you mean 'trainer.total_steps'"
    )
    assert "torch imported: False" in res.stderr
    assert res.stdout == ""


def test_a_wrong_value_and_a_missing_data_file_exit_2(tmp_path: Path) -> None:
    res = _forked_check("recipe=sft_tiny", "trainer.micro_batch_size=1.5")
    assert res.returncode == 2 and "full_key: trainer.micro_batch_size" in res.stderr
    res = _forked_check("recipe=sft_tiny", "data.train_files=[nowhere.parquet]", cwd=tmp_path)
    assert res.returncode == 2
    assert "spmdrl: data error: data file nowhere.parquet does not exist" in res.stderr


def test_reward_signatures_are_checked(tmp_path: Path) -> None:
    (tmp_path / "rewards.py").write_text(
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n    return 1.0\n\n\n"
        "def wrong(solution, truth):\n    return 1.0\n"
    )
    res = _forked_check("recipe=grpo_tiny", f"reward.fn={tmp_path / 'rewards.py'}:compute_score")
    assert res.returncode == 0, res.stderr
    res = _forked_check("recipe=grpo_tiny", f"reward.fn={tmp_path / 'rewards.py'}:wrong")
    assert res.returncode == 2
    assert "wrong does not take the arguments of a reward function, neither spmdrl's" in res.stderr


def test_help_mentions_check() -> None:
    res = subprocess.run(
        [sys.executable, "-m", "spmdrl.train", "--help"], capture_output=True, text=True, timeout=60
    )
    assert res.returncode == 0 and "--check" in res.stdout and "2 a configuration or data error" in res.stdout
