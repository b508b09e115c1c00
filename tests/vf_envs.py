"""The verifiers test environments (tests/envs/) and the paths a test's subprocess imports them by.

verifiers 0.4 is the installed one (the ``envs`` extra); the 0.3.x API the legacy environment needs comes
from verifiers 0.3.1 installed beside it (torchrun_scripts/setup_cpu.sh: ``.venv/verifiers-legacy``), first
on the subprocess's PYTHONPATH. The environments are imported from their directories (their pyproject.toml
installs them the same way, ``pip install -e tests/envs/<name>``).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from spmdrl.testing.small_runs import cache_env

ENVS_DIR = Path(__file__).resolve().parent / "envs"
REPO = ENVS_DIR.parent.parent
LEGACY_ENV = "vf_tiny_legacy"
V1_ENV = "vf_tiny_v1"


def legacy_dir() -> Path:
    """Where verifiers 0.3.1 sits beside 0.4 (setup_cpu.sh installs it); skips the test where it is not."""
    path = Path(sys.prefix) / "verifiers-legacy"
    if not (path / "verifiers" / "legacy").is_dir():
        pytest.skip(
            f"verifiers 0.3.1 (its legacy API) is not installed in {path}: run torchrun_scripts/setup_cpu.sh"
        )
    return path


def pythonpath(*env_packages: str, legacy: bool = False) -> str:
    """PYTHONPATH for a subprocess: the legacy verifiers first (``legacy``), the test environments, this
    checkout, and what was there."""
    parts = [str(legacy_dir())] if legacy else []
    parts += [str(ENVS_DIR / p) for p in env_packages] + [str(REPO)]
    if os.environ.get("PYTHONPATH"):
        parts.append(os.environ["PYTHONPATH"])
    return os.pathsep.join(parts)


def job_env(*env_packages: str, legacy: bool = False) -> dict[str, str]:
    """The environment of a test's torchrun job on the test environments: their PYTHONPATH (pythonpath) and
    the tests' model cache (spmdrl.testing.small_runs.cache_env)."""
    return {"PYTHONPATH": pythonpath(*env_packages, legacy=legacy), **cache_env()}
