"""The weight-sync check's probe through a mixture of experts' kernel (spmdrl.rollout.fingerprint).

An expert's whole-matrix sums prove its elements arrived, in any order; they cannot see them in the wrong
order (a loader that wrote a layout the kernel does not read, a prepacking the reload skipped). So each
expert is also run through the engine's own fused-MoE kernel: one-hot rows at a few probed input columns,
routed to that expert alone with weight 1, give ``down @ (silu(gate[:, c]) * up[:, c])`` per column c.
The trainer computes the same from the tensors it sent, in float64. Unlike a linear layer's probe this is
not exact (the kernel rounds the activation and sums over the expert's width), so these keys are compared
with a relative tolerance (spmdrl.rollout.fingerprint.KERNEL_TOL) far above rounding (fp32 ~1e-6, bf16 ~1e-3 of the values)
and far below what a scrambled layout gives (the outputs of other weights: differences of their own size).

Each side reduces an expert's outputs to three numbers that are *linear* in them, the sum and two sums
under fixed random signs per output index, so the partial outputs of a TP-sliced kernel add up over the
ranks like the other keys.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import numpy as np
import torch

from spmdrl.models.experts import matrix_of
from spmdrl.rollout.fingerprint import Fingerprint, kernel_key, probe_columns


def signs(size: int, seed: int, device: torch.device) -> torch.Tensor:
    """Two rows of fixed random +-1 over ``size`` outputs (float64); the same on every rank and side."""
    rng = np.random.default_rng([seed & 0xFFFFFFFF, size, 7])
    return torch.from_numpy(rng.integers(0, 2, size=(2, size)) * 2.0 - 1.0).to(device)


def reduce_outputs(y_RH: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """[sum, signed sum, signed sum] of an expert's probe outputs (rows: probed columns), in float64."""
    y_H = y_RH.detach().to(torch.float64).sum(0)
    return torch.stack([y_H.sum(), (y_H * s[0]).sum(), (y_H * s[1]).sum()])


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
        y_HR = t.detach().to(torch.float64) @ h
        s = signs(t.shape[0], self.seed, t.device)
        self.fp.add_sums(kernel_key(name, e), name, reduce_outputs(y_HR.T, s))


def observe_experts(
    weights: Iterable[tuple[str, torch.Tensor]], outputs: ExpertOutputs
) -> Iterator[tuple[str, torch.Tensor]]:
    """Pass (name, full tensor) pairs through unchanged, adding each expert's probe outputs to ``outputs``."""
    for name, t in weights:
        outputs.add(name, t)
        yield name, t
