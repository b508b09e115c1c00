"""vLLM's CPU GEMM paths: which one each linear layer uses, forcing one, and refreshing packed copies.

On CPU, vLLM gives every unquantized linear layer (and every embedding, for its use as a tied LM head) a
``cpu_linear`` chosen once, when the layer's weights are processed
(``dispatch_cpu_unquantized_gemm`` in ``vllm/model_executor/layers/utils.py``):

- ``zentorch``: ``zentorch_linear_unary`` on AMD Zen CPUs when the zentorch package is installed
  (weights prepacked by default);
- ``sgl``: sgl-kernel ``weight_packed_linear`` for small bf16 weights on CPUs with AMX;
- ``onednn``: a oneDNN matmul handle (the weight reordered into the handle);
- ``torch``: ``torch.nn.functional.linear`` on ``layer.weight`` (the fallback).

All but ``torch`` compute from a *copy* of the weight made at that moment: writing ``layer.weight`` later
changes nothing the forward reads. vLLM's in-place reload re-processes every layer that receives
weights, which rebuilds that copy; a layer that receives none keeps its old copy. A tied LM head is
such a layer: it shares the embedding's tensor, which the reload updates, but is never re-processed, so
its packed copy keeps serving the *initial* output projection. :func:`refresh_unprocessed` re-dispatches
those layers after every reload; the weight-sync check (:mod:`spmdrl.rollout.fingerprint`) proves the
result on every sync.

Which path vLLM picks depends on the CPU (AMX, AVX512-BF16, AMD Zen) and on installed packages, so a test
that only runs vLLM's own choice covers one path per machine. ``rollout.cpu_gemm`` forces one path in
this process (:func:`force_cpu_gemm`), so every path can be tested on any x86 machine that can run it,
and a user can route around a path that misbehaves.
"""

from __future__ import annotations

import contextlib
import logging
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from spmdrl.errors import ConfigError
from spmdrl.rollout.config import CPU_GEMM_PATHS

log = logging.getLogger(__name__)

# The free variable each packed path's cpu_linear closes over (vLLM 0.32's dispatch code), and the path
# it identifies. The torch fallback closes over nothing: it reads the weight it is passed.
_CLOSURE_MARKERS = {"packed_weight": "sgl", "handler": "onednn", "zen_weight": "zentorch"}

# The path forced in this process ("auto": vLLM's own choice), and vLLM's dispatch function it wraps.
_forced = "auto"
_original_dispatch: Callable[[nn.Module, bool], None] | None = None


def cpu_has_native_bf16() -> bool:
    """AVX512-BF16 or AMX: the CPUs whose bf16 GEMMs (oneDNN, sgl, zentorch) run natively, not emulated."""
    return bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())


def gemm_path(layer: nn.Module) -> str:
    """The CPU GEMM path ``layer``'s ``cpu_linear`` runs ("none" if it has none)."""
    fn = getattr(layer, "cpu_linear", None)
    if fn is None:
        return "none"
    if fn is torch.nn.functional.linear:
        return "torch"
    code = getattr(fn, "__code__", None)
    names = set(code.co_freevars) if code is not None else set()
    for marker, path in _CLOSURE_MARKERS.items():
        if marker in names:
            return path
    return "torch" if code is not None and "linear" in code.co_names else "unknown"


# The "path" of a fused mixture-of-experts layer on CPU: vLLM's CPU experts prepack w13 / w2 into their
# grouped-GEMM layout when the weights are processed (rollout.cpu_gemm does not choose it).
MOE_PREPACKED = "moe_prepacked"


def gemm_paths(model: nn.Module) -> dict[str, int]:
    """How many layers use each path (the engine logs it once; tests assert a forced path was taken), and
    how many fused-MoE layers (:data:`MOE_PREPACKED`)."""
    paths = Counter(gemm_path(m) for m in model.modules() if hasattr(m, "cpu_linear"))
    experts = sum(1 for m in model.modules() if "w13_weight" in m._parameters)
    if experts:
        paths[MOE_PREPACKED] = experts
    return dict(paths)


def _sgl_shape_ok(n: int, k: int, dtype: torch.dtype) -> bool:
    """vLLM's sgl-kernel constraints without its AMX and 1 MiB conditions (those choose, these must hold).

    bf16 only: the fp16 brgemm needs AMX-FP16 (it aborts elsewhere) and the kernel has no fp32 weights.
    """
    return dtype == torch.bfloat16 and (n < 16 or (k % 32 == 0 and n % 16 == 0))


@contextlib.contextmanager
def _only(path: str) -> Iterator[None]:
    """vLLM's dispatch with every path but ``path`` switched off (module globals, restored after)."""
    import vllm._custom_ops as ops
    from vllm.model_executor.layers import utils
    from vllm.platforms import current_platform

    saved = (utils.check_cpu_sgl_kernel, ops._supports_onednn, current_platform.is_zen_cpu)
    utils.check_cpu_sgl_kernel = _sgl_shape_ok if path == "sgl" else (lambda n, k, dtype: False)
    ops._supports_onednn = path == "onednn"
    is_zen = path == "zentorch"
    current_platform.is_zen_cpu = lambda: is_zen  # type: ignore[method-assign]
    try:
        yield
    finally:
        utils.check_cpu_sgl_kernel, ops._supports_onednn = saved[0], saved[1]
        current_platform.is_zen_cpu = saved[2]  # type: ignore[method-assign]


def _dispatch(layer: nn.Module, remove_weight: bool) -> None:
    assert _original_dispatch is not None
    if _forced == "auto":
        _original_dispatch(layer, remove_weight)
        return
    with _only(_forced):
        _original_dispatch(layer, remove_weight)


def unavailable_reason(path: str, dtype: torch.dtype | None = None) -> str | None:
    """Why this process cannot run ``path`` (for an engine of ``dtype``, if given); None if it can.

    Decided from the CPU flags and installed packages, without building an engine; the one place that
    knows, for the config check below and for the tests that pick which paths to run.
    """
    if path not in CPU_GEMM_PATHS:
        return f"rollout.cpu_gemm={path!r} is not one of {', '.join(CPU_GEMM_PATHS)}"
    if path == "sgl" and not cpu_has_native_bf16():
        # Its bf16 brgemm needs one of them; elsewhere it aborts the process inside the kernel.
        return (
            "rollout.cpu_gemm=sgl needs a CPU with AVX512-BF16 or AMX (this one has neither); vLLM never "
            "picks sgl here: use auto, onednn or torch"
        )
    if path == "onednn":
        if dtype == torch.bfloat16 and not torch.cpu._is_avx512_supported():
            # oneDNN has no bf16 matmul below AVX-512: vLLM's handle fails and it quietly takes torch's path.
            return (
                "rollout.cpu_gemm=onednn with a bfloat16 engine needs a CPU with AVX-512 (oneDNN has no bf16 "
                "matmul on this one; vLLM would fall back to torch): use rollout.dtype=float32 (auto picks it "
                "here) or cpu_gemm=auto or torch"
            )
        import vllm._custom_ops as ops

        if not ops._supports_onednn:
            return "rollout.cpu_gemm=onednn: this vLLM build has no oneDNN kernels; use auto or torch"
    if path == "zentorch":
        try:
            import zentorch  # noqa: F401
        except ImportError as e:
            return (
                f"rollout.cpu_gemm=zentorch needs the zentorch package ({e}); install the build that "
                f"matches torch {torch.__version__.split('+')[0]} (pip install 'zentorch=={_zentorch_pin()}', "
                "or spmdrl's cpu-amd extra) or use auto, onednn or torch"
            )
        if not hasattr(torch.ops.zentorch, "zentorch_linear_unary"):
            return "rollout.cpu_gemm=zentorch: zentorch is installed but has no linear op"
        if dtype == torch.bfloat16 and not cpu_has_native_bf16():
            # zentorch refuses at the first matmul ("bf16 path needs the cpu support avx512bf16").
            return (
                "rollout.cpu_gemm=zentorch with a bfloat16 engine needs a CPU with AVX512-BF16 (this one "
                "lacks it): use rollout.dtype=float32 (auto picks it here), or cpu_gemm=auto, onednn or torch"
            )
    return None


def check_available(path: str, dtype: torch.dtype | None = None) -> None:
    """Raise ConfigError if ``path`` cannot run in this process (before an engine is built on it)."""
    reason = unavailable_reason(path, dtype)
    if reason is not None:
        raise ConfigError(reason)


def _zentorch_pin() -> str:
    major_minor = ".".join(torch.__version__.split("+")[0].split(".")[:2])
    return f"{major_minor}.*"


def force_cpu_gemm(path: str, dtype: torch.dtype | None = None) -> None:
    """Make vLLM's CPU dispatch use ``path`` for every 2-D weight it processes from now on in this process.

    Layers the path cannot take (sgl: shapes that are not whole tiles, or a float32 engine) fall back to
    torch, as in vLLM. ``auto`` restores vLLM's own choice. Call before the engine is built.
    """
    global _forced, _original_dispatch
    check_available(path, dtype)
    from vllm.model_executor.layers import utils

    if _original_dispatch is None:
        _original_dispatch = utils.dispatch_cpu_unquantized_gemm
        # linear.py and vocab_parallel_embedding.py import the function from this module at call time,
        # so replacing the module attribute reaches every layer processed from now on.
        utils.dispatch_cpu_unquantized_gemm = _dispatch
    _forced = path


def redispatch(layer: nn.Module) -> None:
    """Rebuild ``layer``'s ``cpu_linear`` from its current weight, keeping the weight (the forced path if any)."""
    from vllm.model_executor.layers import utils

    utils.dispatch_cpu_unquantized_gemm(layer, False)


def avoid_zentorch_moe() -> None:
    """Keep vLLM's CPU experts off zentorch's fused MoE, in this process; call before the engine is built.

    Where zentorch is installed on an AMD Zen CPU, vLLM 0.32 runs the experts with ``zentorch_fused_moe``
    on the unpacked weights. Measured here (zentorch 2.13.0.2): after an in-place reload of new expert
    weights its outputs stay those of the old ones, though the parameters hold the new weights (the
    weight-sync check's probe through the kernel failed for every expert, the whole sums agreed), so a
    synced engine would generate from stale experts. The experts take vLLM's own CPU grouped-GEMM path
    instead (prepacked; :func:`forget_moe_kernels` makes each reload prepack them again)."""
    from vllm.model_executor.layers.fused_moe.experts import cpu_moe

    cpu_moe.is_zentorch_moe_supported = lambda layer: False
    cpu_moe.is_zentorch_moe_config_supported = lambda moe_config: False


def forget_moe_kernels(model: nn.Module) -> int:
    """Make the next reload process every CPU fused-MoE layer as a first load; returns how many.

    vLLM 0.32's unquantized fused-MoE method treats a reload as a weight update once its kernel exists
    (``moe_kernel`` set: ``UnquantizedFusedMoEMethod._setup_kernel``) and then skips the CPU experts'
    ``process_weights_after_loading``, their prepacking: the reloaded experts would be copied unpacked into
    the tensors the kernel reads packed, and generation would run on scrambled experts. Without its kernel
    the layer is processed as at the engine's build: padded, prepacked, a new kernel, and the reload copies
    the packed result into the kernel's tensors. (The weight-sync check's per-expert sums cannot see a
    layout error within an expert; tests/integration/test_moe.py's parity after a sync does.)"""
    n = 0
    for m in model.modules():
        method = getattr(m, "quant_method", None)
        kernel = getattr(method, "moe_kernel", None)
        if "w13_weight" in m._parameters and kernel is not None and _cpu_experts(kernel):
            method.moe_kernel = None  # type: ignore[union-attr]
            n += 1
    return n


def _cpu_experts(kernel: Any) -> bool:
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts

    return isinstance(getattr(kernel, "fused_experts", None), CPUUnquantizedExperts)


def snapshot(model: nn.Module) -> dict[int, Any]:
    """Each layer's current ``cpu_linear`` (by module id): compared after a reload to find layers it skipped."""
    return {id(m): m.cpu_linear for m in model.modules() if hasattr(m, "cpu_linear")}


def refresh_unprocessed(model: nn.Module, before: dict[int, Any]) -> list[str]:
    """Re-dispatch the layers a reload did not re-process (same ``cpu_linear`` as ``before``).

    Returns their names. A layer whose weight vLLM removed after packing (``remove_weight``) cannot be
    rebuilt; reaching one means the reload sent it nothing, which VLLMEngine.load_weights rules out by
    name, so it is an error here rather than a silently stale layer.
    """
    refreshed = []
    for name, m in model.named_modules():
        fn = getattr(m, "cpu_linear", None)
        if fn is None or before.get(id(m)) is not fn:
            continue
        w = getattr(m, "weight", None)
        if w is None or w.dim() != 2 or w.numel() == 0 or w.is_meta:
            if gemm_path(m) == "torch":
                continue  # reads layer.weight at run time: nothing to refresh
            raise RuntimeError(
                f"engine layer {name} was not reloaded and its packed weight ({gemm_path(m)}) cannot be "
                "rebuilt: the weight sync sent it nothing"
            )
        redispatch(m)
        refreshed.append(name)
    return refreshed
