"""warmstart.entry: the recipe that runs the SFT warm-start is named by the config (spmdrl/config_loader.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from spmdrl.config_loader import load_config
from spmdrl.errors import ConfigError


def test_the_shipped_sft_recipe_runs_the_warm_start_by_default() -> None:
    cfg = load_config(["recipe=grpo_tiny"])
    assert cfg.warmstart.enabled and cfg.warmstart.entry == "sft"


def test_a_file_of_ones_own_resolves_next_to_the_recipe_yaml(tmp_path: Path) -> None:
    (tmp_path / "my_sft.py").write_text(
        "def main(cfg):\n    pass\n\n\ndef train_sft(run, cfg, stage=''):\n    return None\n"
    )
    (tmp_path / "my.yaml").write_text("defaults: [grpo_tiny, _self_]\nwarmstart:\n  entry: my_sft.py\n")
    cfg = load_config([f"recipe={tmp_path / 'my.yaml'}"])
    assert cfg.warmstart.entry == str((tmp_path / "my_sft.py").resolve())


def test_an_entry_without_train_sft_fails_at_load(tmp_path: Path) -> None:
    (tmp_path / "no_sft.py").write_text("def main(cfg):\n    pass\n")
    with pytest.raises(ConfigError, match=r"warmstart.entry=.*has no train_sft"):
        load_config(["recipe=grpo_tiny", f"warmstart.entry={tmp_path / 'no_sft.py'}"])
    with pytest.raises(ConfigError, match=r"^warmstart.entry=.*no such file"):
        load_config(["recipe=grpo_tiny", f"warmstart.entry={tmp_path / 'missing.py'}"])
