"""The command line (spmdrl/train.py): --help lists the recipes without importing torch, --cfg job prints
the composed config, config errors exit 2 naming the path."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from spmdrl.config_loader import available_recipes
from spmdrl.testing.prefork import run_train
from tests.unit.forks import FORK_YAML, fork_files

REPO = Path(__file__).resolve().parents[2]


pytestmark = pytest.mark.usefixtures("restore_sections")


# ---------------------------------------------------------------------------------------------- command line


def _train_cli(
    *args: str, cwd: Path = REPO, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "spmdrl.train", *args],
        cwd=cwd,
        env={**os.environ, **(env or {})},
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_help_lists_the_recipes_without_importing_torch() -> None:
    # Without a CPU kind to emulate (--cpu-kind): its start-up hook imports torch to patch its CPU queries.
    res = _train_cli("--help", env={"SPMDRL_CPU_KIND": ""})
    assert res.returncode == 0, res.stderr[-2000:]
    for name in available_recipes():
        assert f"\n  {name} " in res.stdout
    assert "GRPO on the built-in tiny Qwen2" in res.stdout  # the YAML's first comment line
    assert "recipe=path/to/x.yaml" in res.stdout and "--cfg job" in res.stdout and "key=value" in res.stdout
    imported = {line.rsplit("|", 1)[-1].strip() for line in res.stderr.splitlines() if "|" in line}
    assert "torch" not in imported and "vllm" not in imported


def test_cfg_job_prints_the_composed_config(tmp_path: Path) -> None:
    path = fork_files(tmp_path, FORK_YAML)
    # Forked from the tests' fork server (its imports done): what is printed, not what is imported.
    res = run_train([f"recipe={path}", "my_section.my_coef=0.4", "--cfg", "job"], cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-2000:]
    printed = yaml.safe_load(res.stdout)
    assert printed["optim"]["lr"] == 0.5 and printed["rollout"]["n"] == 8
    assert printed["my_section"] == {"my_coef": 0.4, "mode": "fast"}
    assert printed["entry"] == str(tmp_path / "my_recipe.py")


def test_config_errors_exit_2_naming_the_path(tmp_path: Path) -> None:
    path = fork_files(tmp_path, "defaults: [grpo_tiny, _self_]\nentry: missing.py\n")
    res = _train_cli(f"recipe={path}", cwd=tmp_path)
    assert res.returncode == 2
    assert f"spmdrl: config error: entry='{tmp_path / 'missing.py'}': no such file" in res.stderr
    res = _train_cli("--cfg", "hydra", cwd=tmp_path)
    assert res.returncode == 2 and "--cfg job" in res.stderr
