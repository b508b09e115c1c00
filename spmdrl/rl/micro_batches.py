"""How a rank's rows split into micro-batches: a fixed number of sequences, or a token budget.

``trainer.micro_batch_tokens`` > 0 bounds the tokens of a micro-batch instead of its sequence count, so
long and short responses cost about the same per forward. FSDP runs collectives in every forward, so
every rank of a role must run the same number of micro-batches: each rank counts how many it needs at
the budget, the group takes the largest count (one all_reduce), and each rank splits its rows into
exactly that many micro-batches with the tokens evened out (longest first onto the lightest). The
loss normalization does not change: every term is divided by the mini-batch's global count
(spmdrl/algos/aggregation.py), however the rows are split.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from spmdrl.distributed.reduce import all_reduce_max
from spmdrl.rl.batch import RowLengths
from spmdrl.transfer import to_device


def balanced_split(lengths: list[int], parts: int) -> list[list[int]]:
    """Row indices in ``parts`` groups with even token sums (longest first onto the lightest), each
    group in row order. Deterministic."""
    loads = [0] * parts
    groups: list[list[int]] = [[] for _ in range(parts)]
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        g = min(range(parts), key=lambda j: (loads[j], j))
        groups[g].append(i)
        loads[g] += lengths[i]
    return [sorted(g) for g in groups]


def needed_parts(lengths: list[int], token_budget: int) -> int:
    """Micro-batches this rank needs so that none holds more than ``token_budget`` tokens (a sequence
    longer than the budget gets one to itself)."""
    return max(1, math.ceil(sum(lengths) / token_budget), sum(n > token_budget for n in lengths))


def micro_batch_rows(
    lengths_B: torch.Tensor,
    *,
    micro_batch_size: int,
    token_budget: int = 0,
    group: dist.ProcessGroup | None = None,
) -> list[torch.Tensor]:
    """Row indices of each micro-batch of these rows. Every rank of ``group`` calls it (with a budget)."""
    n = int(lengths_B.numel())
    if token_budget <= 0:
        return [torch.arange(s, min(s + micro_batch_size, n)) for s in range(0, n, micro_batch_size)]
    lengths = [int(x) for x in lengths_B.tolist()]
    local = min(needed_parts(lengths, token_budget), max(n, 1))
    parts = (
        int(all_reduce_max({"k": local}, lengths_B.device, group)["k"]) if dist.is_initialized() else local
    )
    # Never more micro-batches than rows (ranks hold equal row counts, so all agree on this clamp).
    parts = max(1, min(parts, n))
    return [torch.tensor(g, dtype=torch.long) for g in balanced_split(lengths, parts)]


@dataclass(frozen=True)
class MicroBatch:
    """One micro-batch's rows, planned on the host before a pass's loop: the loop then reads nothing
    from the device to slice, trim or score it (docs/performance.md, "No sync in the micro-batch loop")."""

    rows: list[int]  # row numbers in the batch
    index_B: torch.Tensor  # the same, on the batch's device
    width: int  # the longest sequence of these rows: PolicyBatch.take(index_B, width)
    first_column: int  # the first column any of them samples a token in
    lengths: list[int]  # each row's tokens (prompt + response)


def plan_micro_batches(
    parts: Sequence[torch.Tensor], lengths: RowLengths, device: torch.device
) -> list[MicroBatch]:
    """One :class:`MicroBatch` per part of ``parts`` (host row-index tensors, as micro_batch_rows gives
    them), with all their indices moved to ``device`` in one asynchronous copy."""
    rows = [[int(i) for i in p.tolist()] for p in parts]
    flat = torch.tensor([i for r in rows for i in r], dtype=torch.long)
    index = to_device(flat, device).split([len(r) for r in rows]) if rows else ()
    return [
        MicroBatch(
            rows=r,
            index_B=idx,
            width=lengths.width(r),
            first_column=lengths.first_column(r),
            lengths=[lengths.tokens[i] for i in r],
        )
        for r, idx in zip(rows, index, strict=True)
    ]
