"""Low-precision rollout (``rollout.quantization``): which of vLLM's online quantizations run where, and the
weight-sync check's tolerance for an engine that serves a quantized copy of the trainer's weights.

With ``rollout.quantization=fp8`` the trainer keeps its own precision and sends the same tensors as
always; vLLM quantizes each linear layer's weight as it loads it (per tensor, e4m3, scale = amax / 448,
over the merged qkv / gate_up tensors), at the engine's build and at every sync (its in-place reload
re-runs the quantization, so spmdrl reloads rather than loading directly). The price is a larger gap
between the engine's logprobs and the trainer's, which ``algorithm.rollout_correction`` absorbs
(docs/rollout.md#low-precision-rollout).

What runs where was measured on vLLM 0.32's CPU build and is refused before anything is built:

- fp8 on a CPU: the online fp8 path calls ``static_scaled_fp8_quant``, which vLLM's CPU build does not
  compile (it is declared with no arguments there); the engine would fail mid-build.
- ``int8_per_channel_weight_only`` (vLLM's MoE-only online int8) is not offered: on a CPU without AMX
  its only kernel is zentorch's, whose outputs stayed partly those of the old experts after an in-place
  reload (the weight-sync check's probe through the kernel failed on tiny-moe), and on AMX CPUs and
  GPUs it was not measured.

On a CPU the lower-precision engine is ``rollout.dtype=bfloat16`` with the trainer in float32
(``model.param_dtype=float32``, the CPU default): the check stays exact, since the engine computes from
the bf16 tensors the trainer sends.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass

from spmdrl.errors import ConfigError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Method:
    """One value of ``rollout.quantization``: where it runs, and how closely the engine's kernels return
    the weights the trainer sent."""

    name: str
    devices: tuple[str, ...]
    # The weight-sync check's smallest tolerance for this engine (relative to the probed weights' sum of
    # magnitudes): a quantized layer returns its weight rounded to the format, not the trainer's tensor.
    check_tol: float
    # Why a device not in ``devices`` cannot run it, and what to use there instead.
    elsewhere: str


# e4m3 keeps 3 mantissa bits: each weight rounds by up to 1/16 of itself (1/32 relative on average). The
# check's sums over a layer's probed columns (thousands of entries) average those errors out to ~1e-3 of
# the sum of magnitudes; 2e-2 stays well above that and well below a wrong weight (a doubled or zeroed
# tensor moves the sums by 100%, a tensor from another layer by as much as the tensors differ). A stale
# weight is caught when the update moved it by more than fp8's rounding; a smaller one the engine's
# kernels could not represent anyway.
FP8_CHECK_TOL = 2e-2

METHODS = {
    "fp8": Method(
        "fp8",
        ("cuda",),
        FP8_CHECK_TOL,
        "vLLM's CPU build has no fp8 kernels (its online fp8 path calls static_scaled_fp8_quant, which the "
        "CPU build does not compile); on a CPU the lower-precision engine is rollout.dtype=bfloat16 with "
        "the trainer in float32 (model.param_dtype=float32, the CPU default)",
    ),
}

_SIXTEEN_BIT = ("bfloat16", "float16")


def check_quantization(quantization: str, engine_dtype: str, device_type: str) -> None:
    """Refuse a ``rollout.quantization`` this device cannot run, before anything is built.

    ``engine_dtype``: the engine's resolved dtype's name (``bfloat16``, ``float16``, ``float32``)."""
    if quantization == "none":
        return
    method = METHODS.get(quantization)
    if method is None:
        raise ConfigError(
            f"rollout.quantization={quantization!r} is not one of none, {', '.join(METHODS)} "
            "(docs/rollout.md#low-precision-rollout)"
        )
    if device_type not in method.devices:
        raise ConfigError(
            f"rollout.quantization={quantization} cannot run on {device_type}: {method.elsewhere}; "
            "set rollout.quantization=none"
        )
    if engine_dtype not in _SIXTEEN_BIT:
        raise ConfigError(
            f"rollout.quantization={quantization} quantizes from a 16-bit engine, but rollout.dtype resolves "
            f"to {engine_dtype}: set rollout.dtype=bfloat16"
        )


@functools.cache  # called at every sync; logged once
def check_tol(quantization: str, configured: float) -> float:
    """The weight-sync check's tolerance: ``rollout.weight_sync_check_tol``, raised to the quantized
    engine's rounding where ``rollout.quantization`` is set. Computed once and logged."""
    if quantization == "none":
        return configured
    tol = max(configured, METHODS[quantization].check_tol)
    if tol != configured:
        log.info(
            "weight sync check tolerance %.3g (rollout.quantization=%s rounds each weight; "
            "rollout.weight_sync_check_tol=%.3g)",
            tol,
            quantization,
            configured,
        )
    return tol
