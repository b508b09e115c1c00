"""The env section on the command line: env.args assigned whole as a free-form mapping, values checked."""

from __future__ import annotations

import pytest

from spmdrl.config_loader import load_config
from spmdrl.envs.config import EnvConfig
from spmdrl.errors import ConfigError


def test_env_args_take_any_keys_and_nested_mappings() -> None:
    cfg = load_config(
        ["recipe=grpo_tiny", "env.source=verifiers:my-env", "env.args={num_examples: 5, task: {hard: true}}"]
    )
    env = cfg.section(EnvConfig)
    assert env.args == {"num_examples": 5, "task": {"hard": True}}
    assert env.kind_and_name() == ("verifiers", "my-env") and env.enabled
    assert load_config(["recipe=grpo_tiny"]).section(EnvConfig) == EnvConfig()  # off, args {}


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("env.source=my_env", r"is not <kind>:<name>"),
        ("env.num_val=-1", r"env.num_train and env.num_val must be >= 0"),
        ("env.args=3", r"env.args must be a mapping"),
    ],
)
def test_bad_values_are_config_errors(override: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config(["recipe=grpo_tiny", override])
