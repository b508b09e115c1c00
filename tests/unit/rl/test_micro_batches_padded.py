"""Token budgets over padded micro-batches (spmdrl/rl/micro_batches.py, trainer.pack_sequences=false): a
padded micro-batch costs rows x its longest row, so the budget bounds that, not the rows' tokens."""

from __future__ import annotations

import torch

from spmdrl.rl.micro_batches import micro_batch_rows, needed_padded_parts, padded_split

LENGTHS = [40, 3, 5, 38, 7, 12, 9, 30]


def _padded_cost(rows: list[int]) -> int:
    return len(rows) * max(LENGTHS[i] for i in rows)


def test_padded_budget_bounds_rows_times_the_longest_row() -> None:
    parts = [
        p.tolist()
        for p in micro_batch_rows(torch.tensor(LENGTHS), micro_batch_size=2, token_budget=80, padded=True)
    ]
    assert sorted(i for p in parts for i in p) == list(range(8))
    assert all(_padded_cost(p) <= 80 for p in parts), parts
    # Sorted longest first: 40+38 | 30+12 | 9, 7, 5, 3 (80, 60, 36 padded tokens): three micro-batches, and
    # split into three with the largest as small as runs allow (76: 38 and 30 together).
    assert needed_padded_parts(LENGTHS, 80) == 3
    assert parts == [[0], [3, 7], [1, 2, 4, 5, 6]]
    # The tokens-only split packs the long rows with short ones: padded, one of its parts costs more.
    even = [p.tolist() for p in micro_batch_rows(torch.tensor(LENGTHS), micro_batch_size=2, token_budget=80)]
    assert max(_padded_cost(p) for p in even) > 80


def test_padded_split_fills_the_agreed_count_and_isolates_long_rows() -> None:
    # A rank that needs fewer micro-batches than the group's count halves its costliest ones.
    assert padded_split([10] * 8, 4) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    # A row longer than the budget goes alone, the short ones together.
    assert needed_padded_parts([100, 2, 2, 2, 2, 2], 50) == 2
    assert padded_split([100, 2, 2, 2, 2, 2], 2) == [[0], [1, 2, 3, 4, 5]]
    assert padded_split([5], 1) == [[0]]
