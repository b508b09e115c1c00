"""spmdrl.testing.syncs.SyncCounter: each kind of sync it claims to see is counted, device-only work is not."""

from __future__ import annotations

import torch

from spmdrl.testing.syncs import SyncCounter

CPU = torch.device("cpu")


def _kinds(fn) -> list[str]:  # noqa: ANN001 - a test helper
    x = torch.arange(6.0).reshape(2, 3)  # made outside the counter: a device tensor
    with SyncCounter() as c:
        fn(c, x)
    return [e.kind for e in c.events]


def test_device_to_host_reads_are_counted() -> None:
    assert _kinds(lambda c, x: float(x.sum())) == ["item"]
    assert _kinds(lambda c, x: int(x[0, 0])) == ["item"]
    assert _kinds(lambda c, x: bool(x.sum() > 0)) == ["item"]
    assert _kinds(lambda c, x: x.tolist()) == ["tolist"]
    assert _kinds(lambda c, x: x.cpu()) == ["cpu"]
    assert _kinds(lambda c, x: torch.nonzero(x)) == ["nonzero"]
    assert _kinds(lambda c, x: x[x > 2]) == ["bool_index"]
    assert _kinds(lambda c, x: x.masked_select(x > 2)) == ["masked_select"]


def test_host_to_device_copies_are_counted() -> None:
    assert _kinds(lambda c, x: torch.arange(2).to(CPU)) == ["h2d"]
    assert _kinds(lambda c, x: torch.tensor([1.0, 2.0], device=CPU)) == ["h2d"]
    # A host index or value used on a device tensor is copied there first.
    assert _kinds(lambda c, x: x[torch.tensor([1, 0])]) == ["h2d"]
    assert _kinds(lambda c, x: x.__setitem__((0, slice(0, 2)), torch.tensor([1.0, 2.0]))) == ["h2d"]
    assert _kinds(lambda c, x: x + torch.ones(3)) == ["h2d"]


def test_what_does_not_wait_is_not_counted() -> None:
    # Device work, device factories, reads of host tensors, asynchronous moves, 0-dim host scalars.
    assert _kinds(lambda c, x: (x * 2).sum(dim=1).argmax()) == []
    assert _kinds(lambda c, x: torch.zeros(3, device=x.device) + torch.arange(3, device=x.device)) == []
    assert _kinds(lambda c, x: torch.tensor([3, 1]).tolist()) == []
    assert _kinds(lambda c, x: int(torch.tensor([3, 1]).sum())) == []
    assert _kinds(lambda c, x: x[torch.tensor([1, 0]).to(CPU, non_blocking=True)]) == []
    assert _kinds(lambda c, x: x * torch.tensor(2.0)) == []


def test_marked_host_tensors_and_their_results_stay_on_the_host() -> None:
    lengths = torch.tensor([3, 5])  # as if read from the device before the counter

    def fn(c: SyncCounter, x: torch.Tensor) -> None:
        c.mark_host(lengths)
        assert int((lengths + 1).max()) == 6
        lengths.tolist()

    assert _kinds(fn) == []


def test_the_summary_names_the_place() -> None:
    x = torch.ones(2)
    with SyncCounter() as c:
        float(x.sum())
    assert c.count() == c.count("item") == 1
    assert "test_syncs.py" in c.summary() and "item" in c.summary()
