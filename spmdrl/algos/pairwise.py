"""The Bradley-Terry pairwise loss of reward-model training (recipes/rm.py)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def bradley_terry_loss(
    chosen_B: torch.Tensor, rejected_B: torch.Tensor, num_global_pairs: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``sum(-logsigmoid(r_chosen - r_rejected)) / num_global_pairs`` and the number of pairs ranked right
    (r_chosen > r_rejected; a tie counts half, a coin's expected score, so an untrained model whose head
    starts at 0 is at 0.5, not 0). Dividing this rank's sum by the pairs of the whole step (all ranks, all
    micro-batches) makes the summed gradients the gradient of the step's mean loss
    (spmdrl/algos/aggregation.py's rule)."""
    margin_B = chosen_B.float() - rejected_B.float()
    loss = -F.logsigmoid(margin_B).sum() / num_global_pairs
    return loss, pairs_right(margin_B).sum().detach()


def pairs_right(margin_B: torch.Tensor) -> torch.Tensor:
    """1 where r_chosen > r_rejected, 0.5 at a tie, 0 otherwise (pairwise accuracy's terms)."""
    return (margin_B > 0).float() + 0.5 * (margin_B == 0).float()
