"""A non-editable install finds its configs and recipes from any working directory."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow


def test_non_editable_install_runs_from_elsewhere(tmp_path: Path) -> None:
    target = tmp_path / "site"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "--target",
            str(target),
            str(REPO),
        ],
        check=True,
        cwd=tmp_path,
        capture_output=True,
    )
    probe = (
        "import spmdrl, spmdrl.configs, spmdrl.recipes.grpo, spmdrl.recipes.ppo, spmdrl.recipes.sft;"
        "from spmdrl.config_loader import load_config, available_recipes;"
        "print(spmdrl.__file__); print(spmdrl.configs.__file__);"
        "print(load_config(['recipe=sft_tiny', 'optim.lr=3e-4']).optim.lr); print(available_recipes())"
    )
    env = {**os.environ, "PYTHONPATH": str(target)}
    out = subprocess.run(
        [sys.executable, "-c", probe], cwd=tmp_path, env=env, capture_output=True, text=True, check=True
    ).stdout.splitlines()
    assert out[0].startswith(str(target)) and out[1].startswith(str(target)), out
    assert out[2] == "0.0003"
    assert "grpo_tiny" in out[3] and "sft_tiny" in out[3]
