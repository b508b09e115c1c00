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

Wire format: one message per (source, destination) pair, every field of the moved rows side by side in
one int64 buffer of shape (rows, sum of the fields' slots): each row of a field is its bytes in its own
dtype (a field of w elements of s bytes fills ceil(w * s / 8) slots), so a token id costs 8 bytes, a
float32 logprob or pixel 4, a router replay expert index (int16) 2 and a mask 1, and every value arrives
bit for bit (tests/unit/distributed/test_exchange.py). A field is w elements wide at a width every rank
knows, or at its own, announced first in a small header on the same pair (``width=None``).
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


def gather_lengths(
    lengths_B: torch.Tensor, device: torch.device, group: dist.ProcessGroup | None = None
) -> tuple[list[int], torch.Tensor]:
    """Every rank's row count and every row's length, in global order (two small all_gathers), over
    ``group`` (default: every rank), in its ranks' order."""
    world = dist.get_world_size(group)
    count = torch.tensor([lengths_B.numel()], dtype=torch.long, device=device)
    counts = [torch.zeros_like(count) for _ in range(world)]
    dist.all_gather(counts, count, group=group)
    sizes = [int(c) for c in counts]
    padded = torch.zeros(max(sizes), dtype=torch.long, device=device)
    padded[: lengths_B.numel()] = lengths_B.to(device)
    parts = [torch.zeros_like(padded) for _ in range(world)]
    dist.all_gather(parts, padded, group=group)
    lengths = torch.cat([p[:s] for p, s in zip(parts, sizes, strict=True)]).cpu()
    return sizes, lengths


@dataclass(frozen=True)
class _Plan:
    """One rank's part of a move: which of its source rows go to which peer, which of its destination
    rows come from which peer, and the rows it keeps (positions among its destination rows, and among its
    source rows). Planned identically on every rank from the two layouts."""

    mine: torch.Tensor
    want: torch.Tensor
    sends: list[tuple[int, torch.Tensor]]
    recvs: list[tuple[int, torch.Tensor]]
    keep: tuple[torch.Tensor, torch.Tensor] | None

    @classmethod
    def of(cls, src: RowLayout, dst: RowLayout, rank: int) -> _Plan:
        mine, want = src.rows_of(rank), dst.rows_of(rank)
        sends, recvs, keep = [], [], None
        # My rows grouped by their new owner; a global row's position within my rows is its rank among
        # my (sorted) global indices.
        new_owner = dst.owner_N[mine]
        for peer in torch.unique(new_owner).tolist() if mine.numel() else []:
            if peer != rank:
                sends.append((peer, torch.nonzero(new_owner == peer).flatten()))
        old_owner = src.owner_N[want]
        for peer in torch.unique(old_owner).tolist() if want.numel() else []:
            sel = torch.nonzero(old_owner == peer).flatten()
            if peer == rank:
                keep = (sel, torch.searchsorted(mine, want[sel]))
            else:
                recvs.append((peer, sel))
        return cls(mine, want, sends, recvs, keep)


def _exchange(sends: list[tuple[int, torch.Tensor]], recvs: list[tuple[int, torch.Tensor]]) -> None:
    """``(peer, tensor)`` sends and receives, posted together and waited for."""
    ops = [dist.P2POp(dist.isend, t, peer) for peer, t in sends]
    ops += [dist.P2POp(dist.irecv, t, peer) for peer, t in recvs]
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()


def _checked(
    fields: Mapping[str, torch.Tensor] | None, names: list[str], rows: int, rank: int, width: int | None
) -> Mapping[str, torch.Tensor]:
    if fields is None or set(fields) != set(names):
        got = "nothing" if fields is None else sorted(fields)
        raise ValueError(f"rank {rank} holds {rows} rows to move; fields {names} needed, got {got}")
    for name in names:
        t = fields[name]
        if t.dim() != 2 or t.shape[0] != rows or (width is not None and t.shape[1] > width):
            bound = "w" if width is None else f"<= {width}"
            raise ValueError(
                f"field {name}: shape {tuple(t.shape)} on rank {rank}, expected ({rows}, {bound})"
            )
    return fields


def move_rows(
    fields: Mapping[str, torch.Tensor] | None,
    spec: FieldSpec,
    src: RowLayout,
    dst: RowLayout,
    *,
    width: int | None,
    device: torch.device,
) -> dict[str, torch.Tensor] | None:
    """Rows held per ``src`` -> rows held per ``dst``. Every rank calls it with the same layouts.

    ``fields`` (this rank's ``(rows, w)`` tensors, one per name in ``spec``) is required on ranks that
    hold rows in ``src``; the result is this rank's rows under ``dst``, right-padded with 0, or None on a
    rank that holds none there.

    ``width``: a bound every rank knows (each field's w <= width); every field travels, and arrives,
    ``width`` wide. None: each field travels at its own width, so a (rows, 1) column costs one number per
    row; a header of each field's width goes first to every receiver, on the same point-to-point pairs
    (nothing else waits on it: the receiver was waiting for those rows anyway). A field then arrives as
    wide as the widest of it among the ranks it came from.
    """
    if src.num_rows != dst.num_rows:
        raise ValueError(f"layouts of {src.num_rows} and {dst.num_rows} rows")
    rank = dist.get_rank()
    names = list(spec)
    plan = _Plan.of(src, dst, rank)
    packed, widths = None, None
    if plan.mine.numel():
        held = _checked(fields, names, plan.mine.numel(), rank, width)
        widths = [held[n].shape[1] if width is None else width for n in names]
        slots = [_slots(w, spec[n]) for n, w in zip(names, widths, strict=True)]
        # Every field side by side in one int64 buffer, each in its own slots, as its own dtype's bytes.
        packed = torch.zeros(plan.mine.numel(), sum(slots), dtype=torch.int64, device=device)
        packed_bytes = packed.view(torch.uint8)
        offset = 0
        for name, n_slots in zip(names, slots, strict=True):
            t = held[name].to(device=device, dtype=spec[name]).contiguous()
            row_bytes = t.view(torch.uint8)
            packed_bytes[:, offset * 8 : offset * 8 + row_bytes.shape[1]] = row_bytes
            offset += n_slots
    # Each source's field widths: known without asking when fixed, sent ahead when not.
    peer_widths: dict[int, list[int]] = {}
    if width is None:
        headers = [(peer, torch.empty(len(names), dtype=torch.long, device=device)) for peer, _ in plan.recvs]
        mine_w = torch.tensor(widths or [], dtype=torch.long, device=device)
        _exchange([(peer, mine_w) for peer, _ in plan.sends], headers)
        peer_widths = {peer: h.tolist() for peer, h in headers}
    else:
        peer_widths = {peer: [width] * len(names) for peer, _ in plan.recvs}
    bufs = [
        (
            peer,
            torch.empty(sel.numel(), _row_slots(peer_widths[peer], spec), dtype=torch.int64, device=device),
        )
        for peer, sel in plan.recvs
    ]
    outgoing = []
    if packed is not None:
        outgoing = [(peer, packed.index_select(0, sel.to(device)).contiguous()) for peer, sel in plan.sends]
    _exchange(outgoing, bufs)
    if not plan.want.numel():
        return None
    # Where each destination row's fields come from: a received buffer, or my own packed rows.
    parts: list[tuple[torch.Tensor, torch.Tensor, list[int]]] = [
        (sel.to(device), buf, peer_widths[peer])
        for (peer, sel), (_, buf) in zip(plan.recvs, bufs, strict=True)
    ]
    if plan.keep is not None:
        assert packed is not None and widths is not None
        sel, pos = plan.keep
        parts.append((sel.to(device), packed[pos.to(device)], widths))
    out: dict[str, torch.Tensor] = {}
    for i, name in enumerate(names):
        dtype = spec[name]
        w_out = max(ws[i] for _, _, ws in parts)
        field = torch.zeros(plan.want.numel(), w_out, dtype=dtype, device=device)
        for sel, buf, ws in parts:
            offset = sum(_slots(w, spec[n]) for w, n in zip(ws[:i], names, strict=False))
            size = ws[i] * dtype.itemsize
            row_bytes = buf.view(torch.uint8)[:, offset * 8 : offset * 8 + size].contiguous()
            field[sel, : ws[i]] = row_bytes.view(dtype)
        out[name] = field
    return out


def _slots(width: int, dtype: torch.dtype) -> int:
    """int64 slots that ``width`` elements of ``dtype`` take on the wire."""
    return -(-width * dtype.itemsize // 8)


def _row_slots(widths: Sequence[int], spec: FieldSpec) -> int:
    return sum(_slots(w, dtype) for w, dtype in zip(widths, spec.values(), strict=True))
