"""Count the points where a GPU program would make the CPU wait for the device, while it runs on a CPU.

A CUDA program is fast when the CPU queues kernels ahead of the GPU. Anything that needs a device value
on the host (``float(t)``, ``int(t)``, ``t.tolist()``, ``nonzero``, a boolean mask as an index) stops
the CPU until the GPU has finished everything queued before it, and a blocking copy of a host tensor
to the device (``idx.to(device)`` from pageable memory) waits for the stream too. On a CPU there is no
device and nothing waits, so these points cannot be timed there; they can be counted.

:class:`SyncCounter` is a context manager of two torch modes:

- a ``TorchDispatchMode`` for the device-to-host reads that go through ATen:
  ``aten._local_scalar_dense`` (``item``, ``float``, ``int``, ``bool`` of a tensor), ``nonzero`` /
  ``argwhere``, ``is_nonzero``, ``equal``, ``allclose``, ``masked_select``, ``unique``, a
  ``repeat_interleave`` with tensor repeats and no ``output_size``, and ``index`` / ``index_put`` with
  a boolean index (their output shape, or their work, depends on the data);
- a ``TorchFunctionMode`` for what does not reach ATen on a CPU (``tolist``, ``cpu`` and ``numpy`` of
  a CPU tensor read its memory directly) and for host-to-device copies. On a CPU every tensor is a
  host tensor, so the counter keeps a *model* of where each tensor would live on a GPU: a tensor made
  by a factory without a ``device`` argument (``torch.tensor(list)``, ``torch.arange(n)``), or computed
  only from such tensors, would be on the host; everything else (the model, the batch, tensors made
  with ``device=`` or from device tensors) on the device. Tensors the caller knows to be on the host
  (row indices built from host lengths) are marked with :meth:`SyncCounter.mark_host`. Counted: a host
  tensor moved with ``.to(device)`` (``non_blocking=True`` is not counted: from pinned memory it does
  not wait), a host tensor written into or used to index a device tensor, a host tensor of more than
  0 dimensions mixed with device tensors in one op (an implicit copy), and ``tolist`` / ``cpu`` /
  ``numpy`` of a device tensor.

What it cannot see: ``.to(torch.device("cpu"))`` of a device tensor (on a CPU it reads as the same
call as ``.to(device)``), and reads inside ATen kernels or other C++ code that call no Python and
dispatch nothing. On a GPU, ``torch.cuda.set_sync_debug_mode("error")`` is the complete check.
"""

from __future__ import annotations

import sys
import traceback
import weakref
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

aten = torch.ops.aten

# Ops whose result on the host is a device value (or whose output shape is one).
_READS = {
    aten._local_scalar_dense.default: "item",
    aten.nonzero.default: "nonzero",
    aten.argwhere.default: "nonzero",
    aten.is_nonzero.default: "is_nonzero",
    aten.equal.default: "equal",
    aten.allclose.default: "allclose",
    aten.masked_select.default: "masked_select",
    aten._unique2.default: "unique",
    aten.unique_dim.default: "unique",
    aten.unique_consecutive.default: "unique",
}
_BOOL_INDEX_OPS = {
    aten.index.Tensor,
    aten.index_put.default,
    aten.index_put_.default,
    aten._index_put_impl_.default,
}
_HOST_READ_METHODS = {torch.Tensor.tolist: "tolist", torch.Tensor.cpu: "cpu", torch.Tensor.numpy: "numpy"}
_FROM_DATA = {torch.tensor, torch.as_tensor}
_MOVES = {torch.Tensor.to, torch.Tensor.cuda}
_WRITES = {torch.Tensor.__setitem__, torch.Tensor.copy_, torch.Tensor.index_put_, torch.Tensor.index_copy_}


@dataclass
class SyncEvent:
    kind: str  # "item", "nonzero", ..., "tolist", "h2d"
    where: str  # the innermost caller frame outside torch: "file:line in function"


@dataclass
class SyncCounter:
    """``with SyncCounter() as c: ...`` then ``c.events`` / ``c.count()`` / ``c.summary()``."""

    events: list[SyncEvent] = field(default_factory=list)
    _host: dict[int, weakref.ref] = field(default_factory=dict)
    _modes: tuple[Any, ...] = ()

    # ------------------------------------------------------------------ host model

    def mark_host(self, *tensors: torch.Tensor) -> None:
        """These tensors live on the host in the GPU program (e.g. row indices from host lengths)."""
        for t in tensors:
            self._host[id(t)] = weakref.ref(t)

    def is_host(self, t: torch.Tensor) -> bool:
        ref = self._host.get(id(t))
        return ref is not None and ref() is t

    # ------------------------------------------------------------------ results

    def count(self, kind: str | None = None) -> int:
        return sum(1 for e in self.events if kind is None or e.kind == kind)

    def summary(self) -> str:
        """One line per (kind, place) with its count, most frequent first (for assertion messages)."""
        counts = Counter((e.kind, e.where) for e in self.events)
        return (
            "\n".join(f"{n:4d} x {kind:14s} {where}" for (kind, where), n in counts.most_common()) or "(none)"
        )

    def reset(self) -> None:
        self.events.clear()

    # ------------------------------------------------------------------ context

    def __enter__(self) -> SyncCounter:
        self._modes = (_FunctionMode(self), _DispatchMode(self))
        for m in self._modes:
            m.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        for m in reversed(self._modes):
            m.__exit__(*exc)
        self._modes = ()

    def _record(self, kind: str) -> None:
        self.events.append(SyncEvent(kind, _caller()))


def _caller() -> str:
    """The innermost frame that is not torch's nor this module's: where the sync is written."""
    here = __file__
    torch_dir = torch.__file__.rsplit("/", 1)[0]
    for frame in reversed(traceback.extract_stack(sys._getframe(2))):
        if frame.filename != here and not frame.filename.startswith(torch_dir):
            return f"{'/'.join(frame.filename.rsplit('/', 2)[-2:])}:{frame.lineno} in {frame.name}"
    return "?"


def _tensors(args: Any, kwargs: Any) -> list[torch.Tensor]:
    flat, _ = tree_flatten((args, kwargs or {}))
    return [x for x in flat if isinstance(x, torch.Tensor)]


def _gives_device(args: tuple, kwargs: dict) -> bool:
    """Whether a ``.to`` / ``.cuda`` call names a device (or a tensor to take it from)."""
    if "device" in kwargs or any(isinstance(a, torch.Tensor) for a in kwargs.values()):
        return True
    # (A bool is an int, but a positional bool is non_blocking, not a device index.)
    return any(
        isinstance(a, (torch.device, str, int, torch.Tensor)) and not isinstance(a, bool) for a in args[1:]
    )


class _FunctionMode(TorchFunctionMode):
    def __init__(self, counter: SyncCounter) -> None:
        super().__init__()
        self.c = counter

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        c = self.c
        inputs = _tensors(args, kwargs)
        host = [t for t in inputs if c.is_host(t)]
        device = [t for t in inputs if not c.is_host(t)]
        out = func(*args, **kwargs)
        if (
            func in _FROM_DATA
            and kwargs.get("device") not in (None, "cpu")
            and not (args and isinstance(args[0], torch.Tensor))
        ):
            c._record("h2d")  # built on the host from Python values, then copied to the device
            return out
        if func in _HOST_READ_METHODS:
            if args and not c.is_host(args[0]):
                c._record(_HOST_READ_METHODS[func])
            if isinstance(out, torch.Tensor):
                c.mark_host(out)
            return out
        if func in _MOVES:
            names_device = func is torch.Tensor.cuda or _gives_device(args, kwargs)
            if names_device and args and c.is_host(args[0]):
                if not kwargs.get("non_blocking", False):
                    c._record("h2d")
                # On a CPU the move returns the host tensor itself; the copy a GPU would make is a
                # device tensor, so it gets an object of its own (a view: same values, same autograd).
                return out.view_as(out) if out is args[0] else out
            if names_device:
                return out
        elif func in _WRITES or func is torch.Tensor.__getitem__:
            # A host value or host index tensor used on a device tensor is copied there first.
            if args and not c.is_host(args[0]) and host:
                c._record("h2d")
            if func in _WRITES:
                return out
        elif host and device and any(t.dim() > 0 for t in host):
            c._record("h2d")  # an op mixing host and device tensors copies the host ones
        # Where the result lives: on the host when made without a device from host tensors only.
        made_on_host = kwargs.get("device") in (None, "cpu") and not device
        if made_on_host:
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor):
                    c.mark_host(t)
        return out


def _bool_indices(args: tuple, kwargs: dict) -> bool:
    """Whether an index / index_put call indexes with a boolean mask. Only its indices count: the value
    ``t[i, j] = True`` writes is a bool tensor too, and reads nothing."""
    indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
    return any(isinstance(t, torch.Tensor) and t.dtype in (torch.bool, torch.uint8) for t in indices or ())


class _DispatchMode(TorchDispatchMode):
    def __init__(self, counter: SyncCounter) -> None:
        super().__init__()
        self.c = counter

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        c = self.c
        inputs = _tensors(args, kwargs)
        on_device = [t for t in inputs if not c.is_host(t)]
        if on_device:
            kind = _READS.get(func)
            if func is aten.repeat_interleave.Tensor and kwargs.get("output_size") is None:
                kind = "repeat_interleave"
            if func in _BOOL_INDEX_OPS and _bool_indices(args, kwargs):
                kind = "bool_index"
            if kind is not None:
                c._record(kind)
        return func(*args, **kwargs)
