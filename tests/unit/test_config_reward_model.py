"""spmdrl/config.py's reward_model section (RewardModelConfig, JudgeConfig): what is refused at load, with
the key and the fix in the message, and the recipes that use it."""

from __future__ import annotations

import pytest

from spmdrl.config_loader import load_config
from spmdrl.errors import ConfigError


@pytest.mark.parametrize(
    "overrides, match",
    [
        (["reward_model.enable=true"], "needs reward_model.path"),
        (
            ["reward_model.enable=true", "reward_model.path=/x", "reward_model.placement=separate"],
            "separate puts the reward model on the rollout ranks of parallel.placement=async",
        ),
        (
            ["reward_model.judge.enable=true", "reward_model.placement=separate"],
            "set parallel.placement=async",
        ),
        (["reward_model.micro_batch_size_per_gpu=0"], "micro_batch_size_per_gpu must be > 0"),
        (["reward_model.max_length=-1"], "max_length >= 0"),
        (["reward_model.placement=elsewhere"], "reward_model.placement='elsewhere' is not one of"),
        (["reward_model.judge.enable=true", "reward_model.judge.path=/judge"], "separate judge engine"),
        (
            ["reward_model.judge.enable=true", "reward_model.judge.template='Rate {prompt}'"],
            "must contain {response}",
        ),
        (
            ["reward_model.judge.enable=true", "reward_model.judge.template='Rate {response} {answer}'"],
            "'answer'",
        ),
        (["reward_model.judge.enable=true", "reward_model.judge.score_regex='Score: \\d+'"], "needs a group"),
        (
            ["reward_model.judge.enable=true", "reward_model.judge.score_regex='Score: (\\d+'"],
            "is not a regex",
        ),
        (["reward_model.judge.enable=true", "reward_model.judge.max_tokens=0"], "max_tokens must be > 0"),
        (["reward_model.judge.enable=true", "reward_model.judge.temperature=-1"], "temperature >= 0"),
        (["reward_model.judge.enable=true", "parallel.placement=split"], "need parallel.placement=colocated"),
        (["reward_model.weight=abc"], "weight"),
    ],
)
def test_refused_at_load(overrides: list[str], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        load_config(["recipe=grpo_tiny", *overrides])


def test_defaults_and_a_valid_judge() -> None:
    cfg = load_config(["recipe=grpo_tiny"])
    rm = cfg.reward_model
    assert not rm.enable and not rm.judge.enable and rm.placement == "colocated"
    assert cfg.reward.rule_weight == 1.0 and rm.weight == 1.0
    cfg = load_config(
        [
            "recipe=grpo_tiny",
            "reward_model.judge.enable=true",
            "reward_model.judge.template='Q {prompt} A {response} T {ground_truth}'",
            "reward_model.judge.weight=0.1",
        ]
    )
    assert cfg.reward_model.judge.weight == 0.1


def test_grpo_rm_tiny_needs_the_reward_models_path() -> None:
    """The shipped recipe names no path: the message says where one comes from."""
    with pytest.raises(ConfigError, match="rm_tiny"):
        load_config(["recipe=grpo_rm_tiny"])
    cfg = load_config(["recipe=rm_tiny"])
    assert cfg.entry == "rm" and cfg.model.path == "tiny"
