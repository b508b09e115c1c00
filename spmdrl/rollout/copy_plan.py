"""The direct weight load replayed as batched copies (rollout.weight_load=direct, after its first sync).

A direct load runs the engine model's own ``load_weights``: for each tensor, vLLM's Python finds the
parameter, its weight loader narrows the parameter (its place in a merged qkv / gate_up tensor, its TP
slice) and the tensor, and copies one into the other. That Python is most of the load's time on a GPU
(the H200 sync: 57 ms to load 717 MB that a device copy moves in under a millisecond). What it does is
the same at every sync: the same views of the same parameters take the same views of tensors of the same
layout.

So the first direct load runs the loaders under a :class:`torch.overrides.TorchFunctionMode` that records,
per incoming name, each ``copy_`` into a parameter: the destination view itself, and the source as a
view (offset, sizes, strides) of the incoming tensor. Later loads rebuild the sources on the new tensors
and copy everything with ``torch._foreach_copy_``, a few batched copies per flush instead of a loader call
per tensor. A name whose load did anything else (a source that is not a view of its tensor, a write other
than ``copy_`` into a parameter, such as the vocabulary padding an embedding's loader zeroes) keeps its
loader, as does a tensor whose layout differs from the recorded one. The weight-sync check, which probes
every layer through its kernels after each load, covers the replay as it covers the loaders; under
rollout.weight_load=auto a failed check falls back to vLLM's reload, which drops the plan.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

# Pending copies are flushed once their sources hold this many bytes: a tensor gathered for the load stays
# alive until its copy runs, so the batch is bounded like the sync's own buckets.
FLUSH_BYTES = 256 * 2**20


@dataclass(frozen=True)
class _SourceView:
    """Where a copy's source sits in its incoming tensor: ``as_strided`` of the tensor's storage."""

    offset: int  # from the incoming tensor's own storage offset, in elements
    size: tuple[int, ...]
    stride: tuple[int, ...]

    def of(self, t: torch.Tensor) -> torch.Tensor:
        return t.as_strided(self.size, self.stride, t.storage_offset() + self.offset)


@dataclass(frozen=True)
class _Layout:
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device

    @classmethod
    def of(cls, t: torch.Tensor) -> _Layout:
        return cls(tuple(t.shape), tuple(t.stride()), t.dtype, t.device)


@dataclass
class _Entry:
    layout: _Layout
    copies: list[tuple[torch.Tensor, _SourceView]] = field(default_factory=list)
    replayable: bool = True
    why: str = ""  # why not replayable


def _storage(t: torch.Tensor) -> int | None:
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):  # a tensor subclass or a meta tensor: not a parameter's
        return None


def _last(t: torch.Tensor) -> int:
    """The storage offset of ``t``'s last element, from its first (0 for an empty tensor)."""
    return sum((n - 1) * st for n, st in zip(t.shape, t.stride(), strict=True) if n > 0)


def _within(src: torch.Tensor, t: torch.Tensor) -> bool:
    """Whether ``src`` is a view of ``t``'s elements (the same storage and dtype, inside ``t``'s span), so
    that the same view of the next sync's tensor is its source."""
    storage = _storage(src)
    if src.dtype != t.dtype or storage is None or storage != _storage(t):
        return False
    start = src.storage_offset() - t.storage_offset()
    return start >= 0 and start + _last(src) <= _last(t)


def _in_place(name: str) -> bool:
    """A torch in-place op's name (``fill_``, ``mul_``), not a dunder (``__get__``, a property read)."""
    return name.endswith("_") and not name.startswith("__")


class _Recorder(TorchFunctionMode):
    """Records the current tensor's copies into parameters; marks it unreplayable on anything else that
    writes a parameter."""

    def __init__(self, param_storages: set[int]) -> None:
        super().__init__()
        self.param_storages = param_storages
        self.entry: _Entry | None = None
        self.tensor: torch.Tensor | None = None
        # Off while the next tensor is produced: that is the trainer's code (its gathers), not the loader's.
        self.active = False

    def __torch_function__(
        self, func: Callable[..., Any], types: Any, args: tuple = (), kwargs: dict | None = None
    ) -> Any:
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        entry, t = self.entry, self.tensor
        first = args[0] if args else None
        if self.active and entry is not None and t is not None and isinstance(first, torch.Tensor):
            writes_param = _storage(first) in self.param_storages
            if name == "copy_" and writes_param:
                src = args[1] if len(args) > 1 else kwargs.get("src")
                if isinstance(src, torch.Tensor) and _within(src, t):
                    view = _SourceView(
                        src.storage_offset() - t.storage_offset(), tuple(src.shape), tuple(src.stride())
                    )
                    # The destination as the loader narrowed it: the same view of the parameter every sync.
                    entry.copies.append((first.detach(), view))
                else:
                    entry.replayable = False
                    entry.why = "a copy from outside the tensor"
            elif writes_param and (_in_place(name) or name in ("__setitem__", "__set__")):
                entry.replayable = False
                entry.why = f"{name} into a parameter"
        return func(*args, **kwargs)


class CopyPlan:
    """Per incoming name, the copies the model's loaders made of it (see the module docstring)."""

    def __init__(self, entries: dict[str, _Entry]) -> None:
        self.entries = entries

    @property
    def replayed_names(self) -> int:
        return sum(e.replayable for e in self.entries.values())

    @classmethod
    def record(
        cls, model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]], load: Callable[[Iterable], Any]
    ) -> CopyPlan:
        """``load(weights)`` (the model's ``load_weights``), recording each tensor's copies."""
        storages = {_storage(p) for p in model.parameters()} | {_storage(b) for b in model.buffers()}
        recorder = _Recorder(storages)
        entries: dict[str, _Entry] = {}

        def tracked() -> Iterator[tuple[str, torch.Tensor]]:
            source = iter(weights)
            while True:
                recorder.active = False
                item = next(source, None)
                if item is None:
                    break
                name, t = item
                # Copies are attributed to the tensor pulled last: a loader that copied a tensor only after
                # pulling the next would record a source outside that one, and its name keeps the loader.
                recorder.entry = entries[name] = _Entry(_Layout.of(t))
                recorder.tensor = t
                recorder.active = True
                yield name, t
            recorder.entry = recorder.tensor = None

        with recorder:
            load(tracked())
        for entry in entries.values():
            entry.replayable = entry.replayable and bool(entry.copies)
        return cls(entries)

    def load(self, weights: Iterable[tuple[str, torch.Tensor]], load: Callable[[Iterable], Any]) -> int:
        """Every tensor of ``weights`` into the model: the recorded copies, batched, for names that have
        them and arrive in the recorded layout, ``load([(name, tensor)])`` for the others. Returns how many
        tensors took the loader."""
        dst: list[torch.Tensor] = []
        src: list[torch.Tensor] = []
        held: list[torch.Tensor] = []  # the incoming tensors whose copies are pending
        pending = 0
        through_loader = 0

        def flush() -> None:
            nonlocal pending
            if dst:
                torch._foreach_copy_(dst, src)
            dst.clear()
            src.clear()
            held.clear()
            pending = 0

        for name, t in weights:
            entry = self.entries.get(name)
            if entry is None or not entry.replayable or _Layout.of(t) != entry.layout:
                flush()  # in order: a loader's copy after the batched ones that precede it
                load([(name, t)])
                through_loader += 1
                continue
            for d, view in entry.copies:
                dst.append(d)
                src.append(view.of(t))
            held.append(t)
            pending += t.numel() * t.element_size()
            if pending >= FLUSH_BYTES:
                flush()
        flush()
        return through_loader
