"""KL controllers and the KL penalty in the reward (spmdrl/algos/kl_control.py), by hand."""

from __future__ import annotations

import pytest
import torch

from spmdrl.algos.kl_control import (
    AdaptiveKLController,
    FixedKLController,
    apply_kl_penalty,
    build_kl_controller,
)


def test_kl_controllers_by_hand():
    fixed = FixedKLController(0.05)
    fixed.update(10.0, 100)
    assert fixed.value == 0.05
    ctrl = AdaptiveKLController(init_kl_coef=0.1, target_kl=0.1, horizon=100)
    ctrl.update(current_kl=0.15, n_steps=10)  # error 0.5, clipped to 0.2: x (1 + 0.2 * 10 / 100)
    assert ctrl.value == pytest.approx(0.1 * 1.02)
    ctrl.update(current_kl=0.09, n_steps=10)  # error -0.1: x (1 - 0.01)
    assert ctrl.value == pytest.approx(0.1 * 1.02 * 0.99)
    assert isinstance(build_kl_controller("adaptive", 0.1, target_kl=1.0, horizon=5), AdaptiveKLController)
    with pytest.raises(ValueError, match="fixed, adaptive"):
        build_kl_controller("pid", 0.1)
    with pytest.raises(ValueError, match="horizon"):
        build_kl_controller("adaptive", 0.1, horizon=0)


def test_apply_kl_penalty_by_hand():
    scores_BT = torch.tensor([[0.0, 0.0, 1.0], [0.0, 2.0, 0.0]])
    logp_BT = torch.tensor([[-1.0, -2.0, -0.5], [-1.0, -1.0, torch.nan]])
    ref_BT = torch.tensor([[-1.5, -1.0, -0.5], [-0.5, -2.0, 0.0]])
    mask_BT = torch.tensor([[1, 1, 1], [1, 1, 0]])
    rewards_BT, mean_kl = apply_kl_penalty(scores_BT, logp_BT, ref_BT, mask_BT, coef=0.1, kind="kl")
    # k1 = logp - ref: [0.5, -1, 0] and [-0.5, 1, masked -> 0].
    expected = torch.tensor([[-0.05, 0.1, 1.0], [0.05, 1.9, 0.0]])
    torch.testing.assert_close(rewards_BT, expected)
    # Per-sequence means (-0.5 / 3 and 0.5 / 2), averaged over sequences.
    assert mean_kl.item() == pytest.approx((-0.5 / 3 + 0.25) / 2)
