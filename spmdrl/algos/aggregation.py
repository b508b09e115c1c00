"""Loss aggregation: how per-token losses become the scalar a rank backpropagates. One convention, here.

Every loss in spmdrl is ``(this rank's sum over its units) / global_count``:

- a *unit* is what the mode averages over: a valid token (``token-mean``) or a sequence (the
  ``seq-mean-*`` modes: every row, or only rows with a valid token, see :func:`count_units`);
- ``global_count`` is the number of units in the whole mini-batch on all ranks, counted once before
  the mini-batch's micro-batches run (:func:`count_units` per micro-batch, summed over micro-batches
  and ranks with one all_reduce);
- gradient accumulation sums micro-batch gradients, and FSDP *sums* them over ranks
  (``set_gradient_divide_factor(1.0)`` in :mod:`spmdrl.models.build`, as torchtitan does).

So the gradient is that of the whole mini-batch's loss computed at once on one device, however the
batch is split over ranks and micro-batches, with no world size in any loss; and the sum over
micro-batches and ranks of the logged losses is the mini-batch loss. Dividing a micro-batch by its
own count instead would weight a token in a short micro-batch more than one in a long one.

The modes (verl's ``loss_agg_mode`` names, ``verl.trainer.ppo.core_algos.agg_loss``):

- ``token-mean``: sum over valid tokens / valid tokens;
- ``token-sum``: sum over valid tokens, divided by nothing (verl scales each rank's sum by its dp size
  because DDP / FSDP average gradients; spmdrl's FSDP sums them, so the sum is the mini-batch's);
- ``seq-mean-token-mean``: each sequence's mean over its tokens, averaged over sequences;
- ``seq-mean-token-sum``: each sequence's sum over its tokens, averaged over sequences;
- ``seq-mean-token-sum-norm``: each sequence's sum over its tokens, summed, / (sequences x a constant
  ``norm_length``; Dr. GRPO divides by the maximum response length instead of each sequence's length,
  which biases neither short nor long answers). verl's ``loss_scale_factor``; unset, verl divides by the
  loss mask's width (``loss_mask.shape[-1]``, its responses padded to ``rollout.response_length``), and
  so does :class:`Aggregation` with ``norm_length=None``. spmdrl's rows hold prompt + response, so the
  recipe passes ``data.max_response_length``, the width verl's mask has.

Which sequences a ``seq-mean-*`` mode counts: verl's trainer passes ``global_batch_size`` (the
mini-batch's nominal rows, ``ppo_mini_batch_size x n``), so a row whose every token was masked (rejected
by the rollout correction, say) adds 0 to the sum and 1 to the count; verl's ``agg_loss`` called without
it counts only rows with a valid token. :func:`count_units` does either (``count_empty_rows``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

AGG_MODES = (
    "token-mean",
    "token-sum",
    "seq-mean-token-mean",
    "seq-mean-token-sum",
    "seq-mean-token-sum-norm",
)


def check_mode(mode: str) -> None:
    if mode not in AGG_MODES:
        raise ValueError(f"unknown loss aggregation {mode!r}; use one of {', '.join(AGG_MODES)}")


def count_units(mask_BT: torch.Tensor, mode: str, *, count_empty_rows: bool = False) -> int:
    """The units ``mode`` averages over in this batch: valid tokens for ``token-mean`` (and
    ``token-sum``, which divides by none), sequences otherwise: every row with ``count_empty_rows`` (verl's
    trainer, whose ``global_batch_size`` is the mini-batch's row count), else the rows with at least one
    valid token (verl's ``agg_loss`` without it). Summed over micro-batches and ranks it is ``global_count``."""
    check_mode(mode)
    valid_BT = mask_BT.bool()
    if mode in ("token-mean", "token-sum"):
        return int(valid_BT.sum())
    if count_empty_rows:
        return int(valid_BT.shape[0])
    return int(valid_BT.any(dim=-1).sum())


def count_units_of_rows(response_tokens: Sequence[int], mode: str, *, count_empty_rows: bool = False) -> int:
    """:func:`count_units` from each row's number of valid tokens, known on the host: the same count
    without reading a mask from the device (a sync on a GPU, once per micro-batch in the update)."""
    check_mode(mode)
    if mode in ("token-mean", "token-sum"):
        return sum(response_tokens)
    if count_empty_rows:
        return len(response_tokens)
    return sum(1 for n in response_tokens if n > 0)


@dataclass(frozen=True)
class Aggregation:
    """Reduces per-token losses to ``sum / global_count`` (see the module docstring)."""

    mode: str
    # Units of ``mode`` in the whole mini-batch, all ranks. 0 (nothing valid anywhere) reads as 1.
    # token-sum divides by nothing and ignores it.
    global_count: float
    # seq-mean-token-sum-norm's constant divisor per sequence (the maximum response length); None: the
    # mask's width, loss_mask.shape[-1], as verl's agg_loss without loss_scale_factor.
    norm_length: float | None = None

    def __post_init__(self) -> None:
        check_mode(self.mode)
        if self.norm_length is not None and self.norm_length <= 0:
            raise ValueError(f"norm_length must be > 0, got {self.norm_length}")

    @classmethod
    def local(cls, mode: str, mask_BT: torch.Tensor, norm_length: float | None = None) -> Aggregation:
        """This batch alone (one process, one micro-batch): the plain mean over its own units (sequences
        with a valid token, as verl's ``agg_loss`` with no global batch arguments)."""
        return cls(mode, float(count_units(mask_BT, mode)), norm_length)

    def __call__(self, loss_BT: torch.Tensor, mask_BT: torch.Tensor) -> torch.Tensor:
        if loss_BT.shape != mask_BT.shape:
            raise ValueError(
                f"loss_BT {tuple(loss_BT.shape)} and mask_BT {tuple(mask_BT.shape)} differ in shape"
            )
        valid_BT = mask_BT.bool()
        # where(), not multiplication: masked positions may hold inf or NaN (padding), 0 * inf is NaN.
        masked_BT = torch.where(valid_BT, loss_BT, 0)
        if self.mode == "token-sum":
            return masked_BT.sum()
        if self.mode == "token-mean":
            total = masked_BT.sum()
        else:
            per_seq_B = masked_BT.sum(dim=-1)
            if self.mode == "seq-mean-token-mean":
                per_seq_B = per_seq_B / valid_BT.sum(dim=-1).clamp_min(1)
            elif self.mode == "seq-mean-token-sum-norm":
                per_seq_B = per_seq_B / (self.norm_length or mask_BT.shape[-1])
            total = per_seq_B.sum()  # a sequence with no valid token adds 0
        return total / max(float(self.global_count), 1.0)


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of ``x`` where ``mask`` is set (0 where nothing is). Masked entries may hold NaN or inf."""
    valid = mask.bool()
    total = torch.where(valid, x, 0).sum() if dim is None else torch.where(valid, x, 0).sum(dim)
    count = valid.sum() if dim is None else valid.sum(dim)
    return total / count.clamp_min(1)
