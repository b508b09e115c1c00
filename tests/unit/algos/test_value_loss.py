"""PPO's clipped value loss against hand-computed values."""

from __future__ import annotations

import pytest
import torch

from spmdrl.algos.aggregation import Aggregation
from spmdrl.algos.value_loss import clipped_value_loss


def test_clipped_value_loss_by_hand() -> None:
    old_BT = torch.tensor([[0.0, 0.0, 0.0]])
    values_BT = torch.tensor([[1.0, 0.2, 9.0]], requires_grad=True)
    returns_BT = torch.tensor([[1.0, 1.0, 0.0]])
    mask_BT = torch.tensor([[1, 1, 0]])  # the last token is padding
    loss, m = clipped_value_loss(
        values_BT, old_BT, returns_BT, mask_BT, agg=Aggregation.local("token-mean", mask_BT), cliprange=0.5
    )
    # token 0: v=1 clipped to 0.5: (1-1)^2=0 vs (0.5-1)^2=0.25 -> 0.25 (clipped term larger)
    # token 1: v=0.2 within the range: (0.2-1)^2=0.64 both -> 0.64
    assert loss.item() == pytest.approx(0.5 * (0.25 + 0.64) / 2)
    assert m["vf_clipfrac"].item() == pytest.approx(0.5)
    assert m["vpred_mean"].item() == pytest.approx(0.6)
    loss.backward()
    # Gradient only through the unclipped token: d/dv 0.5 * (v - R)^2 / 2 = (v - R) / 2.
    torch.testing.assert_close(values_BT.grad, torch.tensor([[0.0, (0.2 - 1.0) / 2, 0.0]]))
    with pytest.raises(ValueError, match="cliprange must be > 0"):
        clipped_value_loss(
            values_BT, old_BT, returns_BT, mask_BT, agg=Aggregation("token-mean", 1.0), cliprange=0
        )
