"""Token-budget micro-batches (spmdrl/rl/micro_batches.py): balanced, and every row in exactly one."""

from __future__ import annotations

import torch


def test_token_budget_split_is_balanced_and_covers_every_row() -> None:
    from spmdrl.rl.micro_batches import balanced_split, micro_batch_rows, needed_parts

    lengths = torch.tensor([40, 3, 5, 38, 7, 12, 9, 30])
    parts = micro_batch_rows(lengths, micro_batch_size=2, token_budget=50)
    assert sorted(int(i) for p in parts for i in p) == list(range(8))
    assert len(parts) == needed_parts(lengths.tolist(), 50) == 3  # 144 tokens at 50 per micro-batch
    loads = [int(lengths[p].sum()) for p in parts]
    assert max(loads) - min(loads) <= 12, loads
    # Without a budget: fixed-size consecutive micro-batches (the default path, unchanged).
    assert [p.tolist() for p in micro_batch_rows(lengths, micro_batch_size=3)] == [
        [0, 1, 2],
        [3, 4, 5],
        [6, 7],
    ]
    # A sequence longer than the budget gets a micro-batch to itself.
    assert needed_parts([100, 2, 2], 50) == 3 and len(balanced_split([100, 2, 2], 2)) == 2
