"""The scored batch the batch-advantage tests share (unit: verl's order; integration: over two gloo ranks)."""

from __future__ import annotations

import dataclasses

import torch

from spmdrl.config import AlgorithmConfig, Config, RolloutCorrectionConfig
from spmdrl.rl.batch import PolicyBatch

B, T, N = 8, 10, 2  # 4 prompts x 2 samples; 2 ranks hold 2 prompts each
CPU = torch.device("cpu")
# token_k1 keeps 0.8 <= pi_rollout / pi_trainer <= 1.25: with the noise below, about 15% of the tokens go.
REJECT = RolloutCorrectionConfig(rollout_rs="token_k1", rollout_rs_threshold="0.8_1.25")


def cfg_with_n(**algorithm: object) -> Config:
    cfg = Config(algorithm=AlgorithmConfig(**algorithm))  # type: ignore[arg-type]
    return dataclasses.replace(cfg, rollout=dataclasses.replace(cfg.rollout, n=N))


def scored_batch() -> PolicyBatch:
    """Rewards on the last response token (the first 4 rows mostly 0, so each half's statistics differ
    from the whole batch's), critic values, and engine logprobs that stray from the trainer's."""
    g = torch.Generator().manual_seed(0)
    lengths_B = torch.randint(6, T + 1, (B,), generator=g)
    attn = (torch.arange(T) < lengths_B[:, None]).long()
    resp = attn.bool() & (torch.arange(T) >= 3)
    last_B = lengths_B - 1
    scores_B = torch.tensor([0.0, 1.0, 0.0, 0.0, 1.0, 1.0, 0.0, 1.0])
    rewards = torch.zeros(B, T).index_put_((torch.arange(B), last_B), scores_B)
    old = -torch.rand(B, T, generator=g) * resp
    engine = (old + 0.15 * torch.randn(B, T, generator=g)) * resp
    return PolicyBatch(
        input_ids_BT=torch.randint(0, 64, (B, T), generator=g) * attn,
        attention_mask_BT=attn,
        response_mask_BT=resp,
        engine_logprobs_BT=engine,
        advantages_BT=torch.zeros(B, T),
        old_logprobs_BT=old,
        ref_logprobs_BT=(old - 0.2 * torch.rand(B, T, generator=g)) * resp,
        values_BT=torch.randn(B, T, generator=g) * resp,
        token_rewards_BT=rewards,
    )
