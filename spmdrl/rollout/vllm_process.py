"""What building vLLM in the trainer's process changes, and what is done about it.

The engine (:mod:`spmdrl.rollout.vllm_engine`) runs vLLM inside each rank's process; these are the
guards around its import, its construction and each call into it:

- the RNGs (python, numpy, torch CPU/CUDA): vLLM reseeds them at init and its CPU sampler draws from the
  global torch RNG on every step. The trainer's random stream must not depend on how much was generated
  (exact resume), so construction and each generate run inside a saved-and-restored RNG state, and
  every request carries its own seed instead (which also keeps TP ranks sampling identically even if
  the trainer consumed different amounts of randomness on them).
- on CPU, ``CPUWorker.init_device`` replaces ``torch.set_num_threads`` with a no-op (it assumes a
  thread-pinned worker process, which in-process execution never does), and vLLM sets torch's thread
  count for serving (on CUDA too: ``set_torch_threads_for_runtime`` in 0.32's ``Worker.load_model``
  drops it to 1 unless ``OMP_NUM_THREADS`` is set); both are restored.
- on CPU with tp >= 2, the names of the TP all-reduce's shared-memory segments: vLLM derives them from
  the init method, the same ``env://`` for every ``external_launcher`` job, so two jobs on one machine
  (or one after a killed one) would collide; :mod:`spmdrl.rollout.cpu_shm` names them per build.
- process-wide settings (:class:`SettingsSwap`): ``Worker.__init__`` calls
  ``torch.set_float32_matmul_precision(VLLM_FLOAT32_MATMUL_PRECISION)`` ("highest" unless set), which
  would take TF32 away from a trainer that enabled it; importing ``vllm.platforms.cuda`` calls
  ``torch.backends.cuda.enable_cudnn_sdp(False)``; ``EngineCore.__init__`` and the GPU worker's warm-up
  call ``gc.freeze()``, after which cyclic garbage among the objects alive then (the trainer's included)
  is never collected, and the worker's shutdown calls ``gc.unfreeze()``, which would undo the job's own
  startup freeze. The trainer's values come back after construction, vLLM's are put in place for each
  generate, and vLLM's freezes and unfreezes do nothing around its import, build and teardown
  (:func:`spmdrl.gc_heap.inert_freezes`).
- harmless, left alone: ``set_default_torch_dtype`` (vLLM restores it), ``torch._dynamo.config``
  changes (restored by vLLM's context managers, or made only when the flex-attention backend is
  imported), env vars set at ``import vllm`` (``vllm/env_override.py``: ``PYTORCH_NVML_BASED_CUDA_CHECK``,
  which only changes how torch counts devices, ``TORCHINDUCTOR_COMPILE_THREADS=1``, which a trainer's later ``torch.compile`` reads only if
  ``torch._inductor.config`` was not imported yet; spmdrl does not compile) and at engine build (vLLM's
  own ``VLLM_*`` settings, and ``NCCL_GRAPH_REGISTER=0`` by default with sleep mode and CUDA graphs,
  which concerns NCCL calls captured in CUDA graphs; the trainer captures none).
"""

from __future__ import annotations

import contextlib
import os
import random
import sys
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch

from spmdrl.gc_heap import inert_freezes


def prepare_environment() -> None:
    """Env vars vLLM reads at import / engine build; must be set before ``import vllm``."""
    # The engine core runs inside this process (external_launcher requires it, and a spawned engine-core
    # process would need a __main__ guard in every user script).
    if os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "0") != "0" and "vllm" in sys.modules:
        raise RuntimeError(
            "vllm was imported with VLLM_ENABLE_V1_MULTIPROCESSING != 0; spmdrl runs vLLM in-process: "
            "unset it (or set it to 0) before importing vllm"
        )
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    # vLLM logs every weight reload and prefix-cache reset at INFO: once per RL step per rank. Keep
    # the training log readable; a user who wants them sets VLLM_LOGGING_LEVEL=INFO.
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")


@contextlib.contextmanager
def isolated_rng(device_type: str) -> Iterator[None]:
    """Run vLLM code without it moving the trainer's random streams."""
    py_state, np_state = random.getstate(), np.random.get_state()
    devices = [torch.cuda.current_device()] if device_type == "cuda" else []
    # fork_rng saves the CPU generator and, for the listed devices, the CUDA ones.
    with torch.random.fork_rng(devices=devices, device_type="cuda"):
        try:
            yield
        finally:
            random.setstate(py_state)
            np.random.set_state(np_state)


@contextlib.contextmanager
def keep_thread_settings() -> Iterator[None]:
    set_num_threads, num_threads = torch.set_num_threads, torch.get_num_threads()
    try:
        yield
    finally:
        torch.set_num_threads = set_num_threads  # type: ignore[assignment]
        torch.set_num_threads(num_threads)


@dataclass(frozen=True)
class ProcessSettings:
    """The process-wide torch settings vLLM changes in the process that builds it (see the module doc)."""

    # torch.backends.{cuda,mkldnn}.matmul.fp32_precision, which torch.set_float32_matmul_precision sets
    # (None on a torch without the per-backend API).
    matmul_fp32: tuple[str, str] | None
    # torch.get_float32_matmul_precision(); None where the per-backend API was used (the legacy getter
    # then raises "mix of the legacy and new APIs").
    matmul_legacy: str | None
    cudnn_sdp: bool

    @classmethod
    def current(cls) -> ProcessSettings:
        cuda_mm, mkldnn_mm = torch.backends.cuda.matmul, torch.backends.mkldnn.matmul
        fp32 = getattr(cuda_mm, "fp32_precision", None)
        try:
            legacy: str | None = torch.get_float32_matmul_precision()
        except RuntimeError:
            legacy = None
        return cls(
            None if fp32 is None else (fp32, mkldnn_mm.fp32_precision),
            legacy,
            torch.backends.cuda.cudnn_sdp_enabled(),
        )

    def apply(self) -> None:
        # Through the API that set it: assigning the per-backend values after the legacy setter was used
        # makes the legacy getter raise for the rest of the process, and the legacy setter cannot express
        # per-backend values. "none" everywhere is torch's untouched state, which only assignment restores.
        untouched = self.matmul_fp32 == ("none", "none")
        if self.matmul_fp32 is not None and (self.matmul_legacy is None or untouched):
            torch.backends.cuda.matmul.fp32_precision, torch.backends.mkldnn.matmul.fp32_precision = (
                self.matmul_fp32
            )
        elif self.matmul_legacy is not None:
            torch.set_float32_matmul_precision(self.matmul_legacy)
        torch.backends.cuda.enable_cudnn_sdp(self.cudnn_sdp)


class SettingsSwap:
    """The trainer's and vLLM's :class:`ProcessSettings`, each in place while its own code runs.

    Create it before vLLM is imported (importing ``vllm.platforms.cuda`` already disables cuDNN SDPA).
    """

    def __init__(self) -> None:
        self.trainer = ProcessSettings.current()
        self.engine = self.trainer

    @contextlib.contextmanager
    def building(self) -> Iterator[None]:
        """Around the engine's construction: record vLLM's settings, then put the trainer's back.

        EngineCore.__init__ and the GPU worker's warm-up freeze every live object (freeze_gc_heap,
        vllm/utils/gc_utils.py), the trainer's models included, to shorten vLLM's full collections; here
        those freezes (and the unfreezes paired with them) do nothing, so what the trainer froze stays
        frozen and nothing more is (spmdrl.gc_heap)."""
        try:
            with inert_freezes():
                yield
        finally:
            self.engine = ProcessSettings.current()
            self.trainer.apply()

    @contextlib.contextmanager
    def engine_call(self) -> Iterator[None]:
        """Around a call into vLLM: its settings inside, the trainer's current ones back afterwards."""
        trainer = ProcessSettings.current()
        self.engine.apply()
        try:
            yield
        finally:
            trainer.apply()
