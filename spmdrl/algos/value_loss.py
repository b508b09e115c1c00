"""The critic's loss: PPO's clipped value loss (verl's ``compute_value_loss``)."""

from __future__ import annotations

import torch

from spmdrl.algos.aggregation import Aggregation, masked_mean


def clipped_value_loss(
    values_BT: torch.Tensor,
    old_values_BT: torch.Tensor,
    returns_BT: torch.Tensor,
    mask_BT: torch.Tensor,
    *,
    agg: Aggregation,
    cliprange: float,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """``0.5 * agg(max((v - R)^2, (v_clip - R)^2))`` with ``v_clip = v_old + clip(v - v_old, -c, c)``.

    The clip keeps one update from moving a value far from the one the advantages were computed with,
    as PPO's ratio clip does for the policy; taking the max makes it a pessimistic bound. Metrics:
    ``vf_clipfrac`` (tokens where the clipped term was larger) and ``vpred_mean``, detached.
    """
    if cliprange <= 0:
        raise ValueError(f"cliprange must be > 0, got {cliprange}")
    clipped_BT = old_values_BT + (values_BT - old_values_BT).clamp(-cliprange, cliprange)
    loss1_BT = (values_BT - returns_BT).square()
    loss2_BT = (clipped_BT - returns_BT).square()
    loss = 0.5 * agg(torch.maximum(loss1_BT, loss2_BT), mask_BT)
    with torch.no_grad():
        metrics = {
            "vf_clipfrac": masked_mean((loss2_BT > loss1_BT).float(), mask_BT),
            "vpred_mean": masked_mean(values_BT.detach(), mask_BT),
        }
    return loss, metrics
