"""The sections' modules (spmdrl/config_section.py and each package's config.py): light to import, checked
on their own, composed into the one Config."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest

from spmdrl.config import Config, ConfigError, validate
from spmdrl.config_section import BUILT_IN_KEYS
from spmdrl.rollout.config import RolloutConfig
from spmdrl.trainer_config import TrainerConfig

SECTION_MODULES = (
    "spmdrl.config_section",
    "spmdrl.models.config",
    "spmdrl.data.config",
    "spmdrl.distributed.config",
    "spmdrl.logging.config",
    "spmdrl.rollout.config",
    "spmdrl.algos.config",
    "spmdrl.rewards.config",
    "spmdrl.trainer_config",
    "spmdrl.derived",
    "spmdrl.config",
)


def test_the_built_in_keys_are_the_configs_fields() -> None:
    """register_config_section refuses a built-in key by a list of its own (it sits below spmdrl.config)."""
    assert tuple(f.name for f in dataclasses.fields(Config)) == BUILT_IN_KEYS


def test_the_section_modules_import_no_torch() -> None:
    """The config loads (and `spmdrl.train --help` runs) before any framework is imported: a section's
    checks import the registries they read only when they run."""
    code = f"import sys\nfor m in {SECTION_MODULES!r}: __import__(m)\nprint(sorted({{'torch', 'vllm'}} & set(sys.modules)))"
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.strip() == "[]"


def test_a_section_checks_its_own_values_and_validate_runs_the_check() -> None:
    with pytest.raises(ConfigError, match=r"rollout\.n must be > 0, got 0"):
        RolloutConfig(n=0).check()
    with pytest.raises(ConfigError, match=r"rollout\.n must be > 0, got 0"):
        validate(Config(rollout=RolloutConfig(n=0)))
    TrainerConfig(micro_batch_tokens=4).check()  # the budget against the longest row is validate's check
    with pytest.raises(ConfigError, match=r"smaller than one sequence of the longest length, 192 tokens"):
        validate(Config(trainer=TrainerConfig(micro_batch_tokens=0, ppo_max_token_len_per_gpu=4)))
