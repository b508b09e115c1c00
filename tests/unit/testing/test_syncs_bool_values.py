"""SyncCounter counts a boolean mask used as an index, not a boolean value written through integer indices
(``t[i, j] = v`` with a bool ``v`` reads nothing from the device; a Python ``True`` may still count as the
host scalar it is copied from, which is another kind)."""

from __future__ import annotations

import torch

from spmdrl.testing.syncs import SyncCounter


def _kinds(fn) -> list[str]:  # noqa: ANN001 - a test helper
    flags = torch.zeros(2, 3, dtype=torch.bool)  # made outside the counter: device tensors
    rows, cols = torch.tensor([0, 1]), torch.tensor([2, 0])
    with SyncCounter() as c:
        fn(flags, rows, cols)
    return [e.kind for e in c.events]


def test_a_bool_value_through_integer_indices_is_not_a_boolean_index() -> None:
    true = torch.tensor(True)  # made outside the counter: a device tensor
    assert _kinds(lambda f, r, c: f.index_put_((r, c), true)) == []
    assert _kinds(lambda f, r, c: f.__setitem__((r, c), true)) == []
    assert "bool_index" not in _kinds(lambda f, r, c: f.__setitem__((r, c), True))


def test_a_boolean_mask_as_the_index_still_is() -> None:
    assert _kinds(lambda f, r, c: f.__setitem__(f.clone(), True)) == ["bool_index"]
    assert _kinds(lambda f, r, c: f[f.clone()]) == ["bool_index"]
