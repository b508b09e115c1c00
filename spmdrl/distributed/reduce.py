"""Reductions of metrics over a process group, batched into one collective per call."""

from __future__ import annotations

import torch
import torch.distributed as dist


def _all_reduce(
    values: dict[str, float], device: torch.device, group: dist.ProcessGroup | None, op: dist.ReduceOp
) -> dict[str, float]:
    if not values:
        return {}
    keys = sorted(values)  # every rank must pack the same keys in the same order
    t = torch.tensor([float(values[k]) for k in keys], dtype=torch.float64, device=device)
    if dist.is_initialized():
        dist.all_reduce(t, op=op, group=group)
    return dict(zip(keys, t.tolist(), strict=True))


def all_reduce_sum(
    values: dict[str, float], device: torch.device, group: dist.ProcessGroup | None = None
) -> dict[str, float]:
    """Sums every value over the group with one all_reduce."""
    return _all_reduce(values, device, group, dist.ReduceOp.SUM)


def all_reduce_min(
    values: dict[str, float], device: torch.device, group: dist.ProcessGroup | None = None
) -> dict[str, float]:
    """The minimum of every value over the group with one all_reduce."""
    return _all_reduce(values, device, group, dist.ReduceOp.MIN)


def all_reduce_max(
    values: dict[str, float], device: torch.device, group: dist.ProcessGroup | None = None
) -> dict[str, float]:
    """The maximum of every value over the group with one all_reduce."""
    return _all_reduce(values, device, group, dist.ReduceOp.MAX)
