"""The RL batch arithmetic (``derive_rl`` in spmdrl/config.py): mini- and micro-batches, and what it rejects."""

from __future__ import annotations

import pytest

from spmdrl.config import (
    AlgorithmConfig,
    Config,
    ConfigError,
    RolloutConfig,
    TrainerConfig,
    derive,
    derive_rl,
)


def _cfg(global_batch: int, mini: int, n: int, micro: int, tp: int = 1) -> Config:
    return Config(
        trainer=TrainerConfig(global_batch_size=global_batch, micro_batch_size=micro),
        rollout=RolloutConfig(n=n, tp=tp),
        algorithm=AlgorithmConfig(ppo_mini_batch_size=mini),
    )


def test_derive_rl_mini_and_micro_batches() -> None:
    cfg = _cfg(global_batch=32, mini=8, n=5, micro=10)
    d = derive(cfg, world_size=4, num_train_samples=1000, samples_per_item=5)
    rl = derive_rl(cfg, d)
    assert rl.mini_batches_per_step == 4
    assert rl.per_rank_mini_batch_seqs == 8 // 4 * 5
    assert rl.micro_batches_per_mini_batch == 1
    # The accumulation an optimizer step really uses (not the whole step's micro-batches).
    assert rl.grad_accum_steps == 1 and rl.optimizer_steps_per_step == 4
    assert {**d.as_dict(), **rl.as_dict()}["grad_accum_steps"] == 1  # what derived.json reports
    assert rl.max_model_len == cfg.data.max_prompt_length + cfg.data.max_response_length


@pytest.mark.parametrize(
    ("cfg", "world", "match"),
    [
        (_cfg(32, 12, 5, 5), 4, "ppo_mini_batch_size=12 must divide"),
        (_cfg(32, 2, 5, 5), 4, "not divisible by the data-parallel size 4"),
        (_cfg(32, 8, 5, 4), 4, "micro_batch_size=4 must divide the actor.s per-rank mini-batch of 10"),
        (_cfg(32, 8, 5, 5, tp=3), 4, "rollout.tp=3 must divide the world size 4"),
    ],
)
def test_derive_rl_rejects(cfg: Config, world: int, match: str) -> None:
    d = derive(cfg, world_size=world, num_train_samples=1000, samples_per_item=cfg.rollout.n)
    with pytest.raises(ConfigError, match=match):
        derive_rl(cfg, d)
