"""The weight-sync check: the engine's kernels must return exactly the weights the trainer just sent.

Reading ``layer.weight`` back from the engine proves nothing: on CPU most GEMM paths compute from a
packed copy (:mod:`spmdrl.rollout.cpu_gemm`), and the failure this guards against is precisely a fresh
``weight`` beside a stale copy. So the check goes *through the kernels*: every linear layer (and LM head)
is applied to a few one-hot probe rows, which returns columns of the weight its kernel actually uses.
With one non-zero input the product is a single multiplication by 1, exact in any precision and
accumulation order, so the engine's answer equals the trainer's engine-dtype tensor bit for bit.
Embedding tables, norms and biases are read directly (their forward reads the tensor itself).

Per sync, both sides reduce what they saw to a few float64 numbers per *key* (a decoder layer index and
an input size, or a layer's 1-D tensors): the sum, the sum of squares and the sum of magnitudes of the
probed entries. Keys need no knowledge of how the engine merges or shards tensors (q/k/v into
qkv_proj, TP slices): columns of the same input index add up the same whichever way the rows are
grouped. The trainer side is computed from the full tensors while they stream into the engine (no extra
gather); the engine side is reduced over its TP group. The two must agree to float64 rounding; a stale
layer, a tensor that never arrived, or one loaded under the wrong name differ by whole weight updates.
The probed columns change with every sync, so over a run every column is checked.

On a GPU the sums stay on the device until the comparison: each side reads its fingerprint once, as one
small tensor, instead of three numbers per tensor. A read per tensor would stop the host until the GPU
had run everything queued before it, hundreds of times per sync (three per tensor on each side: about
1,400 for a 0.5B model), and on the trainer side, where the sums are taken while the weights stream
into the engine, it would also keep the host from queueing the next gather ahead of the load.

Mixture-of-experts layers are the exception to probing through kernels: vLLM's fused-MoE kernel applies
the experts' activation between their two matrices, so no probe returns a weight exactly, and on CPU it
computes from a prepacked copy of w13 / w2 (the parameter the kernel is handed, in a blocked layout). The
prepacking permutes each expert's elements (measured on vLLM 0.32's CPU kernels, fp32 and bf16), so the
check reads the parameter the kernel reads and compares sums that do not depend on the order: per layer
and expert, the sum, sum of squares and sum of magnitudes of its gate/up matrix and of its down matrix,
against the same sums of the per-expert tensors the trainer sent (:func:`expert_key`). A stale expert, one
that never arrived, or two experts swapped differ; a permutation *within* an expert's matrix (a layout the
kernel does not read) would not, so each expert is also probed through the kernel itself, within a slack
the trainer derives from the size of the kernel's rounding (:attr:`Fingerprint.slack`;
spmdrl.rollout.expert_probe).

The check's cost is host work per tensor, not arithmetic (a few thousand probed numbers per tensor), so
each tensor costs one operation: its probed columns, taken with one ``index_select`` whose index (one per
input size per sync) is built once; every sum is taken at the read, by one ``index_add_`` over all the
tensors added since the last read (:meth:`Fingerprint.values`). One-hot probe rows for the engine's
kernels are likewise built once per input size (:meth:`ProbeRows.get`).
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import numpy as np
import torch

from spmdrl.models.experts import expert_of
from spmdrl.transfer import to_device

# Probe columns per input size per sync: enough that a stale layer cannot hide in an unchanged column.
NUM_PROBE_COLUMNS = 4

_LAYER = re.compile(r"(?:^|\.)(?:layers|h|blocks)\.(\d+)\.")
# A vision-language model's vision tower (Idefics3's vision_model, in the trainer's names and the engine's):
# its layers get keys of their own, apart from the decoder's layers of the same index.
_VISION = re.compile(r"(?:^|\.)vision_model\.")


def _part(name: str) -> str:
    return "vision " if _VISION.search(name) else ""


def probe_columns(input_size: int, seed: int, num: int = NUM_PROBE_COLUMNS) -> list[int]:
    """The input columns probed for tensors of this input size at this sync; the same on every rank."""
    rng = np.random.default_rng([seed & 0xFFFFFFFF, input_size])
    return sorted({int(c) for c in rng.integers(0, input_size, size=min(num, input_size))})


# (Cached: the same few hundred names come back every sync, on both sides.)
@functools.lru_cache(maxsize=1 << 14)
def matrix_key(name: str, input_size: int) -> str:
    return f"{layer_of(name)}: matrices, input size {input_size}"


@functools.lru_cache(maxsize=1 << 14)
def vector_key(name: str) -> str:
    return f"{layer_of(name)}: vectors"


def layer_of(name: str) -> str:
    m = _LAYER.search(name)
    return f"{_part(name)}layer {m.group(1)}" if m else f"{_part(name)}top"


@functools.lru_cache(maxsize=1 << 14)
def whole_key(name: str) -> str:
    """A tensor of more than 2 dimensions that is no expert's (a vision tower's patch-embedding
    convolution): read directly and summed whole, on both sides."""
    return f"{layer_of(name)}: tensors of 3+ dimensions"


@functools.lru_cache(maxsize=1 << 16)
def expert_key(name: str, expert: int, part: str) -> str:
    """One expert's key: ``part`` "gate_up" (its gate and up matrices together, vLLM's w13) or "down"."""
    return f"{layer_of(name)}: expert {expert} {part}"


# An expert's outputs through the fused-MoE kernel (spmdrl.rollout.expert_probe): not exact, so compared
# within the slack the trainer derives from the size of the kernel's rounding (Fingerprint.slack).
_KERNEL_PART = "through its kernel"


@functools.lru_cache(maxsize=1 << 16)
def kernel_key(name: str, expert: int) -> str:
    return f"{layer_of(name)}: expert {expert} {_KERNEL_PART}"


def whole_sums(x: torch.Tensor, dims: tuple[int, ...] | None = None) -> torch.Tensor:
    """[sum, sum of squares, sum of |x|] of ``x`` in float64 (over ``dims``: one row per remaining index),
    kept on its device."""
    x = x.detach().to(torch.float64)
    if dims is None:
        return torch.stack([x.sum(), (x * x).sum(), x.abs().sum()])
    return torch.stack([x.sum(dims), (x * x).sum(dims), x.abs().sum(dims)], dim=-1)


class ProbeRows:
    """Per sync, the probe inputs each (input size, device) needs, built once and reused by every tensor of
    that input size: the probed columns' index (trainer side) and the one-hot rows (engine side)."""

    def __init__(self, seed: int) -> None:
        self.seed = seed
        self._index: dict[tuple[int, torch.device], torch.Tensor] = {}
        self._rows: dict[tuple[int, int, int, torch.dtype, torch.device], torch.Tensor] = {}

    def index(self, input_size: int, device: torch.device) -> torch.Tensor:
        """The probed columns of a tensor with this input size, as an index tensor on ``device``."""
        key = (input_size, device)
        if key not in self._index:
            cols = torch.tensor(probe_columns(input_size, self.seed), dtype=torch.long)
            self._index[key] = to_device(cols, device)
        return self._index[key]

    def get(
        self, input_size: int, local_size: int, start: int, dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        """One-hot rows for a layer whose input is columns ``start .. start + local_size`` of
        ``input_size`` (a TP slice, or all of it): row ``i`` selects probed column ``i`` where this rank
        holds it, and is zero where another rank does."""
        key = (input_size, local_size, start, dtype, device)
        if key not in self._rows:
            cols = probe_columns(input_size, self.seed)
            x = torch.zeros(len(cols), local_size, dtype=dtype)
            for row, c in enumerate(cols):
                if start <= c < start + local_size:
                    x[row, c - start] = 1
            self._rows[key] = to_device(x, device)
        return self._rows[key]


class Fingerprint:
    """Per key: [sum, sum of squares, sum of |x|] in float64, and the names that contributed.

    :meth:`add` keeps the probed values on their device, unreduced; :attr:`values` reduces all of them
    at once (one ``index_add_`` per device), reads the sums in one copy to the host and adds them to the
    keys' running totals.
    """

    def __init__(self) -> None:
        self.names: dict[str, list[str]] = {}
        self._totals: dict[str, list[float]] = {}
        # Added since the last read, not yet reduced: (key, how many times it counts, the probed values).
        self._pending: list[tuple[str, int, torch.Tensor]] = []
        # Sums already taken (whole experts, kernel probes): (key, times, the three numbers in float64,
        # the deviation rounding allows each of them or None).
        self._pending_sums: list[tuple[str, int, torch.Tensor, torch.Tensor | None]] = []
        # Per key whose numbers a kernel computes with rounding (an expert's probe through its kernel): how
        # far the engine's may deviate from these, from the size of that rounding (trainer side only).
        self._slack: dict[str, list[float]] = {}
        self._probes: ProbeRows | None = None

    def probes(self, seed: int) -> ProbeRows:
        """The probe inputs of the sync with this seed, shared by every tensor added under it."""
        if self._probes is None or self._probes.seed != seed:
            self._probes = ProbeRows(seed)
        return self._probes

    @property
    def values(self) -> dict[str, list[float]]:
        """Per key [sum, sum of squares, sum of |x|] (float64), every add so far included."""
        if self._pending:
            by_device: dict[torch.device, list[tuple[str, int, torch.Tensor]]] = {}
            for entry in self._pending:
                by_device.setdefault(entry[2].device, []).append(entry)
            self._pending = []
            for entries in by_device.values():
                for (key, times), sums in _segment_sums(entries):
                    acc = self._totals.setdefault(key, [0.0, 0.0, 0.0])
                    for i in range(3):
                        acc[i] += times * sums[i]
        if self._pending_sums:
            entries, self._pending_sums = self._pending_sums, []
            by_device_sums: dict[torch.device, list[tuple[str, int, torch.Tensor, torch.Tensor | None]]] = {}
            for entry in entries:
                by_device_sums.setdefault(entry[2].device, []).append(entry)
            for group in by_device_sums.values():
                # Each row: the three numbers and their slacks (0 where none), read in one copy per device.
                rows = torch.stack(
                    [torch.cat([s, sl if sl is not None else torch.zeros_like(s)]) for _, _, s, sl in group]
                ).tolist()
                for (key, times, _, sl), sums in zip(group, rows, strict=True):
                    acc = self._totals.setdefault(key, [0.0, 0.0, 0.0])
                    for i in range(3):
                        acc[i] += times * sums[i]
                    if sl is not None:
                        slack = self._slack.setdefault(key, [0.0, 0.0, 0.0])
                        for i in range(3):
                            slack[i] += times * sums[3 + i]
        return self._totals

    @property
    def slack(self) -> dict[str, list[float]]:
        """Per key probed through a kernel that rounds: the deviation of each of its three numbers that
        rounding allows (:meth:`add_sums`'s ``slack``), every add so far included."""
        _ = self.values  # (reduces what is pending, slacks included)
        return self._slack

    @values.setter
    def values(self, totals: dict[str, list[float]]) -> None:
        self._pending = []
        self._pending_sums = []
        self._totals = totals

    def add(self, key: str, name: str, probed: torch.Tensor, times: int = 1) -> None:
        """``probed``: the values this tensor contributes to ``key``, in any shape and float dtype;
        ``times``: how many engine layers compute from it (0: it counts elsewhere, the key still exists)."""
        self.names.setdefault(key, []).append(name)
        if times == 0:
            self._totals.setdefault(key, [0.0, 0.0, 0.0])
        else:
            # (detach only what has autograd history: each call is host time the check pays per tensor)
            probed = probed.detach() if probed.requires_grad else probed
            self._pending.append((key, times, probed.reshape(-1)))

    def add_sums(
        self, key: str, name: str, sums: torch.Tensor, times: int = 1, slack: torch.Tensor | None = None
    ) -> None:
        """Sums already taken (:func:`whole_sums`) for ``key``: an expert's, whose order the engine permutes.

        ``slack`` (three float64 numbers, trainer side): how far the engine's three numbers may each deviate
        from these, where the engine computes them with rounding (spmdrl.rollout.expert_probe)."""
        self.names.setdefault(key, []).append(name)
        if times == 0:
            self._totals.setdefault(key, [0.0, 0.0, 0.0])
        else:
            self._pending_sums.append((key, times, sums, slack))

    def add_matrix(self, name: str, full: torch.Tensor, seed: int, times: int = 1) -> None:
        """A trainer tensor (out x in): its probed columns, as a one-hot probe through a kernel returns them."""
        index = self.probes(seed).index(full.shape[1], full.device)
        full = full.detach() if full.requires_grad else full
        self.add(matrix_key(name, full.shape[1]), name, full.index_select(1, index), times)

    def add_vector(self, name: str, full: torch.Tensor, times: int = 1) -> None:
        # A copy: a streamed tensor is a view of its bucket's buffer, which the pending values would
        # otherwise keep alive until the read (every bucket of the sync at once).
        full = full.detach() if full.requires_grad else full
        self.add(vector_key(name), name, full.clone(), times)


def _segment_sums(
    entries: list[tuple[str, int, torch.Tensor]],
) -> list[tuple[tuple[str, int], list[float]]]:
    """[sum, sum of squares, sum of |x|] per (key, times) over the entries (all on one device), with
    one reduction and one read to the host."""
    segments: dict[tuple[str, int], int] = {}
    ids = [segments.setdefault((key, times), len(segments)) for key, times, _ in entries]
    lengths = [x.numel() for _, _, x in entries]
    device = entries[0][2].device
    # cat promotes mixed float dtypes (bfloat16 with float32 norms) exactly; float64 is exact for both.
    x = torch.cat([x for _, _, x in entries]).to(torch.float64)
    ids_and_lengths = to_device(torch.tensor([ids, lengths], dtype=torch.long), device)  # one copy
    segment_of = torch.repeat_interleave(
        ids_and_lengths[0],
        ids_and_lengths[1],
        output_size=sum(lengths),  # known here: no read of the repeats back from the device
    )
    sums = torch.zeros(len(segments), 3, dtype=torch.float64, device=device)
    sums.index_add_(0, segment_of, torch.stack([x, x * x, x.abs()], dim=1))
    return list(zip(segments, sums.tolist(), strict=True))  # the one read


def observe(
    weights: Iterable[tuple[str, torch.Tensor]], fp: Fingerprint, seed: int, times: dict[str, int]
) -> Iterator[tuple[str, torch.Tensor]]:
    """Pass (name, full tensor) pairs through unchanged, adding each to the trainer's fingerprint.

    ``times``: how many engine layers compute from one trainer tensor (a tied embedding serves the
    embedding lookup and the LM head: 2).
    """
    for name, t in weights:
        expert = expert_of(name)
        if expert is not None:
            fp.add_sums(expert_key(name, *expert), name, whole_sums(t), times.get(name, 1))
        elif t.dim() == 2:
            fp.add_matrix(name, t, seed, times.get(name, 1))
        elif t.dim() == 1:
            fp.add_vector(name, t, times.get(name, 1))
        elif t.dim() > 2:
            fp.add_sums(whole_key(name), name, whole_sums(t), times.get(name, 1))
        yield name, t


@dataclass(frozen=True)
class Divergence:
    key: str
    engine: tuple[float, float, float]
    trainer: tuple[float, float, float]
    engine_names: tuple[str, ...]
    trainer_names: tuple[str, ...]
    # A probe through a kernel: the deviation its rounding allowed each of the three numbers.
    allowed: tuple[float, float, float] | None = None

    def describe(self) -> str:
        e, t = self.engine, self.trainer
        if self.allowed is not None:
            values = (
                f"engine {e[0]:.6g}, {e[1]:.6g}, {e[2]:.6g} vs trainer {t[0]:.6g}, {t[1]:.6g}, {t[2]:.6g} "
                "(sum and two signed sums of its outputs; the kernel's rounding allows "
                f"{', '.join(f'{a:.3g}' for a in self.allowed)})"
            )
        else:
            values = f"engine sum {e[0]:.9g}, sum sq {e[1]:.9g} vs trainer sum {t[0]:.9g}, sum sq {t[1]:.9g}"
        return (
            f"  {self.key}: {values}\n    engine layers: {', '.join(self.engine_names) or '(none)'}\n"
            f"    trainer tensors: {', '.join(self.trainer_names) or '(none)'}"
        )


def compare(engine: Fingerprint, trainer: Fingerprint, tol: float) -> list[Divergence]:
    """Keys whose sums differ by more than ``tol`` times their sum of magnitudes (or exist on one side only).

    Exact kernels agree to float64 rounding (about 1e-16 relative); ``tol`` leaves room for kernels
    that round their output (TF32 matmuls, say) while staying far below one optimizer update. An expert's
    probe through its kernel is compared number by number within the trainer's :attr:`Fingerprint.slack`
    (or ``tol`` of its largest number, where wider).
    """
    out = []
    for key in sorted(engine.values.keys() | trainer.values.keys()):
        e = engine.values.get(key, [0.0, 0.0, 0.0])
        t = trainer.values.get(key, [0.0, 0.0, 0.0])
        allowed: tuple[float, float, float] | None = None
        if key.endswith(_KERNEL_PART):
            # Within the rounding the trainer computed for each number (a key it lacks allows none), or
            # ``tol`` of the largest number where that is wider (a quantized engine's raised tolerance).
            largest = max(max(abs(x) for x in e), max(abs(x) for x in t))
            slack = trainer.slack.get(key, [0.0, 0.0, 0.0])
            allowed = (
                max(tol * largest, slack[0]),
                max(tol * largest, slack[1]),
                max(tol * largest, slack[2]),
            )
            differs = any(abs(a - b) > m for a, b, m in zip(e, t, allowed, strict=True))
        else:
            scale = max(e[2], t[2], 1e-30)
            sq_scale = max(e[1], t[1], 1e-30)
            differs = abs(e[0] - t[0]) > tol * scale or abs(e[1] - t[1]) > tol * sq_scale
        if differs:
            out.append(
                Divergence(
                    key,
                    (e[0], e[1], e[2]),
                    (t[0], t[1], t[2]),
                    tuple(engine.names.get(key, [])),
                    tuple(trainer.names.get(key, [])),
                    allowed,
                )
            )
    return out


class WeightSyncError(RuntimeError):
    """The engine does not serve the weights the trainer sent."""


def sync_error(divergences: list[Divergence], step_label: str, limit: int = 6) -> WeightSyncError:
    shown = "\n".join(d.describe() for d in divergences[:limit])
    more = f"\n  ... and {len(divergences) - limit} more" if len(divergences) > limit else ""
    return WeightSyncError(
        f"weight sync check failed {step_label}: the rollout engine's kernels do not return the weights the "
        f"trainer sent ({len(divergences)} of the checked groups differ; one-hot probes through each "
        f"layer, see spmdrl/rollout/fingerprint.py):\n{shown}{more}\n"
        "Likely causes: a CPU GEMM path that keeps a packed copy of a weight the reload did not rebuild "
        "(try rollout.cpu_gemm=torch, which reads the weights directly, and report the vLLM version and "
        "CPU); a direct load (rollout.weight_load=direct, auto's choice on CUDA and on the CPU torch path) "
        "that this vLLM release's weight loaders do not write in place (try rollout.weight_load=reload); "
        "trainer parameter names that do not map onto the engine's (spmdrl.rollout.weight_sync."
        "engine_name); a vLLM release outside the supported range. Rollouts from this engine would "
        "not come from the policy being trained, so the run stops. rollout.weight_sync_check=false "
        "turns the check off (for debugging only)."
    )
