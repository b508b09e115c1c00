"""What a vLLM engine is built with, decided from the config, the checkpoint and the host: its dtype,
its KV cache's size (and, at start, whether that fits), and how weight sync loads into it.

The job's start-up checks call these before any engine exists; :mod:`spmdrl.rollout.vllm_engine` calls
them again when it builds one.
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path

import torch

from spmdrl.errors import ConfigError
from spmdrl.models.memory_model import DecoderShape
from spmdrl.rollout import cpu_gemm
from spmdrl.rollout.config import RolloutConfig
from spmdrl.rollout.engine import KV_CACHE_SEQUENCES, check_kv_cache_tokens

log = logging.getLogger(__name__)

_DTYPES = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
}


def resolve_engine_dtype(name: str, device_type: str) -> torch.dtype:
    """``rollout.dtype`` as a torch dtype; "auto" is the fastest correct one for this device.

    CUDA: bfloat16. CPU: bfloat16 where the CPU computes it natively; elsewhere bf16 matmuls are
    emulated and float32 generation measured ~4.6x faster (2 cores, grpo_tiny's model), so float32.
    """
    if name != "auto":
        if name not in _DTYPES:
            raise ConfigError(f"rollout.dtype={name!r} is not one of auto, {', '.join(_DTYPES)}")
        return _DTYPES[name]
    if device_type == "cpu" and not cpu_gemm.cpu_has_native_bf16():
        return torch.float32
    return torch.bfloat16


def kv_cache_bytes(
    model_dir: Path, cfg: RolloutConfig, max_model_len: int, dtype: torch.dtype, device_type: str
) -> int | None:
    """vLLM's KV cache argument (bytes per rank) for ``rollout.kv_cache_tokens``, or None to size the
    cache from memory. vLLM divides it by a block's keys and values in every layer, so a decoder whose
    layers all attend over the whole sequence gets room for the tokens (rounded down to whole blocks;
    vLLM logs the capacity it made)."""
    if cfg.kv_cache_tokens == 0:
        return None
    check_kv_cache_tokens(cfg.kv_cache_tokens, max_model_len)
    shape = _decoder_shape(model_dir)
    itemsize = dtype.itemsize
    whole = cfg.kv_cache_tokens == KV_CACHE_SEQUENCES
    tokens = cfg.max_num_seqs * max_model_len if whole else cfg.kv_cache_tokens
    want = tokens * shape.kv_cache_bytes_per_token(itemsize, cfg.tp)
    if whole and device_type == "cuda":
        # What memory sizing would give at most: the engine's share of the card less its weights. Where the
        # sequences' cache is not well below it, memory sizing makes no cache much larger than needed, and
        # leaves vLLM its own accounting of activations and CUDA graphs.
        share = _engine_share(cfg, shape, itemsize)
        if want > share / 2:
            log.info(
                "rollout.kv_cache_tokens=-1: %d tokens (%.1f GiB) is not well below what memory sizing "
                "gives (%.1f GiB); the cache is sized from memory",
                tokens,
                want / 2**30,
                share / 2**30,
            )
            return None
    return want


@functools.lru_cache(maxsize=8)
def _decoder_shape(model_dir: Path) -> DecoderShape:
    """The checkpoint's decoder shape (its config.json), read once for the start-up checks and the build."""
    from transformers import AutoConfig

    return DecoderShape.from_hf(AutoConfig.from_pretrained(model_dir))


def _engine_share(cfg: RolloutConfig, shape: DecoderShape, itemsize: int) -> float:
    """Bytes of one card the engine's KV cache may take: ``gpu_memory_utilization`` of the card, less this
    rank's share of the weights."""
    return cfg.gpu_memory_utilization * torch.cuda.mem_get_info()[1] - shape.params * itemsize / cfg.tp


def check_kv_cache_fits(
    model_dir: Path, cfg: RolloutConfig, max_model_len: int, device_type: str, engines_on_node: int
) -> None:
    """Refuses, at start, a KV cache larger than the memory it would be allocated in; vLLM allocates what
    it is told, so such a cache fails only once the engine is built, after the warm-start: with the CUDA
    allocator's out-of-memory error, or on CPU (host memory) with the kernel's OOM killer, which prints
    nothing. CUDA: a set ``kv_cache_tokens`` against the engine's share of one card
    (``gpu_memory_utilization`` x the card, less this rank's share of the weights); memory sizing (0, and
    -1 where it falls back) never asks for more. CPU: the caches of the ``engines_on_node`` engine ranks
    of this node together against the memory the host has available now."""
    dtype = resolve_engine_dtype(cfg.dtype, device_type)
    want = kv_cache_bytes(model_dir, cfg, max_model_len, dtype, device_type)
    gib = 2**30
    if device_type == "cuda":
        if want is None:
            return
        shape, itemsize = _decoder_shape(model_dir), dtype.itemsize
        share = _engine_share(cfg, shape, itemsize)
        if want > share:
            raise ConfigError(
                f"rollout.kv_cache_tokens={cfg.kv_cache_tokens} needs {want / gib:.1f} GiB of KV cache on each "
                f"engine rank, more than the engine's share of the GPU: rollout.gpu_memory_utilization="
                f"{cfg.gpu_memory_utilization} x {torch.cuda.mem_get_info()[1] / gib:.1f} GiB less "
                f"{shape.params * itemsize / cfg.tp / gib:.1f} GiB of weights = {share / gib:.1f} GiB. Lower "
                "rollout.kv_cache_tokens (or set 0 to size the cache from memory, -1 for rollout.max_num_seqs "
                "whole sequences), or raise rollout.gpu_memory_utilization"
            )
        return
    per_rank = want if want is not None else int(cfg.cpu_kvcache_gib * gib)
    available = host_available_bytes()
    if available is None or per_rank * engines_on_node <= available:
        return
    setting = "rollout.kv_cache_tokens" if want is not None else "rollout.cpu_kvcache_gib"
    value = cfg.kv_cache_tokens if want is not None else cfg.cpu_kvcache_gib
    raise ConfigError(
        f"{setting}={value} gives each engine rank a {per_rank / gib:.2f} GiB KV cache in host memory; the "
        f"{engines_on_node} engine rank(s) on this node need {per_rank * engines_on_node / gib:.2f} GiB, "
        f"but the host has {available / gib:.2f} GiB available. Lower {setting} or run fewer ranks per node "
        "(rollout.kv_cache_tokens=-1 sizes the cache for rollout.max_num_seqs whole sequences)"
    )


def host_available_bytes() -> int | None:
    """The kernel's estimate of memory available to new allocations without swapping (``MemAvailable``
    in /proc/meminfo); None where there is no such file."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024  # kB
    except OSError:
        return None
    return None


def resolve_weight_load(
    setting: str, device_type: str, gemm_paths: dict[str, int], quantized: bool = False
) -> str:
    """rollout.weight_load for a built engine: "direct" where every linear layer computes from its live
    parameter (CUDA's unquantized layers; on CPU, the layers on the torch GEMM path), else "reload". A
    quantized checkpoint's layers compute from what vLLM's processing made of the weights, and on CPU a
    mixture of experts' fused-MoE layers from prepacked experts (cpu_gemm.MOE_PREPACKED): reload."""
    if quantized:
        reads_params = False
        why = "this checkpoint is quantized: its kernels compute from the processed weights"
    elif device_type == "cpu" and cpu_gemm.MOE_PREPACKED in gemm_paths:
        reads_params = False
        why = "this model's CPU fused-MoE layers compute from prepacked expert weights: set"
    else:
        reads_params = device_type != "cpu" or (bool(gemm_paths) and set(gemm_paths) <= {"torch", "none"})
        why = f"this engine's CPU GEMM paths {gemm_paths} compute from packed copies: set rollout.cpu_gemm=torch,"
    if setting == "direct" and not reads_params:
        raise ConfigError(
            "rollout.weight_load=direct writes the weights into the parameters the kernels read, but "
            f"{why} or rollout.weight_load=reload (or auto)"
        )
    if setting == "auto":
        return "direct" if reads_params else "reload"
    return setting
