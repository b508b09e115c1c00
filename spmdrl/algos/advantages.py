"""Advantage estimators: pure functions over reward tensors."""

from __future__ import annotations

import torch


def grpo_advantages(
    rewards_B: torch.Tensor, group_size: int, *, norm_by_std: bool = True, eps: float = 1e-6
) -> torch.Tensor:
    """GRPO's group-relative advantage of every sequence, as a float32 tensor of shape (B,).

    ``rewards_B`` holds consecutive groups of ``group_size`` samples of one prompt each. A sample's
    advantage is its reward minus its group's mean, divided by (group std + ``eps``) when
    ``norm_by_std``. The std is the unbiased sample std (Bessel's correction, ``torch.std``'s default,
    as verl uses). ``norm_by_std=False`` is Dr. GRPO: dividing by the std up-weights groups whose
    rewards barely differ (nearly solved or nearly hopeless prompts), which biases the gradient.

    A group whose rewards are all equal gets advantage 0 either way: it carries no learning signal.
    """
    if rewards_B.dim() != 1:
        raise ValueError(
            f"rewards_B must be 1-D (one reward per sequence), got shape {tuple(rewards_B.shape)}"
        )
    if group_size < 2:
        raise ValueError(
            f"GRPO needs group_size >= 2 samples per prompt, got {group_size}: with one sample the "
            "group baseline is the sample itself and every advantage is 0; raise the rollout n"
        )
    B = rewards_B.numel()
    if B % group_size:
        raise ValueError(
            f"{B} rewards do not split into groups of {group_size}: each prompt's {group_size} samples "
            "must be consecutive and a rank must hold whole groups"
        )
    rewards_GN = rewards_B.float().view(B // group_size, group_size)
    centered_GN = rewards_GN - rewards_GN.mean(dim=1, keepdim=True)
    if norm_by_std:
        centered_GN = centered_GN / (rewards_GN.std(dim=1, keepdim=True) + eps)
    return centered_GN.reshape(B)
