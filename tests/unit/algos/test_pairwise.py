"""spmdrl/algos/pairwise.py: the Bradley-Terry loss, its value, normalization and gradient signs."""

from __future__ import annotations

import math

import pytest
import torch

from spmdrl.algos.pairwise import bradley_terry_loss


def test_value_and_count_by_hand() -> None:
    chosen = torch.tensor([2.0, 0.0, -1.0])
    rejected = torch.tensor([1.0, 0.0, 1.0])
    loss, right = bradley_terry_loss(chosen, rejected, num_global_pairs=6)
    # -log(sigmoid(m)) = log(1 + exp(-m)) for margins 1, 0, -2, summed and divided by the 6 pairs of the step.
    expected = (math.log1p(math.exp(-1)) + math.log(2) + math.log1p(math.exp(2))) / 6
    assert float(loss) == pytest.approx(expected, rel=1e-6)
    assert float(right) == 1.5  # the first pair ranks chosen above rejected, the tie counts half


def test_gradient_raises_chosen_and_lowers_rejected() -> None:
    chosen = torch.tensor([0.3, -2.0], requires_grad=True)
    rejected = torch.tensor([0.1, 1.0], requires_grad=True)
    loss, _ = bradley_terry_loss(chosen, rejected, num_global_pairs=2)
    loss.backward()
    assert chosen.grad is not None and rejected.grad is not None
    assert (chosen.grad < 0).all(), "descending the loss must raise the chosen score"
    assert (rejected.grad > 0).all(), "and lower the rejected one"
    # d/dm -logsigmoid(m) = -(1 - sigmoid(m)): a badly ranked pair pulls harder.
    assert abs(float(chosen.grad[1])) > abs(float(chosen.grad[0]))
    assert torch.allclose(chosen.grad, -(1 - torch.sigmoid(torch.tensor([0.2, -3.0]))) / 2)


def test_split_sums_equal_the_whole() -> None:
    """Micro-batches' losses (each divided by the step's pairs) add up to the whole batch's mean loss."""
    g = torch.Generator().manual_seed(0)
    c, r = torch.randn(8, generator=g), torch.randn(8, generator=g)
    whole, _ = bradley_terry_loss(c, r, 8)
    parts = sum(float(bradley_terry_loss(c[i : i + 3], r[i : i + 3], 8)[0]) for i in range(0, 8, 3))
    assert parts == pytest.approx(float(whole), rel=1e-6)
