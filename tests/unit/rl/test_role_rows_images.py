"""A vision-language model's images travel with their rows wherever the step moves them
(spmdrl/rl/role_rows.py on 2 gloo ranks): parallel.balance_tokens (RowPlan.balance_colocated) and the
teacher on ranks of its own (to_actor_ranks) deliver each row's images (pixel values and pixel attention
mask, as PolicyBatch.tensors packs them) with the row, bit-exact, in row order. A row whose images arrived
with another row's tokens would have its image tokens filled with another picture, which the trainer's
forward cannot notice; so every received row's images are compared with its own.

One spawned run goes through both moves (starting the ranks costs seconds).
"""

from __future__ import annotations

import pytest
import torch

from spmdrl.data.vision import ImageInputs
from spmdrl.rl.batch import PolicyBatch
from spmdrl.testing.spawn import run_distributed
from tests.unit.rl.moved_rows import ROWS_PER_RANK, WORLD, N, balance_and_send_to_actor, local_rows, step_rows

# Uneven image counts, rows without images among them (a text prompt, or a row whose tool returned none).
COUNTS = (2, 0, 1, 3, 1, 0, 2, 1)
C, H, W = 3, 4, 4


def _images(g: torch.Generator, attn_BT: torch.Tensor) -> dict:
    """Each row's images: random pixels and a random pixel attention mask (int64, as the processor
    writes it)."""
    n = sum(COUNTS)
    return {
        "images": ImageInputs(
            torch.randn(n, C, H, W, generator=g), torch.randint(0, 2, (n, H, W), generator=g), COUNTS
        )
    }


def _global_rows() -> PolicyBatch:
    return step_rows(5, _images)


def _worker(rank: int, world: int) -> dict:
    return balance_and_send_to_actor(local_rows(_global_rows(), rank), rank, world)


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return run_distributed(_worker, WORLD, timeout_s=180)


def _assert_rows_carry_their_own_images(got: PolicyBatch, rows: torch.Tensor, where: str) -> None:
    want = _global_rows()
    assert want.images is not None and got.images is not None, where
    assert got.images.counts_B == tuple(COUNTS[r] for r in rows.tolist()), where
    assert got.images.pixel_values_NCHW.dtype == torch.float32, where
    mask = got.images.pixel_attention_mask_NHW
    assert mask is not None and mask.dtype == torch.long, where
    for i, r in enumerate(rows.tolist()):
        n = int(want.attention_mask_BT[r].sum())
        assert torch.equal(got.input_ids_BT[i, :n], want.input_ids_BT[r, :n]), (where, r)
        mine, theirs = got.images.rows([i]), want.images.rows([r])
        assert torch.equal(mine.pixel_values_NCHW, theirs.pixel_values_NCHW), (where, r)
        assert torch.equal(mine.pixel_attention_mask_NHW, theirs.pixel_attention_mask_NHW), (where, r)


def test_balance_tokens_moves_each_rows_images_with_it(results: list[dict]) -> None:
    held = sorted(int(i) for r in results for i in r["balanced_rows"])
    assert held == list(range(N))  # every row somewhere, once
    # Rank 0 generated every long row; balanced, rank 1 trains on some of them (the images really moved).
    assert any(int(i) < ROWS_PER_RANK for i in results[1]["balanced_rows"])
    for rank, r in enumerate(results):
        _assert_rows_carry_their_own_images(r["balanced"], r["balanced_rows"], f"balanced, rank {rank}")


def test_rows_sent_to_the_actors_ranks_keep_their_images(results: list[dict]) -> None:
    assert results[1]["to_actor"] is None  # the teacher's own rank keeps no rows
    _assert_rows_carry_their_own_images(results[0]["to_actor"], torch.arange(N), "to the actor's rank 0")
