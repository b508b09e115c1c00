"""algorithm.recompute_old_logprobs: auto runs the old-logprob pass only where the update's forward cannot
stand in for it; always runs it every step (verl's behaviour), except in bypass mode."""

from __future__ import annotations

import dataclasses

import pytest

from spmdrl.config import AlgorithmConfig, Config, ConfigError, derive, derive_rl, validate
from spmdrl.rl.experience import needs_old_logprobs

N = 2


def _needs(**algorithm: object) -> bool:
    cfg = Config(algorithm=AlgorithmConfig(**algorithm))  # type: ignore[arg-type]
    cfg = dataclasses.replace(cfg, rollout=dataclasses.replace(cfg.rollout, n=N))
    return needs_old_logprobs(cfg.algorithm, derive_rl(cfg, derive(cfg, 1, 1000, samples_per_item=N)))


def test_auto_skips_the_pass_only_on_policy_and_always_runs_it() -> None:
    assert not _needs()  # one epoch, one mini-batch, nothing reads them before the update
    assert _needs(ppo_epochs=2)  # the second epoch's forward is no longer the old policy
    assert _needs(recompute_old_logprobs="always")
    assert _needs(recompute_old_logprobs="always", ppo_epochs=2)
    # Bypass mode: the engine's logprobs are the old ones, whatever the setting.
    bypass = dataclasses.replace(AlgorithmConfig().rollout_correction, bypass_mode=True, rollout_is="token")
    assert not _needs(recompute_old_logprobs="always", rollout_correction=bypass)


def test_an_unknown_value_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="recompute_old_logprobs"):
        validate(Config(algorithm=AlgorithmConfig(recompute_old_logprobs="never")))
