"""Loss aggregation (spmdrl/algos/aggregation.py) against hand-computed values."""

from __future__ import annotations

import pytest
import torch

from spmdrl.algos.aggregation import Aggregation, count_units, masked_mean

# ---------------------------------------------------------------------------------------------- aggregation

LOSS_BT = torch.tensor([[1.0, 2.0, 3.0, 4.0], [5.0, 6.0, 0.0, 0.0], [7.0, 7.0, 7.0, 7.0]])
MASK_BT = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [0, 0, 0, 0]])


@pytest.mark.parametrize(
    "mode, expected",
    [
        ("token-mean", (1 + 2 + 3 + 5 + 6) / 5),
        ("token-sum", 1 + 2 + 3 + 5 + 6),  # no division (verl 0.9.1's token-sum)
        ("seq-mean-token-mean", (6 / 3 + 11 / 2) / 2),  # the empty third row is left out
        ("seq-mean-token-sum", (6 + 11) / 2),
        ("seq-mean-token-sum-norm", (6 + 11) / 4 / 2),  # each sequence's sum / L=4, over 2 sequences
    ],
)
def test_aggregate_modes_by_hand(mode, expected):
    agg = Aggregation.local(mode, MASK_BT, norm_length=4.0)
    assert agg(LOSS_BT, MASK_BT).item() == pytest.approx(expected)
    # Masked entries do not leak in, even when they are NaN.
    poisoned = torch.where(MASK_BT.bool(), LOSS_BT, torch.nan)
    assert agg(poisoned, MASK_BT).item() == pytest.approx(expected)


def test_seq_mean_counts_every_row_as_verls_global_batch_size():
    # verl's trainer divides the seq-mean modes by global_batch_size, the mini-batch's rows: the third,
    # fully masked row adds 0 to the sum and 1 to the count. Its agg_loss alone counts rows with a token.
    for mode in ("seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"):
        assert count_units(MASK_BT, mode, count_empty_rows=True) == 3
        assert count_units(MASK_BT, mode) == 2
    assert count_units(MASK_BT, "token-mean", count_empty_rows=True) == 5
    agg = Aggregation(
        "seq-mean-token-mean", count_units(MASK_BT, "seq-mean-token-mean", count_empty_rows=True)
    )
    assert agg(LOSS_BT, MASK_BT).item() == pytest.approx((6 / 3 + 11 / 2) / 3)


def test_token_sum_norm_default_divisor_is_the_mask_width():
    # verl's agg_loss without loss_scale_factor divides by loss_mask.shape[-1] (4 here), not by 1.
    agg = Aggregation.local("seq-mean-token-sum-norm", MASK_BT)
    assert agg(LOSS_BT, MASK_BT).item() == pytest.approx((6 + 11) / 4 / 2)
    wide_BT = torch.nn.functional.pad(MASK_BT, (0, 4))  # the same tokens in a mask twice as wide
    assert agg(torch.nn.functional.pad(LOSS_BT, (0, 4)), wide_BT).item() == pytest.approx((6 + 11) / 8 / 2)


def test_aggregation_counts_and_argument_errors():
    assert count_units(MASK_BT, "token-mean") == 5
    assert count_units(MASK_BT, "seq-mean-token-mean") == 2
    assert count_units(MASK_BT, "seq-mean-token-sum-norm") == 2
    with pytest.raises(ValueError, match="unknown loss aggregation 'mean'"):
        Aggregation("mean", 1.0)
    with pytest.raises(ValueError, match="norm_length must be > 0"):
        Aggregation("seq-mean-token-sum-norm", 1.0, norm_length=0.0)
    # Nothing valid anywhere: loss 0, not a division by zero.
    assert Aggregation("token-mean", 0.0)(LOSS_BT, torch.zeros_like(MASK_BT)).item() == 0.0


@pytest.mark.parametrize(
    "mode",
    ["token-mean", "token-sum", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"],
)
def test_global_normalization_matches_whole_batch(mode):
    """2 ranks x 2 micro-batches, gradients summed over micro-batches and ranks (FSDP with divide
    factor 1) == the whole batch at once, with no world size anywhere in the loss."""
    gen = torch.Generator().manual_seed(0)
    x_BT = torch.randn(4, 5, generator=gen).requires_grad_()
    mask_BT = torch.tensor([[1, 1, 1, 1, 1], [1, 0, 0, 0, 0], [1, 1, 1, 0, 0], [0, 1, 1, 0, 0]])

    def per_token(x):
        return x.square() + x

    whole = Aggregation.local(mode, mask_BT, norm_length=5.0)(per_token(x_BT), mask_BT)
    (grad_whole,) = torch.autograd.grad(whole, x_BT)

    agg = Aggregation(mode, float(count_units(mask_BT, mode)), norm_length=5.0)
    rank_losses, rank_grads = [], []
    for rank in range(2):
        total = 0.0
        for row in (2 * rank, 2 * rank + 1):  # one sequence per micro-batch
            total = total + agg(per_token(x_BT[row : row + 1]), mask_BT[row : row + 1])
        rank_losses.append(total)
        rank_grads.append(torch.autograd.grad(total, x_BT)[0])
    torch.testing.assert_close(sum(rank_losses), whole)
    torch.testing.assert_close(sum(rank_grads), grad_whole)

    if mode == "token-mean":
        # Normalizing each micro-batch by its own count instead gives a different loss: the test
        # above would catch a regression to it.
        naive = (
            sum(
                Aggregation.local(mode, mask_BT[r : r + 1])(per_token(x_BT[r : r + 1]), mask_BT[r : r + 1])
                for r in range(4)
            )
            / 4
        )
        assert not torch.allclose(naive, whole)


def test_masked_mean_empty_is_zero():
    assert masked_mean(torch.tensor([1.0, torch.nan]), torch.tensor([0, 0])).item() == 0.0
    assert masked_mean(torch.tensor([1.0, 3.0, 100.0]), torch.tensor([1, 1, 0])).item() == 2.0
