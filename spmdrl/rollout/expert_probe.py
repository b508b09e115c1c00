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
by ~0.23% of their L2 norm (measured on tiny-moe: a float64 reference that rounds the same two places
matches the kernel exactly for most experts; a float32 engine: ~2e-7). The three reduced numbers are
+-1-weighted sums of the outputs, so their error is of that size too, but they themselves cancel at
random: the largest of the three was as small as 0.085 of the outputs' norm (3,200 expert probes), so a
tolerance relative to them cannot work (2% of the largest failed a bf16 engine's clean syncs for about
one expert probe in 450). The trainer, which has the exact outputs, instead derives each number's slack
from the size of the roundings it adds up (:func:`rounding_slack`). Measured (tiny-moe, 5 weight sets x
40 check seeds, 3,200 expert probes per dtype): each number's deviation from the trainer's is 0.17 (bf16)
and 0.084 (float32) of its rounding unit in standard deviation, 0.71 and 0.36 at most; the slack,
:data:`KERNEL_TOL` = 3 units (about 4% of the outputs' norm in bf16, 8e-6 in float32), is 17 and 36
standard deviations. A layout the kernel misreads gives the outputs of other weights, which differ by
about the outputs' own norm: an expert's elements in reverse order (tiny-moe's sizes, 20 seeds) moved
its numbers by 24-86 times the bf16 slack (median 45) and ~2e5 times the float32 one.
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


def rounding_slack(
    down: torch.Tensor, h: torch.Tensor, y: torch.Tensor, s: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """How far each of a kernel's three reduced numbers (:func:`reduce_outputs`) may deviate from the
    exact ones: float64, shape (3,), on the device. ``down``: (outputs, width); ``h``: (width, rows), the
    intermediate; ``y = down @ h``; ``s``: the signs.

    The kernel rounds each output and each intermediate value to ``dtype`` (relative error up to eps/2)
    and accumulates the width's products in float32. A reduced number weights the outputs by ``w`` (ones,
    or the signs), so its error is a sum of independent roundings, of the order of eps times
    ``size = sqrt(sum y^2 + sum_ij down_ij^2 h_j^2 + sum_j (w @ down)_j^2 h_j^2)`` (summed over the rows),
    whatever the reduced number itself (they cancel at random). The first two terms are what the outputs'
    rounding acts on, on one rank (``y``) or as the partial outputs of a TP-sliced kernel (whose squares
    sum to about the second term); the third is the intermediate's rounding carried through ``down`` to
    this number (for the plain sum, ``ones @ down`` is as large as ``down``'s columns are one-signed).
    The slack is :data:`KERNEL_TOL` times eps (plus float32's accumulation over the width) times ``size``.
    """
    unit = _input_eps(dtype, down.device) + torch.finfo(torch.float32).eps * math.sqrt(down.shape[1])
    h_sq = h.square().sum(1)  # (width,): over the rows
    # (A reduction over down's columns: no squared copy of the matrix.)
    outputs = y.square().sum() + torch.linalg.vector_norm(down, dim=0).square() @ h_sq
    weights = torch.cat([torch.ones_like(s[:1]), s])  # (3, outputs): how each number weights the outputs
    intermediate = (weights @ down).square() @ h_sq
    return KERNEL_TOL * unit * (outputs + intermediate).sqrt()


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
            kernel_key(name, e),
            name,
            reduce_outputs(y_HR.T, s),
            slack=rounding_slack(down, h, y_HR, s, t.dtype),
        )


def observe_experts(
    weights: Iterable[tuple[str, torch.Tensor]], outputs: ExpertOutputs
) -> Iterator[tuple[str, torch.Tensor]]:
    """Pass (name, full tensor) pairs through unchanged, adding each expert's probe outputs to ``outputs``."""
    for name, t in weights:
        outputs.add(name, t)
        yield name, t
