"""Pure pieces of the RL step: batch slicing and GRPO batch arithmetic."""

from __future__ import annotations

import pytest
import torch

from spmdrl.config import (
    AlgorithmConfig,
    Config,
    ConfigError,
    RolloutConfig,
    TrainerConfig,
    derive,
    derive_rl,
)
from spmdrl.rl.batch import PolicyBatch


def _batch() -> PolicyBatch:
    attn = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 0], [1, 1, 0, 0, 0], [1, 1, 1, 1, 1]])
    B, T = attn.shape
    return PolicyBatch(
        input_ids_BT=torch.arange(B * T).view(B, T),
        attention_mask_BT=attn,
        response_mask_BT=attn.bool() & (torch.arange(T) >= 1),
        engine_logprobs_BT=torch.randn(B, T),
        advantages_BT=torch.tensor([1.0, -1.0, 0.5, -0.5])[:, None] * (attn.bool() & (torch.arange(T) >= 1)),
        old_logprobs_BT=torch.zeros(B, T),
        ref_logprobs_BT=torch.zeros(B, T),
    )


def test_rows_slices_every_field_and_trims_padding() -> None:
    b = _batch()
    mb = b.rows(0, 2)
    assert mb.num_rows == 2
    assert mb.input_ids_BT.shape == (2, 4)  # longest of rows 0-1 is 4 tokens
    assert torch.equal(mb.input_ids_BT, b.input_ids_BT[:2, :4])
    assert torch.equal(mb.advantages_BT, b.advantages_BT[:2, :4])
    assert b.replace(old_logprobs_BT=None).rows(0, 2).old_logprobs_BT is None
    assert b.rows(2, 3).input_ids_BT.shape == (1, 2)


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
