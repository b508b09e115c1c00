"""The typed RL batch (spmdrl/rl/batch.py): row slicing."""

from __future__ import annotations

import torch

from spmdrl.rl.batch import PolicyBatch


def _batch() -> PolicyBatch:
    attn = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 0], [1, 1, 0, 0, 0], [1, 1, 1, 1, 1]])
    B, T = attn.shape
    return PolicyBatch(
        input_ids_BT=torch.arange(B * T).view(B, T),
        attention_mask_BT=attn,
        response_mask_BT=attn.bool() & (torch.arange(T) >= 1),
        engine_logprobs_BT=torch.randn(B, T),
        advantages_BT=torch.tensor([1.0, -1.0, 0.5, -0.5])[:, None] * (attn.bool() & (torch.arange(T) >= 1)),
        old_logprobs_BT=torch.zeros(B, T),
        ref_logprobs_BT=torch.zeros(B, T),
    )


def test_rows_slices_every_field_and_trims_padding() -> None:
    b = _batch()
    mb = b.rows(0, 2)
    assert mb.num_rows == 2
    assert mb.input_ids_BT.shape == (2, 4)  # longest of rows 0-1 is 4 tokens
    assert torch.equal(mb.input_ids_BT, b.input_ids_BT[:2, :4])
    assert torch.equal(mb.advantages_BT, b.advantages_BT[:2, :4])
    assert b.replace(old_logprobs_BT=None).rows(0, 2).old_logprobs_BT is None
    assert b.rows(2, 3).input_ids_BT.shape == (1, 2)
