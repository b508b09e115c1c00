"""rollout.model_runner: vLLM's CUDA model runner, chosen by the config (spmdrl.rollout.engine).

Which runner vLLM then takes is logged when a CUDA engine is built; that part needs a GPU and vLLM for
CUDA, so it is not tested here. What runs here: the choice is checked before any engine is built."""

from __future__ import annotations

import pytest

from spmdrl.config import RolloutConfig
from spmdrl.config_loader import load_config
from spmdrl.errors import ConfigError
from spmdrl.rollout.engine import check_engine_config


@pytest.mark.parametrize("runner", ["v1", "v2"])
def test_a_forced_runner_is_for_cuda_only(runner: str) -> None:
    with pytest.raises(ConfigError, match=rf"rollout.model_runner={runner} .* set rollout.model_runner=auto"):
        check_engine_config(RolloutConfig(model_runner=runner), "cpu")
    check_engine_config(RolloutConfig(model_runner=runner), "cuda")
    check_engine_config(RolloutConfig(model_runner="auto"), "cpu")


def test_an_unknown_runner_is_refused_when_the_config_loads() -> None:
    assert load_config(["recipe=grpo_tiny", "rollout.model_runner=v2"]).rollout.model_runner == "v2"
    with pytest.raises(ConfigError, match="model_runner"):
        load_config(["recipe=grpo_tiny", "rollout.model_runner=v3"])
