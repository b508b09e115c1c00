"""spmdrl/rewards/combine.py: the training reward as the weighted sum of its parts."""

from __future__ import annotations

import pytest
import torch

from spmdrl.rewards.combine import weighted_reward


def test_weighted_sum() -> None:
    rule = torch.tensor([1.0, 0.0, 1.0])
    rm = torch.tensor([0.5, -2.0, 3.0])
    judge = torch.tensor([7.0, 0.0, 10.0])
    out = weighted_reward({"rule": (0.5, rule), "rm": (1.0, rm), "judge": (0.1, judge)})
    assert torch.allclose(out, torch.tensor([0.5 + 0.5 + 0.7, -2.0, 0.5 + 3.0 + 1.0]))
    assert out.dtype == torch.float32


def test_zero_weight_drops_a_part_even_with_nans() -> None:
    rule = torch.tensor([1.0, float("nan")])
    rm = torch.tensor([0.25, 0.5])
    assert torch.equal(weighted_reward({"rule": (0.0, rule), "rm": (2.0, rm)}), torch.tensor([0.5, 1.0]))
    with pytest.raises(ValueError):
        weighted_reward({})
