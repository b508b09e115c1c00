"""Rows of a batch moved between ranks by tensor collectives: the data plane between role groups.

A step's rows are numbered globally (rank 0's rollouts first, then rank 1's, ...). A :class:`RowLayout`
says which rank holds each global row; every rank holds its rows in global order. Moving a batch from
one layout to another is point-to-point sends of row slices, planned identically on every rank from
the two layouts, so nothing but the rows themselves (and, once per step, each rank's row lengths)
crosses the wire, and no Python object is pickled.

Uses under ``parallel.placement=split`` (recipes/ppo.py): the rollouts of every rank to the actor's
ranks and to the critic's ranks, the critic's values to the actor, the returns back to the critic.
With ``parallel.balance_tokens`` the target layout is :meth:`RowLayout.balanced`: equal row counts per
rank (the update's arithmetic needs them) with the token counts evened out.

Wire format: one message per (source, destination) pair, every field of the moved rows packed side by
side into a float64 buffer of shape (rows, width, fields). float64 holds int64 token ids below 2**53,
booleans and float32 values exactly, so the round trip is bit-exact (tests/unit/distributed/test_exchange.py).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

# name -> dtype of each (B, T) field moved; every rank passes the same spec.
FieldSpec = Mapping[str, torch.dtype]


@dataclass(frozen=True)
class RowLayout:
    """``owner_N[g]``: the rank holding global row g. Each rank holds its rows sorted by g."""

    owner_N: torch.Tensor

    @property
    def num_rows(self) -> int:
        return int(self.owner_N.numel())

    def rows_of(self, rank: int) -> torch.Tensor:
        """The global indices of ``rank``'s rows, in the order it holds them."""
        return torch.nonzero(self.owner_N == rank).flatten()

    @classmethod
    def from_counts(cls, counts: Sequence[int], ranks: Sequence[int] | None = None) -> RowLayout:
        """Rank ``ranks[i]`` holds the next ``counts[i]`` rows (the layout rollouts are produced in)."""
        ranks = list(range(len(counts))) if ranks is None else list(ranks)
        return cls(torch.repeat_interleave(torch.tensor(ranks, dtype=torch.long), torch.tensor(counts)))

    @classmethod
    def contiguous(cls, num_rows: int, ranks: Sequence[int]) -> RowLayout:
        """Equal consecutive blocks, one per rank, in order."""
        per = _per_rank(num_rows, len(ranks))
        return cls.from_counts([per] * len(ranks), ranks)

    @classmethod
    def balanced(cls, lengths_N: torch.Tensor, ranks: Sequence[int], chunks: int = 1) -> RowLayout:
        """Equal row counts per rank, tokens evened out, within each of ``chunks`` consecutive chunks of
        rows (the update's mini-batches: each one stays balanced on its own).

        Greedy longest-first: a chunk's rows, longest first, each go to the rank with the fewest tokens
        so far among those with a free place. Deterministic (ties by rank order, then row index), so
        every rank computes the same layout.
        """
        n, k = int(lengths_N.numel()), len(ranks)
        size = _per_rank(n, chunks)
        per = _per_rank(size, k)
        owner = torch.empty(n, dtype=torch.long)
        for lo in range(0, n, size):
            load, free = [0] * k, [per] * k
            order = sorted(range(lo, lo + size), key=lambda g: (-int(lengths_N[g]), g))
            for g in order:
                i = min((j for j in range(k) if free[j]), key=lambda j: (load[j], j))
                owner[g] = ranks[i]
                load[i] += int(lengths_N[g])
                free[i] -= 1
        return cls(owner)

    def imbalance(self, lengths_N: torch.Tensor, ranks: Sequence[int]) -> float:
        """Most tokens on one rank / the mean over ``ranks`` (1.0: perfectly even)."""
        loads = torch.tensor([float(lengths_N[self.owner_N == r].sum()) for r in ranks])
        return float(loads.max() / loads.mean()) if float(loads.mean()) > 0 else 1.0


def _per_rank(num_rows: int, parts: int) -> int:
    if parts < 1 or num_rows % parts:
        raise ValueError(f"{num_rows} rows do not split evenly over {parts} parts")
    return num_rows // parts


def gather_lengths(lengths_B: torch.Tensor, device: torch.device) -> tuple[list[int], torch.Tensor]:
    """Every rank's row count and every row's length, in global order (two small all_gathers)."""
    world = dist.get_world_size()
    count = torch.tensor([lengths_B.numel()], dtype=torch.long, device=device)
    counts = [torch.zeros_like(count) for _ in range(world)]
    dist.all_gather(counts, count)
    sizes = [int(c) for c in counts]
    padded = torch.zeros(max(sizes), dtype=torch.long, device=device)
    padded[: lengths_B.numel()] = lengths_B.to(device)
    parts = [torch.zeros_like(padded) for _ in range(world)]
    dist.all_gather(parts, padded)
    lengths = torch.cat([p[:s] for p, s in zip(parts, sizes, strict=True)]).cpu()
    return sizes, lengths


def move_rows(
    fields: Mapping[str, torch.Tensor] | None,
    spec: FieldSpec,
    src: RowLayout,
    dst: RowLayout,
    *,
    width: int,
    device: torch.device,
) -> dict[str, torch.Tensor] | None:
    """Rows held per ``src`` -> rows held per ``dst``. Every rank calls it with the same layouts.

    ``fields`` (this rank's ``(rows, <= width)`` tensors, one per name in ``spec``) is required on
    ranks that hold rows in ``src``; the result is this rank's rows under ``dst`` (``(rows, width)``,
    right-padded with 0), or None on a rank that holds none there.
    """
    if src.num_rows != dst.num_rows:
        raise ValueError(f"layouts of {src.num_rows} and {dst.num_rows} rows")
    rank = dist.get_rank()
    names = list(spec)
    mine = src.rows_of(rank)
    packed = None
    if mine.numel():
        if fields is None or set(fields) != set(names):
            got = "nothing" if fields is None else sorted(fields)
            raise ValueError(
                f"rank {rank} holds {mine.numel()} rows to move; fields {names} needed, got {got}"
            )
        packed = torch.zeros(mine.numel(), width, len(names), dtype=torch.float64, device=device)
        for i, name in enumerate(names):
            t = fields[name]
            if t.shape[0] != mine.numel() or t.shape[1] > width:
                raise ValueError(
                    f"field {name}: shape {tuple(t.shape)} on rank {rank}, expected ({mine.numel()}, <= {width})"
                )
            packed[:, : t.shape[1], i] = t.to(device=device, dtype=torch.float64)
    want = dst.rows_of(rank)
    out = (
        torch.zeros(want.numel(), width, len(names), dtype=torch.float64, device=device)
        if want.numel()
        else None
    )
    ops: list[dist.P2POp] = []
    recvs: list[tuple[torch.Tensor, torch.Tensor]] = []
    # Sends: my rows grouped by their new owner. Position of a global row within my rows: its rank
    # among my (sorted) global indices.
    if packed is not None:
        new_owner = dst.owner_N[mine]
        for peer in torch.unique(new_owner).tolist():
            sel = torch.nonzero(new_owner == peer).flatten().to(device)
            if peer == rank:
                continue
            ops.append(dist.P2POp(dist.isend, packed.index_select(0, sel).contiguous(), peer))
    if out is not None:
        old_owner = src.owner_N[want]
        for peer in torch.unique(old_owner).tolist():
            sel = torch.nonzero(old_owner == peer).flatten()
            if peer == rank:
                assert packed is not None
                # Rows I keep: where they sit among my source rows.
                pos = torch.searchsorted(mine, want[sel])
                out[sel.to(device)] = packed[pos.to(device)]
                continue
            buf = torch.empty(sel.numel(), width, len(names), dtype=torch.float64, device=device)
            ops.append(dist.P2POp(dist.irecv, buf, peer))
            recvs.append((sel.to(device), buf))
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()
    if out is None:
        return None
    for sel, buf in recvs:
        out[sel] = buf
    return {name: out[:, :, i].to(spec[name]) for i, name in enumerate(names)}
