"""Batch-wide advantage statistics over 2 gloo ranks equal the whole batch's: the estimators alone
(spmdrl/algos/advantages.py) and an RL step's ``batch_advantages`` (spmdrl/rl/experience.py)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from spmdrl.algos.advantages import (
    AdvantageInputs,
    compute_advantages,
    token_level_rewards,
)
from spmdrl.algos.kl_control import FixedKLController
from spmdrl.rl.batch import PolicyBatch
from spmdrl.rl.experience import batch_advantages
from spmdrl.testing.spawn import run_distributed
from tests.unit.rl.advantage_batches import CPU, REJECT, B, cfg_with_n, scored_batch

# ---------------------------------------------------------------------------------------------- two ranks

SHARDED = ("gae", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "gpg", "grpo", "gdpo")


def _sharded_batch() -> AdvantageInputs:
    """12 rows, groups of 3 (each of 2 ranks holds 2 whole groups), masked spans inside some responses,
    and rank 0's rows mostly zero-reward, so that every batch-wide statistic differs per rank."""
    g = torch.Generator().manual_seed(0)
    B, T = 12, 8
    mask_BT = torch.arange(T) < torch.randint(3, T + 1, (B,), generator=g)[:, None]
    mask_BT[::4, 1] = False  # tool output inside a response
    scores_B = torch.randint(1, 4, (B,), generator=g).float() * torch.tensor([0, 0, 1, 0, 0, 1] + [1] * 6)
    return AdvantageInputs(
        token_rewards_BT=token_level_rewards(scores_B, mask_BT),
        response_mask_BT=mask_BT,
        group_ids_B=torch.arange(B) // 3,
        values_BT=torch.randn(B, T, generator=g) + torch.arange(B)[:, None] / 4,
        gamma=0.9,
        lam=0.8,
    )


def _shard(inputs: AdvantageInputs, rank: int, world: int, batch_sum=None) -> AdvantageInputs:
    n = inputs.group_ids_B.numel() // world
    rows = slice(rank * n, (rank + 1) * n)
    tensors = {
        f.name: getattr(inputs, f.name)[rows]
        for f in dataclasses.fields(inputs)
        if isinstance(getattr(inputs, f.name), torch.Tensor)
    }
    return dataclasses.replace(inputs, batch_sum=batch_sum, **tensors)


def _advantages_on_rank(rank: int, world: int) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    from spmdrl.distributed.reduce import sum_over_group

    shard = _shard(_sharded_batch(), rank, world, sum_over_group())
    return {name: compute_advantages(name, shard) for name in SHARDED}


@pytest.mark.slow
def test_batch_wide_statistics_over_two_ranks_equal_the_whole_batch():
    # Each rank holds half the batch (whole groups); its advantages must be those of one process
    # computing over the whole batch (verl's), for whitening and GPG's alpha as well as group statistics.
    full = _sharded_batch()
    per_rank = run_distributed(_advantages_on_rank, 2, timeout_s=60)
    for name in SHARDED:
        want_adv, want_ret = compute_advantages(name, full)
        for r, got in enumerate(per_rank):
            rows = slice(r * 6, (r + 1) * 6)
            torch.testing.assert_close(got[name][0], want_adv[rows], msg=f"{name} rank {r}")
            torch.testing.assert_close(got[name][1], want_ret[rows], msg=f"{name} rank {r}")
        # The case has teeth: each rank's own statistics (no batch_sum) are not the batch's.
        alone_BT = torch.cat([compute_advantages(name, _shard(full, r, 2))[0] for r in range(2)])
        assert torch.allclose(alone_BT, want_adv) == (name == "grpo"), name


def _step4_on_rank(rank: int, world: int, name: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    batch = scored_batch()
    rows = B // world
    shard = PolicyBatch.from_tensors(
        {k: v[rank * rows : (rank + 1) * rows] for k, v in batch.tensors().items()}
    )
    cfg = cfg_with_n(adv_estimator=name, rollout_correction=REJECT, gamma=0.9, lam=0.8)
    out, _ = batch_advantages(
        cfg.algorithm, cfg.rollout.n, shard, None, FixedKLController(0.0), CPU, group=None
    )
    assert out.returns_BT is not None
    return out.response_mask_BT, out.advantages_BT, out.returns_BT


@pytest.mark.slow
def test_batch_advantages_on_two_ranks_equal_the_whole_batch() -> None:
    # GAE's whitening over the whole batch (verl's), summed over the actor's ranks by the recipe.
    name = "gae"
    per_rank = run_distributed(_step4_on_rank, 2, name, timeout_s=90)
    cfg = cfg_with_n(adv_estimator=name, rollout_correction=REJECT, gamma=0.9, lam=0.8)
    want, _ = batch_advantages(
        cfg.algorithm, cfg.rollout.n, scored_batch(), None, FixedKLController(0.0), CPU
    )
    for got, field in zip(
        (torch.cat(parts) for parts in zip(*per_rank, strict=True)),
        ("response_mask_BT", "advantages_BT", "returns_BT"),
        strict=True,
    ):
        torch.testing.assert_close(got, getattr(want, field), msg=field)
