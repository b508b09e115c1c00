"""RowLengths.of refuses rows that are not right-padded: the RL passes attend causally with no mask
(spmdrl.models.causal_attention), which is exact only when each row's padding follows all its tokens."""

from __future__ import annotations

import pytest
import torch

from spmdrl.rl.batch import RowLengths


def test_right_padded_rows_give_their_sizes() -> None:
    attn = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1], [1, 0, 0, 0]])
    resp = torch.tensor([[0, 1, 1, 0], [0, 0, 1, 1], [0, 0, 0, 0]])
    lengths = RowLengths.of(attn, resp)
    assert (lengths.tokens, lengths.first_response, lengths.response_tokens) == (
        [3, 4, 1],
        [1, 2, 4],
        [2, 2, 0],
    )


@pytest.mark.parametrize("row", [[0, 1, 1, 1], [1, 0, 1, 0]], ids=["left-padded", "a hole"])
def test_other_padding_is_refused(row: list[int]) -> None:
    attn = torch.tensor([[1, 1, 0, 0], row])
    resp = torch.zeros_like(attn)
    with pytest.raises(ValueError, match=r"rows \[1\] of this batch are not right-padded"):
        RowLengths.of(attn, resp)
