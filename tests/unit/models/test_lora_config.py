"""model.lora's values (spmdrl.config) and target names (spmdrl.preflight) are refused at load, before any
process group or model, each naming the key and the fix; rank 0 is LoRA off."""

from __future__ import annotations

import pytest

from spmdrl.config_loader import load_config
from spmdrl.errors import ConfigError
from spmdrl.preflight import check_inputs


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        (["model.lora.rank=-1"], r"model.lora.rank must be >= 0 \(0: LoRA off\)"),
        (["model.lora.rank=8", "model.lora.alpha=0"], "model.lora.alpha must be > 0"),
        (["model.lora.rank=8", "model.lora.dropout=1.0"], r"model.lora.dropout must be in \[0, 1\)"),
        (["model.lora.rank=8", "model.lora.target_modules=[]"], "model.lora.target_modules is empty"),
    ],
)
def test_bad_lora_values_are_refused_at_load(overrides: list[str], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        load_config(overrides)


def test_rank_zero_is_off_and_ignores_the_other_values() -> None:
    cfg = load_config(["model.lora.alpha=-1"])
    assert not cfg.model.lora.enabled


def test_an_unknown_target_module_is_refused_before_any_model_listing_the_names() -> None:
    cfg = load_config(["model.lora.rank=8", "model.lora.target_modules=[q_proj,qkv]"])
    with pytest.raises(ConfigError, match=r"\['qkv'\] name no linear module.*'q_proj', 'k_proj'"):
        check_inputs(cfg)


def test_the_lora_recipe_loads_with_adapters_on_and_a_full_warm_start() -> None:
    cfg = load_config(["recipe=grpo_lora_tiny"])
    assert cfg.model.lora.enabled and cfg.model.lora.scale == 2.0
    assert cfg.warmstart.enabled and not cfg.warmstart.lora
    assert any("lora" in line for line in check_inputs(cfg))
