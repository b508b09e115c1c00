"""Padding removed: a micro-batch's sequences packed end to end into a few rows, with position ids.

Right-padded rows spend the trainer's compute on pad tokens (the MLP and LM head work per position).
Packed, the sequences of a micro-batch go end to end into rows of ``capacity`` tokens (first-fit
decreasing), each sequence's position ids restarting at 0. With no attention mask, transformers reads
the restarts as sequence boundaries and attends only within each sequence (a block-diagonal causal
mask; varlen kernels where the attention backend has them, flash-attention on GPUs). Rotary positions
are the same as in the padded row, so the logprobs equal the padded computation's up to float
rounding (tests/unit/models/test_packing.py). The segments' boundaries (``cu_seqlens``) are what varlen
attention (trainer.packed_attention; spmdrl/models/varlen.py) takes instead of a mask.

The capacity defaults to the micro-batch's longest sequence: on backends without varlen attention
(CPU's SDPA) the attention still costs capacity^2 per row, which then stays what a padded row costs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from spmdrl.transfer import to_device


@dataclass(frozen=True)
class Packed:
    input_ids_RC: torch.Tensor
    position_ids_RC: torch.Tensor
    # Every real token: its flat index in the padded (B, T) batch and in the packed (R, C) rows.
    padded_idx_N: torch.Tensor
    packed_idx_N: torch.Tensor
    shape_BT: tuple[int, int]
    # Which segment each packed position belongs to (each sequence, and each row's tail, its own): the
    # block-diagonal attention mask transformers derives from the position ids, without reading them.
    segment_ids_RC: torch.Tensor
    # The sequences as boundaries in the flattened R * C tokens, row by row, each row's tail in its last
    # sequence's segment (after every real token, so attended by none): what varlen attention kernels take
    # (spmdrl/models/varlen.py). Built on the host from the lengths ``pack`` already knows, so nothing is
    # read from the device: cu_seqlens_S1 (int32, on the device, S + 1 entries from 0 to R * C), the same
    # on the host, and the longest segment.
    cu_seqlens_S1: torch.Tensor
    cu_seqlens_host: tuple[int, ...]
    max_seqlen: int

    def unpack(self, t_RC: torch.Tensor) -> torch.Tensor:
        """A per-token (R, C) tensor back to the padded (B, T) layout, 0 at padding (differentiable)."""
        B, T = self.shape_BT
        flat = t_RC.new_zeros(B * T)
        flat = flat.index_put((self.padded_idx_N,), t_RC.reshape(-1)[self.packed_idx_N])
        return flat.view(B, T)


def first_fit_decreasing(lengths: list[int], capacity: int) -> list[list[int]]:
    """Row indices per bin: longest first, each into the first bin with room (deterministic)."""
    bins: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        for b, free in enumerate(room):
            if lengths[i] <= free:
                bins[b].append(i)
                room[b] -= lengths[i]
                break
        else:
            bins.append([i])
            room.append(capacity - lengths[i])
    return bins


def pack(
    input_ids_BT: torch.Tensor,
    attention_mask_BT: torch.Tensor,
    *,
    pad_id: int = 0,
    capacity: int = 0,
    lengths_B: Sequence[int] | None = None,
) -> Packed:
    """Pack right-padded rows; ``capacity`` 0 means the longest sequence.

    ``lengths_B``: each row's tokens when the caller knows them on the host (read from the mask
    otherwise, a sync on a GPU). The plan (positions, index maps) is built on the host and moved to the
    device in one asynchronous copy; the token ids are gathered on the device.
    """
    B, T = input_ids_BT.shape
    device = input_ids_BT.device
    lengths = [int(n) for n in (attention_mask_BT.sum(dim=1).tolist() if lengths_B is None else lengths_B)]
    C = capacity or max(lengths, default=1) or 1
    if max(lengths, default=0) > C:
        raise ValueError(f"a sequence of {max(lengths)} tokens does not fit a packed row of {C}")
    bins = first_fit_decreasing(lengths, C)
    R = len(bins)
    pos: list[int] = []
    seg: list[int] = []
    padded: list[int] = []
    packed: list[int] = []
    cu = [0]
    for r, rows in enumerate(bins):
        off = 0
        for b in rows:
            n = lengths[b]
            pos.extend(range(n))
            seg.extend([len(padded)] * n)  # a number no other segment of the row has
            padded.extend(range(b * T, b * T + n))
            packed.extend(range(r * C + off, r * C + off + n))
            off += n
            cu.append(r * C + off)
        # The tail restarts its positions too: a segment of its own, attended by no real token.
        pos.extend(range(C - off))
        seg.extend([-1] * (C - off))
        # For varlen attention the tail joins the row's last sequence: its tokens come after every real
        # one, so no real token attends to them, and one segment fewer per row.
        cu[-1] = (r + 1) * C
    N = len(padded)
    plan = to_device(torch.tensor(pos + seg + padded + packed + cu, dtype=torch.long), device)
    pos_RC, seg_RC = plan[: R * C].view(R, C), plan[R * C : 2 * R * C].view(R, C)
    padded_N, packed_N = plan[2 * R * C : 2 * R * C + N], plan[2 * R * C + N : 2 * R * C + 2 * N]
    cu_S1 = plan[2 * R * C + 2 * N :].to(torch.int32)  # flash kernels take int32 boundaries
    ids_flat = torch.full((R * C,), pad_id, dtype=input_ids_BT.dtype, device=device)
    ids_flat[packed_N] = input_ids_BT.reshape(-1)[padded_N]
    max_seqlen = max((b - a for a, b in zip(cu[:-1], cu[1:], strict=True)), default=1)
    return Packed(
        ids_flat.view(R, C), pos_RC, padded_N, packed_N, (B, T), seg_RC, cu_S1, tuple(cu), max_seqlen
    )
