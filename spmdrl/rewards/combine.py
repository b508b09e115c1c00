"""A step's training reward from its parts: the rule reward, the reward model's score, the judge's score,
each times its weight (reward.rule_weight, reward_model.weight, reward_model.judge.weight)."""

from __future__ import annotations

import torch


def weighted_reward(parts: dict[str, tuple[float, torch.Tensor]]) -> torch.Tensor:
    """``sum(weight * scores_B)`` over the parts (name -> (weight, scores_B)), float32. A part of weight 0
    still counts its NaNs out: a zero-weighted part never changes the reward."""
    if not parts:
        raise ValueError("weighted_reward needs at least one part")
    total_B = None
    for weight, scores_B in parts.values():
        term_B = torch.zeros_like(scores_B, dtype=torch.float32) if weight == 0 else weight * scores_B.float()
        total_B = term_B if total_B is None else total_B + term_B
    assert total_B is not None
    return total_B
