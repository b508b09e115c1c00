"""rollout.latency_tail (spmdrl/rollout/rollout.py): which prompts are slow, and the config checks (a
real engine's calls with the tail: tests/integration/test_latency_tail.py)."""

from __future__ import annotations

import pytest

from spmdrl.config import Config, ConfigError, LatencyTailConfig, RolloutConfig, TrainerConfig, validate
from spmdrl.rollout.rollout import slow_prompts


def test_slow_prompts_is_a_seeded_choice_of_count_distinct_prompts() -> None:
    for seed in range(50):
        slow = slow_prompts(16, 3, seed)
        assert slow == sorted(set(slow)) and len(slow) == 3 and all(0 <= i < 16 for i in slow)
        assert slow_prompts(16, 3, seed) == slow  # the seed alone decides
    choices = {tuple(slow_prompts(16, 3, seed)) for seed in range(50)}
    assert len(choices) > 40  # not one fixed set: the slow prompts move from call to call
    assert set().union(*map(set, choices)) == set(range(16))


def test_slow_prompts_edges() -> None:
    assert slow_prompts(4, 0, 7) == []
    assert slow_prompts(0, 2, 7) == []  # a rank with nothing to generate waits for nothing
    assert slow_prompts(3, 5, 7) == [0, 1, 2]  # fewer prompts than count: all of them
    assert slow_prompts(3, 3, 7) == [0, 1, 2]


def _cfg(prompts: int, seconds: float, batch: int = 8) -> Config:
    return Config(
        rollout=RolloutConfig(latency_tail=LatencyTailConfig(prompts=prompts, seconds=seconds)),
        trainer=TrainerConfig(global_batch_size=batch),
    )


def test_config_errors() -> None:
    validate(_cfg(0, 0.0))
    validate(_cfg(8, 30.0))  # every prompt of the step slow: allowed
    validate(_cfg(2, 0.0))  # 0 seconds: off, not an error
    with pytest.raises(ConfigError, match=r"rollout\.latency_tail\.prompts and .* must be >= 0"):
        validate(_cfg(-1, 1.0))
    with pytest.raises(ConfigError, match=r"must be >= 0 .*got 1, -0\.5"):
        validate(_cfg(1, -0.5))
    with pytest.raises(ConfigError, match=r"prompts=9 is more than the step's batch .*global_batch_size=8"):
        validate(_cfg(9, 1.0))
    with pytest.raises(ConfigError, match=r"seconds=600.0 must stay below trainer\.collective_timeout_min"):
        validate(_cfg(1, 600.0))


def test_config_error_from_the_command_line() -> None:
    from spmdrl.config_loader import load_config

    cfg = load_config(
        ["recipe=grpo_tiny", "rollout.latency_tail.prompts=2", "rollout.latency_tail.seconds=1.5"]
    )
    assert cfg.rollout.latency_tail == LatencyTailConfig(prompts=2, seconds=1.5)
    with pytest.raises(ConfigError, match=r"rollout\.latency_tail\.prompts=33"):
        load_config(["recipe=grpo_tiny", "rollout.latency_tail.prompts=33"])  # grpo_tiny's batch is 32
