"""The weight-sync check's probe through a mixture of experts' kernel (spmdrl.rollout.fingerprint).

An expert's whole-matrix sums prove its elements arrived, in any order; they cannot see them in the wrong
order (a loader that wrote a layout the kernel does not read, a prepacking the reload skipped). So each
expert is also run through the engine's own fused-MoE kernel: one-hot rows at a few probed input columns,
routed to that expert alone with weight 1, give ``down @ (silu(gate[:, c]) * up[:, c])`` per column c.
The trainer computes the same from the tensors it sent, in float64.

Each side reduces an expert's outputs to three numbers that are *linear* in them, the sum and two sums
under fixed random signs per output index, so the partial outputs of a TP-sliced kernel add up over the
ranks like the other keys.

Unlike a linear layer's probe this is not exact. vLLM 0.32's CPU kernel computes in float32 but rounds
the intermediate ``silu(gate) * up`` and each output to the engine dtype; in bf16 that moves the outputs
by ~0.23% of their L2 norm (measured on tiny-moe; a float32 engine: ~2e-7). The three reduced numbers
are random-sign sums of the outputs, so their error is of that size too, but they themselves cancel at
random: the largest of the three was as small as 0.085 of the outputs' norm (3,200 expert probes), so a
tolerance relative to them cannot work (a bf16 engine's clean syncs failed 2% of the largest number for
about one expert probe in 450). The trainer, which has the exact outputs, instead derives each key's slack
from the size the rounding acts on (:func:`rounding_slack`): ``KERNEL_TOL * unit * size``, with
``size = sqrt(sum y^2 + sum_ij down_ij^2 h_j^2)`` and ``unit`` the dtype's eps plus float32's accumulation
over the width. Measured (tiny-moe, 3,200 expert probes per dtype, 5 weight sets x 40 check seeds): each
reduced number's deviation from the trainer's is 0.21 (bf16) and 0.10 (float32) of ``unit * size`` in
standard deviation, 0.87 and 0.43 at most; the slack, 3 units, is 14 and 29 standard deviations. A
layout the kernel misreads gives the outputs of other weights, which differ by about the outputs' own
norm: an expert's elements in reverse order (tiny-moe's sizes, 20 seeds) moved the largest of the three
numbers by 28-108 times the bf16 slack (median 55) and ~3e5 times the float32 one.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator

import numpy as np
import torch

from spmdrl.models.experts import matrix_of
from spmdrl.rollout.fingerprint import Fingerprint, kernel_key, probe_columns

# The slack of an expert's probe through its kernel, in units of the rounding's size (:func:`rounding_slack`).
KERNEL_TOL = 3.0


def signs(size: int, seed: int, device: torch.device) -> torch.Tensor:
    """Two rows of fixed random +-1 over ``size`` outputs (float64); the same on every rank and side."""
    rng = np.random.default_rng([seed & 0xFFFFFFFF, size, 7])
    return torch.from_numpy(rng.integers(0, 2, size=(2, size)) * 2.0 - 1.0).to(device)


def reduce_outputs(y_RH: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """[sum, signed sum, signed sum] of an expert's probe outputs (rows: probed columns), in float64."""
    y_H = y_RH.detach().to(torch.float64).sum(0)
    return torch.stack([y_H.sum(), (y_H * s[0]).sum(), (y_H * s[1]).sum()])


def rounding_slack(down: torch.Tensor, h: torch.Tensor, y: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """How far a kernel's reduced numbers may deviate from the exact ones (float64, 0-d, on the device).

    The kernel rounds each output ``y = down @ h`` and each intermediate ``h`` to ``dtype`` (relative
    error up to eps/2 each) and accumulates the width's products in float32. Each reduced number is a
    +-1-weighted sum of the outputs, so its error is a sum of those roundings with random signs: of the
    order of eps times ``size = sqrt(sum y^2 + sum_ij down_ij^2 h_j^2)``, whatever the reduced numbers
    themselves (they cancel at random: as small as a tenth of ``|y|`` measured). ``size`` is what the
    outputs' rounding (the first term) and the intermediate's, carried through ``down`` (the second)
    act on; it covers a TP-sliced kernel too, whose partial outputs, each rounded, add up to ``y`` (the
    partials' squares sum to about the second term). The slack is :data:`KERNEL_TOL` such units.
    """
    unit = _input_eps(dtype, down.device) + torch.finfo(torch.float32).eps * math.sqrt(down.shape[1])
    size = (y.square().sum() + (down.square() @ h.square()).sum()).sqrt()
    return KERNEL_TOL * unit * size


def _input_eps(dtype: torch.dtype, device: torch.device) -> float:
    """The relative spacing of the numbers the kernel multiplies: the engine dtype's, except float32 off
    the CPU, which a GPU's fused-MoE kernel may round to TF32 (Triton's default for float32 dot products;
    not measured here)."""
    if dtype == torch.float32 and device.type != "cpu":
        return 2.0**-10
    return torch.finfo(dtype).eps


def engine_rows(hidden: int, experts: int, seed: int, dtype: torch.dtype, device: torch.device):  # noqa: ANN201
    """The kernel's probe inputs for a layer of ``experts`` local experts: one-hot rows at the probed
    columns, expert by expert, each routed to its expert alone with weight 1 (x, topk_weights, topk_ids)."""
    cols = probe_columns(hidden, seed)
    k = len(cols)
    x = torch.zeros(experts * k, hidden, dtype=dtype)
    for e in range(experts):
        for i, c in enumerate(cols):
            x[e * k + i, c] = 1
    ids = torch.arange(experts, dtype=torch.int32).repeat_interleave(k)[:, None]
    weights = torch.ones(experts * k, 1, dtype=torch.float32)
    return x.to(device), weights.to(device), ids.to(device), k


class ExpertOutputs:
    """Trainer side: each expert's probe outputs from the matrices the sync streams (its gate and up
    columns kept until its down matrix arrives), added to ``fp`` under :func:`kernel_key`."""

    def __init__(self, fp: Fingerprint, seed: int) -> None:
        self.fp, self.seed = fp, seed
        self._columns: dict[tuple[str, int, str], torch.Tensor] = {}

    def add(self, name: str, t: torch.Tensor) -> None:
        found = matrix_of(name)
        if found is None:
            return
        prefix, e, proj = found
        if proj != "down_proj":
            cols = torch.tensor(probe_columns(t.shape[1], self.seed), device=t.device)
            self._columns[(prefix, e, proj)] = t.detach().index_select(1, cols).to(torch.float64)
            return
        gate = self._columns.pop((prefix, e, "gate_proj"), None)
        up = self._columns.pop((prefix, e, "up_proj"), None)
        if gate is None or up is None:
            return  # the check's whole sums name the expert whose matrices did not all arrive
        h = torch.nn.functional.silu(gate) * up  # (width, probed columns)
        down = t.detach().to(torch.float64)
        y_HR = down @ h
        s = signs(t.shape[0], self.seed, t.device)
        self.fp.add_sums(
            kernel_key(name, e), name, reduce_outputs(y_HR.T, s), slack=rounding_slack(down, h, y_HR, t.dtype)
        )


def observe_experts(
    weights: Iterable[tuple[str, torch.Tensor]], outputs: ExpertOutputs
) -> Iterator[tuple[str, torch.Tensor]]:
    """Pass (name, full tensor) pairs through unchanged, adding each expert's probe outputs to ``outputs``."""
    for name, t in weights:
        outputs.add(name, t)
        yield name, t
