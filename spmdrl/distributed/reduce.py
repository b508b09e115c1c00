"""Reductions over a process group: metrics batched into one collective per call, and the sum that
batch-wide statistics of a sharded batch are built from."""

from __future__ import annotations

from collections.abc import Callable

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


def all_reduce_sum_tensors(
    values: dict[str, torch.Tensor], group: dist.ProcessGroup | None = None
) -> dict[str, float]:
    """Sums every 0-dim tensor over the group with one all_reduce, in float64, and reads the sums on the
    host once: statistics accumulated on the device stay there until this one read."""
    if not values:
        return {}
    keys = sorted(values)  # every rank must pack the same keys in the same order
    t = torch.stack([values[k].detach().to(torch.float64) for k in keys])
    if dist.is_initialized():
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
    return dict(zip(keys, t.tolist(), strict=True))


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


def sum_over_group(group: dist.ProcessGroup | None = None) -> Callable[[torch.Tensor], torch.Tensor]:
    """A function that returns a tensor summed over ``group``'s ranks (one all_reduce on a copy).

    What a pure function computing whole-batch statistics from one rank's rows is handed
    (``AdvantageInputs.batch_sum``): every rank of ``group`` must call it the same number of times.
    """

    def batch_sum(t: torch.Tensor) -> torch.Tensor:
        out = t.clone()
        if dist.is_initialized():
            dist.all_reduce(out, op=dist.ReduceOp.SUM, group=group)
        return out

    return batch_sum
