"""trainer.val_only's config rules (no processes): what the RL and SFT recipes need for it, the reward
model's refusal, trainer.total_epochs=0 pointing at it, and the warm-start export a validation-only run evaluates
from (never a warm-start run)."""

from __future__ import annotations

import dataclasses
import importlib
from pathlib import Path

import pytest

from spmdrl.config_loader import load_config
from spmdrl.errors import ConfigError
from spmdrl.loop import StartPlan
from spmdrl.rl.plan import plan_job
from spmdrl.supervised.warmstart import val_only_model


@pytest.mark.parametrize("recipe", ["grpo_tiny", "grpo_async_tiny", "ppo_tiny"])
def test_rl_recipes_accept_val_only(recipe: str) -> None:
    cfg = load_config([f"recipe={recipe}", "trainer.val_only=true"])
    assert cfg.trainer.val_only
    world = 4 if recipe == "grpo_async_tiny" else 2
    roles = importlib.import_module(f"spmdrl.recipes.{cfg.entry}").ROLES
    plan_job(cfg, world, 4000, roles)  # the plan build_job and --check make: no error


@pytest.mark.parametrize("recipe", ["grpo_tiny", "grpo_async_tiny", "ppo_tiny"])
def test_val_only_without_val_files_is_refused(recipe: str) -> None:
    match = r"trainer.val_only=true .* data.val_files, which is empty"
    with pytest.raises(ConfigError, match=match):  # at config load (the recipe's check_config)
        load_config([f"recipe={recipe}", "trainer.val_only=true", "data.val_files=[]"])
    cfg = load_config([f"recipe={recipe}", "data.val_files=[]"])  # training needs none
    # A fork's recipe without that check: the job's plan refuses it.
    cfg = dataclasses.replace(cfg, trainer=dataclasses.replace(cfg.trainer, val_only=True))
    with pytest.raises(ConfigError, match=match):
        plan_job(cfg, 4, 4000)


def test_sft_val_only_needs_val_files() -> None:
    assert load_config(["recipe=sft_tiny", "trainer.val_only=true"]).trainer.val_only
    with pytest.raises(ConfigError, match=r"trainer.val_only=true .* data.val_files, which is empty"):
        load_config(["recipe=sft_tiny", "trainer.val_only=true", "data.val_files=[]"])


def test_the_reward_model_refuses_val_only() -> None:
    with pytest.raises(ConfigError, match=r"trainer.val_only=true is not supported by this recipe \(rm,"):
        load_config(["recipe=rm_tiny", "trainer.val_only=true"])
    assert not load_config(["recipe=rm_tiny"]).trainer.val_only


def test_zero_epochs_suggests_val_only() -> None:
    with pytest.raises(ConfigError, match=r"total_epochs must be > 0, got 0; .* trainer.val_only=true"):
        load_config(["recipe=grpo_tiny", "trainer.total_epochs=0"])


def test_val_only_evaluates_the_warm_start_export_beside_the_checkpoint(tmp_path: Path) -> None:
    base = tmp_path / "base"
    with pytest.raises(ConfigError, match=r"found no checkpoint to evaluate.*warmstart.enabled=false"):
        val_only_model(StartPlan(None, restarted=False), base)
    ckpt = tmp_path / "run" / "checkpoints" / "step-2"
    ckpt.mkdir(parents=True)
    with pytest.raises(ConfigError, match=r"step-2 has no warm-start export beside it \(sft/hf_model\)"):
        val_only_model(StartPlan(ckpt, restarted=False), base)
    export = tmp_path / "run" / "sft" / "hf_model"
    export.mkdir(parents=True)
    (export / "config.json").write_text("{}")
    assert val_only_model(StartPlan(ckpt, restarted=False), base) == export
