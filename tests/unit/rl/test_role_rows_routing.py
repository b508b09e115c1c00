"""Router replay's routing travels with its rows wherever the step moves them (spmdrl/rl/role_rows.py on 2
gloo ranks): parallel.balance_tokens (RowPlan.balance_colocated) and the teacher on ranks of its own
(to_actor_ranks) deliver each row's (positions, layers, k) experts with the row, as PolicyBatch.tensors
packs them. A row whose routing arrived with another row's tokens would replay the wrong experts, which
the trainer's forward cannot notice; so every received row's routing is compared with its own.

One spawned run goes through both moves (starting the ranks costs seconds).
"""

from __future__ import annotations

import pytest
import torch

from spmdrl.rl.batch import PolicyBatch
from spmdrl.testing.spawn import run_distributed
from tests.unit.rl.moved_rows import ROWS_PER_RANK, WORLD, N, balance_and_send_to_actor, local_rows, step_rows

LAYERS, K = 3, 2


def _routing(g: torch.Generator, attn_BT: torch.Tensor) -> dict:
    """Each position routed to its own experts (-1 past the row, as build_policy_batch pads)."""
    routed = torch.randint(0, 8, (*attn_BT.shape, LAYERS, K), generator=g, dtype=torch.int16)
    return {"routed_experts_BTLK": routed.masked_fill(attn_BT[:, :, None, None] == 0, -1)}


def _global_rows() -> PolicyBatch:
    return step_rows(3, _routing)


def _worker(rank: int, world: int) -> dict:
    return balance_and_send_to_actor(local_rows(_global_rows(), rank), rank, world)


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return run_distributed(_worker, WORLD, timeout_s=180)


def _assert_rows_routed_as_their_own(got: PolicyBatch, rows: torch.Tensor, where: str) -> None:
    want = _global_rows()
    assert got.routed_experts_BTLK is not None, where
    assert got.routed_experts_BTLK.dtype == torch.int16, where
    assert got.routed_experts_BTLK.shape[2:] == (LAYERS, K), where
    for i, r in enumerate(rows.tolist()):
        n = int(want.attention_mask_BT[r].sum())
        assert torch.equal(got.input_ids_BT[i, :n], want.input_ids_BT[r, :n]), (where, r)
        assert torch.equal(got.routed_experts_BTLK[i, :n], want.routed_experts_BTLK[r, :n]), (where, r)
        assert bool((got.routed_experts_BTLK[i, n:] == -1).all()), (where, r)  # padding: no choice


def test_balance_tokens_moves_each_rows_routing_with_it(results: list[dict]) -> None:
    held = sorted(int(i) for r in results for i in r["balanced_rows"])
    assert held == list(range(N))  # every row somewhere, once
    # Rank 0 generated every long row; balanced, rank 1 trains on some of them (the routing really moved).
    assert any(int(i) < ROWS_PER_RANK for i in results[1]["balanced_rows"])
    for rank, r in enumerate(results):
        _assert_rows_routed_as_their_own(r["balanced"], r["balanced_rows"], f"balanced, rank {rank}")


def test_rows_sent_to_the_actors_ranks_keep_their_routing(results: list[dict]) -> None:
    assert results[1]["to_actor"] is None  # the teacher's own rank keeps no rows
    _assert_rows_routed_as_their_own(results[0]["to_actor"], torch.arange(N), "to the actor's rank 0")
