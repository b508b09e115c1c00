"""How a rank's rows split into micro-batches: a fixed number of sequences, or a token budget.

A token budget bounds the tokens of a micro-batch instead of its sequence count, so long and short
responses cost about the same per forward: RLDerived.ppo_max_token_len for the update's forward +
backward, RLDerived.log_prob_max_token_len for the no-grad passes, which keep no activations and take a
larger one (trainer.ppo_max_token_len_per_gpu and trainer.log_prob_max_token_len_per_gpu; on CUDA sized
from the card's memory by default, spmdrl/rl/token_budgets.py). FSDP runs collectives in every forward, so
every rank of a role must run the same number of micro-batches: each rank counts how many it needs at
the budget, the group takes the largest count (one all_reduce), and each rank splits its rows into
exactly that many micro-batches with the tokens evened out (longest first onto the lightest); padded
micro-batches (trainer.pack_sequences=false) cost rows x their longest row instead, so there the budget
bounds that and rows of similar lengths go together (padded_split). The
loss normalization does not change: every term is divided by the mini-batch's global count
(spmdrl/algos/aggregation.py), however the rows are split.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

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


def _padded_runs(sorted_lengths: list[int], cap: int) -> list[list[int]]:
    """Positions of rows sorted longest first, cut into consecutive runs that each cost at most ``cap``
    padded tokens (rows x the run's first, longest row); a row longer than ``cap`` runs alone."""
    runs, j, n = [], 0, len(sorted_lengths)
    while j < n:
        k = min(n - j, max(1, cap // max(sorted_lengths[j], 1)))
        runs.append(list(range(j, j + k)))
        j += k
    return runs


def padded_split(lengths: list[int], parts: int) -> list[list[int]]:
    """Row indices in ``parts`` groups of rows of similar lengths, the largest padded size (rows x the
    longest) as small as consecutive runs of the rows sorted longest first allow, each group in row
    order. Deterministic. For padded micro-batches, which cost their padded tokens, not their tokens."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    sorted_lengths = [lengths[i] for i in order]
    lo, hi = sorted_lengths[0], len(lengths) * sorted_lengths[0]
    while lo < hi:  # the least cap that needs at most ``parts`` runs
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if len(_padded_runs(sorted_lengths, mid)) <= parts else (mid + 1, hi)
    runs = _padded_runs(sorted_lengths, lo)
    while len(runs) < parts:  # every rank runs ``parts``: halve the costliest run of several rows
        g = max((r for r in runs if len(r) > 1), key=lambda r: (len(r) * sorted_lengths[r[0]], -r[0]))
        at = runs.index(g)
        runs[at : at + 1] = [g[: len(g) // 2], g[len(g) // 2 :]]
    return [sorted(order[p] for p in run) for run in runs]


def needed_padded_parts(lengths: list[int], token_budget: int) -> int:
    """Micro-batches this rank needs so that none pads to more than ``token_budget`` tokens."""
    return len(_padded_runs(sorted(lengths, reverse=True), token_budget)) if lengths else 1


def micro_batch_rows(
    lengths_B: torch.Tensor,
    *,
    micro_batch_size: int,
    token_budget: int = 0,
    group: dist.ProcessGroup | None = None,
    padded: bool = False,
) -> list[torch.Tensor]:
    """Row indices of each micro-batch of these rows. Every rank of ``group`` calls it (with a budget).

    ``padded``: the micro-batches are padded to their longest row (trainer.pack_sequences=false), so the
    budget bounds rows x that row's tokens, and rows of similar lengths go together; otherwise it bounds
    their tokens, spread evenly."""
    n = int(lengths_B.numel())
    if token_budget <= 0:
        return [torch.arange(s, min(s + micro_batch_size, n)) for s in range(0, n, micro_batch_size)]
    lengths = [int(x) for x in lengths_B.tolist()]
    needed = needed_padded_parts(lengths, token_budget) if padded else needed_parts(lengths, token_budget)
    local = min(needed, max(n, 1))
    parts = (
        int(all_reduce_max({"k": local}, lengths_B.device, group)["k"]) if dist.is_initialized() else local
    )
    # Never more micro-batches than rows (ranks hold equal row counts, so all agree on this clamp).
    parts = max(1, min(parts, n))
    split = padded_split if padded else balanced_split
    return [torch.tensor(g, dtype=torch.long) for g in split(lengths, parts)]


@dataclass(frozen=True)
class MicroBatch:
    """One micro-batch's rows, planned on the host before a pass's loop: the loop then reads nothing
    from the device to slice, trim or score it (docs/performance.md, "No sync in the micro-batch loop")."""

    rows: list[int]  # row numbers in the batch
    index_B: torch.Tensor  # the same, on the batch's device
    width: int  # the longest sequence of these rows: PolicyBatch.take(index_B, width)
    first_column: int  # the first column any of them samples a token in
    lengths: list[int]  # each row's tokens (prompt + response)
    # Each row's first sampled column (the batch's width for a row with none): the LM head scores from it.
    first_columns: list[int] = field(default_factory=list)
    # The rows' sampled tokens (their response mask's ones): the loss's valid-token count (None: unknown).
    response_tokens: int | None = None


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
            first_columns=[lengths.first_response[i] for i in r],
            response_tokens=sum(lengths.response_tokens[i] for i in r),
        )
        for r, idx in zip(rows, index, strict=True)
    ]
