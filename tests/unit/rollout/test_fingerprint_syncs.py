"""The weight-sync check reads each side's fingerprint from the device once, not once per tensor.

On a GPU each read stops the host until the device has run everything queued; the trainer side takes its
sums while the weights stream into the engine, so a read per tensor also kept the host from queueing the
next gather. Counted on CPU with spmdrl.testing.syncs.SyncCounter (tensors made before it model device
tensors), for the trainer's pass-through (``observe``) over a small decoder's tensors, and the values
checked against the per-tensor float64 sums the check is defined by.

The check's cost is host work per tensor (on the H200, 33 ms of a 130 ms sync for a small model), so
each tensor also costs a fixed, small number of operations, and the sums one reduction whatever the count.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from spmdrl.rollout.fingerprint import Fingerprint, matrix_key, observe, probe_columns, vector_key
from spmdrl.testing.syncs import SyncCounter


def _decoder_tensors(layers: int = 3) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    out = {"model.embed_tokens.weight": torch.randn(96, 32, generator=g)}
    for i in range(layers):
        pre = f"model.layers.{i}."
        out |= {
            pre + "self_attn.q_proj.weight": torch.randn(32, 32, generator=g),
            pre + "self_attn.q_proj.bias": torch.randn(32, generator=g),
            pre + "mlp.down_proj.weight": torch.randn(32, 64, generator=g),
            pre + "input_layernorm.weight": torch.randn(32, generator=g),
        }
    return out | {"model.norm.weight": torch.randn(32, generator=g)}


def _reference(tensors: dict[str, torch.Tensor], seed: int, times: dict[str, int]) -> dict[str, list[float]]:
    """The definition: per key, the float64 sums of the probed entries, tensor by tensor."""
    out: dict[str, list[float]] = {}
    for name, t in tensors.items():
        if t.dim() == 2:
            key, x = matrix_key(name, t.shape[1]), t[:, probe_columns(t.shape[1], seed)]
        else:
            key, x = vector_key(name), t
        x = x.double()
        acc = out.setdefault(key, [0.0, 0.0, 0.0])
        n = times.get(name, 1)
        for i, v in enumerate((x.sum(), (x * x).sum(), x.abs().sum())):
            acc[i] += n * float(v)
    return out


def test_trainer_fingerprint_reads_the_device_once() -> None:
    tensors = _decoder_tensors()  # made before the counter: device tensors in its model
    times = {"model.embed_tokens.weight": 2}  # a tied embedding: lookup and LM head
    fp = Fingerprint()
    with SyncCounter() as c:
        passed = list(observe(tensors.items(), fp, 5, times))
        during = c.count()
        values = fp.values
        after = c.count()
        again = fp.values  # already read: nothing more
    assert [n for n, _ in passed] == list(tensors)
    assert during == 0, c.summary()
    assert after == 1, c.summary()
    assert c.count() == 1 and again is values

    expected = _reference(tensors, 5, times)
    assert values.keys() == expected.keys()
    for key, want in expected.items():
        assert values[key] == pytest.approx(want, rel=1e-13, abs=1e-13), key
    assert fp.names["top: matrices, input size 32"] == ["model.embed_tokens.weight"]


def test_adds_after_a_read_join_the_totals() -> None:
    a, b = torch.randn(8, 16), torch.randn(8, 16)
    fp = Fingerprint()
    fp.add_matrix("model.layers.0.o_proj.weight", a, 1)
    first = list(fp.values["layer 0: matrices, input size 16"])
    fp.add_matrix("model.layers.0.up_proj.weight", b, 1, times=0)  # counted nowhere, the key kept
    fp.add_matrix("model.layers.0.up_proj.weight", b, 1)
    both = fp.values["layer 0: matrices, input size 16"]
    want = _reference({"x.layers.0.a": a, "x.layers.0.b": b}, 1, {})["layer 0: matrices, input size 16"]
    assert both == pytest.approx(want, rel=1e-13) and both != first
    assert fp.names["layer 0: matrices, input size 16"] == [
        "model.layers.0.o_proj.weight",
        "model.layers.0.up_proj.weight",
        "model.layers.0.up_proj.weight",
    ]


class _OpCount(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        self.ops += 1
        return func(*args, **(kwargs or {}))


def _trainer_ops(layers: int) -> tuple[int, int, int]:
    """(tensors, operations while they stream past, operations of the read)."""
    tensors = _decoder_tensors(layers)
    fp = Fingerprint()
    with _OpCount() as streaming:
        list(observe(tensors.items(), fp, 5, {}))
    with _OpCount() as read:
        values = fp.values
    expected = _reference(tensors, 5, {})
    assert values.keys() == expected.keys()
    assert all(values[k] == pytest.approx(v, rel=1e-13) for k, v in expected.items())
    return len(tensors), streaming.ops, read.ops


def test_each_tensor_costs_at_most_two_operations_and_the_read_a_fixed_number() -> None:
    """Per streamed tensor, one operation takes its probed values (and at most one view); every sum is
    taken at the read, by operations whose number does not grow with the tensors (a sum per tensor cost
    about ten: slicing, stacking, casting, squaring, reducing)."""
    small_n, small_ops, small_read = _trainer_ops(3)
    big_n, big_ops, big_read = _trainer_ops(12)
    assert big_n - small_n == 36
    assert big_ops - small_ops <= 2 * (big_n - small_n), (small_ops, big_ops)
    assert big_read == small_read
