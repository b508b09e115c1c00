"""vLLM inside every rank's process (``distributed_executor_backend="external_launcher"``).

Every rank builds the engine and calls every method, or, with ``build_engine(ranks=...)``, every rank of a
block does, vLLM's world then being that block (:mod:`spmdrl.rollout.engine_ranks`).
``tp`` consecutive ranks form one engine: they all-gather their prompts (:mod:`spmdrl.rollout.groups`),
each runs the same scheduler on the same requests, and each keeps its own slice of the results.

What building vLLM in the trainer's process changes, and what is done about it:
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
- process-wide settings (:class:`_SettingsSwap`): ``Worker.__init__`` calls
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

Sleep mode (CUDA only, ``rollout.free_cache_engine``): ``sleep()`` drops the KV cache, and the weights
either to host memory (``keep_weights=True``, vLLM level 1) or for good (``keep_weights=False``, level 2:
the next engine call must be ``load_weights``, and ``generate`` raises until it has run).
``load_weights`` wakes only the weights, ``generate`` wakes the rest, ``close`` wakes everything first.
On CPU vLLM's worker has nothing to free, so the calls are skipped (logged once).
"""

from __future__ import annotations

import contextlib
import functools
import gc
import logging
import os
import random
import sys
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from spmdrl.errors import ConfigError
from spmdrl.gc_heap import inert_freezes
from spmdrl.models.memory_model import DecoderShape
from spmdrl.rollout import cpu_gemm, cpu_shm, vllm_worker
from spmdrl.rollout.config import RolloutConfig
from spmdrl.rollout.engine import (
    KV_CACHE_SEQUENCES,
    Generation,
    LoadSeconds,
    SamplingSpec,
    TurnOutput,
    check_kv_cache_tokens,
    check_model_runner,
    check_prompt_lengths,
    request_seed,
)
from spmdrl.rollout.engine_ranks import EngineWorld
from spmdrl.rollout.fingerprint import Fingerprint
from spmdrl.rollout.groups import TPGroups
from spmdrl.rollout.vllm_version import require_supported_vllm

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


def _prepare_environment() -> None:
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
def _isolated_rng(device_type: str) -> Iterator[None]:
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


def _seed_sampler(seed: int, device_type: str) -> None:
    """``rollout.seed_per_request=false``: what vLLM samples requests without a seed of their own from,
    seeded (inside :func:`_isolated_rng`, which puts the trainer's states back): the device's torch
    generator (V1's batch noise on CUDA; the CPU sampler's) and numpy's (V2 draws each unseeded
    request's seed from it). The same calls in the same order then give the same samples, on every TP
    rank of an engine alike."""
    random.seed(seed)
    np.random.seed(seed)
    torch.default_generator.manual_seed(seed)
    if device_type == "cuda":
        torch.cuda.manual_seed(seed)  # the current device's generator


@contextlib.contextmanager
def _keep_thread_settings() -> Iterator[None]:
    set_num_threads, num_threads = torch.set_num_threads, torch.get_num_threads()
    try:
        yield
    finally:
        torch.set_num_threads = set_num_threads  # type: ignore[assignment]
        torch.set_num_threads(num_threads)


@dataclass(frozen=True)
class _ProcessSettings:
    """The process-wide torch settings vLLM changes in the process that builds it (see the module doc)."""

    # torch.backends.{cuda,mkldnn}.matmul.fp32_precision, which torch.set_float32_matmul_precision sets
    # (None on a torch without the per-backend API).
    matmul_fp32: tuple[str, str] | None
    # torch.get_float32_matmul_precision(); None where the per-backend API was used (the legacy getter
    # then raises "mix of the legacy and new APIs").
    matmul_legacy: str | None
    cudnn_sdp: bool

    @classmethod
    def current(cls) -> _ProcessSettings:
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


class _SettingsSwap:
    """The trainer's and vLLM's :class:`_ProcessSettings`, each in place while its own code runs.

    Create it before vLLM is imported (importing ``vllm.platforms.cuda`` already disables cuDNN SDPA).
    """

    def __init__(self) -> None:
        self.trainer = _ProcessSettings.current()
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
            self.engine = _ProcessSettings.current()
            self.trainer.apply()

    @contextlib.contextmanager
    def engine_call(self) -> Iterator[None]:
        """Around a call into vLLM: its settings inside, the trainer's current ones back afterwards."""
        trainer = _ProcessSettings.current()
        self.engine.apply()
        try:
            yield
        finally:
            trainer.apply()


def _request_seed(base: int, dp_index: int, prompt_index: int) -> int:
    """A well-mixed 31-bit seed per (call seed, engine, prompt); vLLM adds 0..n-1 for the n samples."""
    return request_seed(base, dp_index, prompt_index)


def _sampling_params(
    spec: SamplingSpec,
    *,
    final_only: bool = False,
    end_of_turn_ids: Iterable[int] = (),
    seeded: bool = True,
) -> Any:
    """vLLM's SamplingParams for a spec whose ``seed`` is the request's own (dropped unless ``seeded``:
    :func:`_seed_sampler`); ``end_of_turn_ids`` end a sample too (:func:`spmdrl.data.turns.end_of_turn_ids`)."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    kwargs: dict[str, Any] = {}
    if final_only:  # the stepper reads only finished requests (LLM.generate sets the same itself)
        kwargs["output_kind"] = RequestOutputKind.FINAL_ONLY
    return SamplingParams(
        n=spec.n,
        temperature=spec.temperature,
        top_p=spec.top_p,
        top_k=spec.top_k,
        max_tokens=spec.max_tokens,
        stop=list(spec.stop) or None,
        stop_token_ids=sorted({*spec.stop_token_ids, *end_of_turn_ids}) or None,
        seed=spec.seed if seeded else None,
        logprobs=0 if spec.logprobs else None,
        flat_logprobs=True,
        # Recipes decode token ids themselves; vLLM's incremental detokenizer is per-token Python work
        # (about 5-10% of CPU rollout time). Stop strings need it.
        detokenize=bool(spec.stop),
        **kwargs,
    )


class _ExpectedReloadWarnings(logging.Filter):
    """Drops vLLM's "<Layer>: Failed to load weights" for layers a reload never sends weights to.

    ``finalize_layerwise_processing`` (``model_executor/model_loader/reload/layerwise.py``) warns for
    every layer that received nothing and puts its old tensors back. That is right for the rotary
    embedding (a computed cache, not in checkpoints) and for a tied lm_head (it shares the embedding's
    tensor, which was loaded), and for vLLM 0.32's Gemma2Model, whose own tensor is the embedding scale
    ``normalizer`` (a buffer computed from the config, not in checkpoints); warning about them on every
    sync would teach users to ignore warnings. Real omissions are caught by VLLMEngine.load_weights's own
    name check.
    """

    def __init__(self, tied: bool) -> None:
        super().__init__()
        always = ("RotaryEmbedding", "Gemma2Model")
        self.layers = (*always, "ParallelLMHead") if tied else always

    def filter(self, record: logging.LogRecord) -> bool:
        msg = record.getMessage()
        return not (msg.endswith(": Failed to load weights") and msg.split(":", 1)[0] in self.layers)


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


def _checkpoint_names(model_dir: Path, tied: bool) -> set[str]:
    """The tensor names the engine must receive on a weight load (from the safetensors headers)."""
    from safetensors import safe_open

    names: set[str] = set()
    for f in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(f), framework="pt", device="cpu") as sf:
            names.update(sf.keys())
    if tied:
        names.discard("lm_head.weight")
    return names


def _end_of_turn_ids(model_dir: Path) -> list[int]:
    """The chat template's end-of-turn token when it is not the eos (spmdrl.data.turns.end_of_turn_ids)."""
    from transformers import AutoTokenizer

    from spmdrl.data.turns import end_of_turn_ids

    try:
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
    except (OSError, ValueError):  # no tokenizer files (benchmark checkpoints): no chat template either
        return []
    ids = end_of_turn_ids(tokenizer)
    if ids:
        log.info("the engine also stops on the chat template's end-of-turn token id(s) %s", ids)
    return ids


# Prefill tokens per engine step on CPU (chunked prefill off): large enough to admit a whole
# rollout batch's prompts in a few steps.
_CPU_MAX_BATCHED_TOKENS = 16384


class VLLMEngine:
    """A :class:`~spmdrl.rollout.engine.RolloutEngine` backed by an in-process vLLM ``LLM``."""

    def __init__(
        self,
        model_dir: Path,
        cfg: RolloutConfig,
        *,
        max_model_len: int,
        device_type: str,
        world: EngineWorld | None = None,
    ) -> None:
        if not dist.is_initialized():
            raise RuntimeError(
                "VLLMEngine needs torch.distributed initialized first (spmdrl.distributed.env.init_distributed): "
                "vLLM's external_launcher joins the existing process group"
            )
        if max_model_len < 2:
            raise ConfigError(f"rollout max_model_len must be >= 2, got {max_model_len}")
        if device_type not in ("cpu", "cuda"):
            raise ValueError(f"VLLMEngine: device_type must be 'cpu' or 'cuda', got {device_type!r}")
        self.device_type = device_type
        self.dtype = resolve_engine_dtype(cfg.dtype, device_type)
        self.max_model_len = max_model_len
        # Which ranks vLLM counts as its world (every rank unless build_engine was given a subset); vLLM's
        # code runs inside self.world.vllm().
        self.world = world if world is not None else EngineWorld.everywhere()
        self.groups = TPGroups(cfg.tp, None if self.world.group is None else self.world.ranks)
        # Different engines (data-parallel groups) must sample differently; the ranks of one engine alike.
        self.seed = cfg.seed + self.groups.dp_index
        self.seed_per_request = cfg.seed_per_request
        self._calls = 0
        self.sleep_enabled = device_type == "cuda" and cfg.free_cache_engine
        self._sleeping: set[str] = set()
        # True from a sleep(keep_weights=False) until the next load_weights: the weights are gone.
        self._weights_discarded = False
        self._warned_no_sleep = False

        _prepare_environment()
        check_model_runner(cfg, device_type)
        if cfg.model_runner != "auto":  # read when the engine's config is built (LLM(...) below)
            os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "1" if cfg.model_runner == "v2" else "0"
        require_supported_vllm()
        self._settings = _SettingsSwap()  # before importing vLLM, which changes some of them
        with inert_freezes():  # no collection while its ~300,000 objects load (spmdrl.gc_heap)
            from vllm import LLM

        if device_type == "cpu":
            cpu_gemm.force_cpu_gemm(cfg.cpu_gemm, self.dtype)
        kwargs: dict[str, Any] = dict(
            model=str(model_dir),
            tokenizer=str(model_dir),
            distributed_executor_backend="external_launcher",
            tensor_parallel_size=cfg.tp,
            dtype=str(self.dtype).removeprefix("torch."),
            seed=self.seed,
            max_model_len=max_model_len,
            max_num_seqs=cfg.max_num_seqs,
            enable_prefix_caching=cfg.enable_prefix_caching,
            # The CPU backend has no CUDA graphs; eager is what it runs.
            enforce_eager=cfg.enforce_eager or device_type == "cpu",
            gpu_memory_utilization=cfg.gpu_memory_utilization,
            enable_sleep_mode=self.sleep_enabled,
            # Logprobs of the distribution actually sampled from (after temperature / top-k / top-p), which
            # is the behaviour policy the trainer's importance ratios need; "raw" would ignore temperature.
            logprobs_mode="processed_logprobs",
        )
        kv_bytes = kv_cache_bytes(model_dir, cfg, max_model_len, self.dtype, device_type)
        if kv_bytes is not None:
            kwargs["kv_cache_memory_bytes"] = kv_bytes
        elif device_type == "cpu":
            # The engine argument behind VLLM_CPU_KVCACHE_SPACE, in bytes: fractions of a GiB work, and
            # an explicit size also skips the CPU worker's profiling warm-up.
            kwargs["kv_cache_memory_bytes"] = int(cfg.cpu_kvcache_gib * (1 << 30))
        if device_type == "cpu":
            # No chunked prefill on CPU: a request whose prefill is split over steps has its sampled
            # token discarded, and vLLM 0.32 then rewinds the request's seeded generator with
            # Generator.set_offset, which CPU generators do not support ("CPU Generator does not use
            # offset", gpu_model_runner._bookkeeping_sync). Whole prefills never take that path.
            kwargs["enable_chunked_prefill"] = False
            kwargs["max_num_batched_tokens"] = max(max_model_len, _CPU_MAX_BATCHED_TOKENS)
        log.info(
            "building vLLM (external_launcher, tp=%d, engine %d of %d, seed %d, %s%s, max_model_len %d, "
            "KV cache %s)",
            cfg.tp,
            self.groups.dp_index,
            self.groups.num_engines,
            self.seed,
            kwargs["dtype"],
            f" (rollout.dtype={cfg.dtype})" if cfg.dtype == "auto" else "",
            max_model_len,
            f"{kv_bytes / 2**20:.1f} MiB per rank (rollout.kv_cache_tokens={cfg.kv_cache_tokens})"
            if kv_bytes is not None
            else "sized from memory",
        )
        # CPU, tp >= 2: the TP all-reduce's shared-memory segments named after this build, not after the
        # machine, so that concurrent or killed jobs cannot collide (spmdrl.rollout.cpu_shm). Its exit
        # runs a collective over the engine ranks, so it sits outside world.vllm()'s group swap.
        shm_names = None
        if device_type == "cpu" and cfg.tp > 1:
            shm_names = cpu_shm.SegmentNames.agree(self.world.group)
            kwargs["worker_cls"] = cpu_shm.WORKER_CLS
        with (
            _isolated_rng(device_type),
            _keep_thread_settings(),
            self._settings.building(),
            shm_names.building(self.world.group) if shm_names else contextlib.nullcontext(),
            self.world.vllm(building=True),
        ):
            self.llm = LLM(**kwargs)
        # CPU, tp >= 2: which all-reduce the TP group took ("" elsewhere). gloo is several times slower per
        # decode step; vLLM falls back to it silently when the ranks' segment names disagree.
        self.tp_all_reduce = cpu_shm.tp_all_reduce() if shm_names else ""
        if device_type == "cuda":  # which runner vLLM took decides how it samples (rollout.model_runner)
            v2 = getattr(self.llm.llm_engine.vllm_config, "use_v2_model_runner", None)
            log.info(
                "vLLM model runner: %s (rollout.model_runner=%s)",
                {True: "V2", False: "V1"}.get(v2, "?"),
                cfg.model_runner,
            )
        if shm_names and self.tp_all_reduce != "shared memory" and cpu_shm.shm_all_reduce_available():
            log.warning(
                "vLLM's tensor-parallel all-reduce fell back to gloo although this vLLM build has the "
                "shared-memory one: generation will be slower (spmdrl.rollout.cpu_shm)"
            )
        elif shm_names:
            log.info("vLLM's tensor-parallel all-reduce: %s", self.tp_all_reduce)
        # A response ends where the chat template ends an assistant turn. vLLM stops on the tokenizer's eos
        # and generation_config.json's eos ids only; a checkpoint whose template ends turns with another
        # token that neither lists (a base Llama 3 tokenizer under the instruct template, a Gemma 2
        # generation config) would otherwise run every sample past its turn to max_tokens.
        self.end_of_turn_ids = _end_of_turn_ids(model_dir)
        hf_config = self.llm.llm_engine.model_config.hf_config
        self.tied_embeddings = bool(getattr(hf_config, "tie_word_embeddings", False))
        self.expected_weights = _checkpoint_names(model_dir, self.tied_embeddings)
        reload_log = logging.getLogger("vllm.model_executor.model_loader.reload.layerwise")
        for f in [f for f in reload_log.filters if isinstance(f, _ExpectedReloadWarnings)]:
            reload_log.removeFilter(f)  # from an engine built earlier in this process
        reload_log.addFilter(_ExpectedReloadWarnings(self.tied_embeddings))
        # Which CPU GEMM path each linear layer took (vLLM's choice or rollout.cpu_gemm's): logged once,
        # since it decides speed and which packed copies a reload must rebuild.
        self.gemm_paths: dict[str, int] = {}
        if device_type == "cpu":
            with self.world.vllm():
                self.gemm_paths = self.llm.collective_rpc(vllm_worker.gemm_paths)[0]
        if self.gemm_paths:
            log.info("vLLM CPU GEMM paths (rollout.cpu_gemm=%s): %s", cfg.cpu_gemm, self.gemm_paths)
        quantized = getattr(self.llm.llm_engine.model_config, "quantization", None) is not None
        self.weight_load = resolve_weight_load(cfg.weight_load, device_type, self.gemm_paths, quantized)
        log.info("weight sync loads by %s (rollout.weight_load=%s)", self.weight_load, cfg.weight_load)

    # ---- generation -------------------------------------------------------------------------------------

    def generate(self, prompts: list[list[int]], params: SamplingSpec) -> list[Generation]:
        # Before any collective: the state is the same on every rank, so a TP group raises together.
        self._require_weights("generate")
        from vllm.inputs import TokensPrompt

        gathered = self.groups.gather_for_tp(prompts)
        self._calls += 1
        check_prompt_lengths(gathered.prompts, self.max_model_len)
        if not gathered.prompts:
            return []
        self._wake(("weights", "kv_cache"))
        base = params.seed if params.seed is not None else self.seed * 1_000_003 + self._calls
        sampling = [
            _sampling_params(
                replace(params, seed=_request_seed(base, self.groups.dp_index, i)),
                end_of_turn_ids=self.end_of_turn_ids,
                seeded=self.seed_per_request,
            )
            for i in range(len(gathered.prompts))
        ]
        with _isolated_rng(self.device_type), self._settings.engine_call(), self.world.vllm():
            if not self.seed_per_request:
                _seed_sampler(request_seed(base, self.groups.dp_index), self.device_type)
            outputs = self.llm.generate(
                [TokensPrompt(prompt_token_ids=p) for p in gathered.prompts], sampling, use_tqdm=False
            )
        results = [
            _to_generation(i, completion, params.logprobs)
            for i, out in enumerate(outputs)
            for completion in sorted(out.outputs, key=lambda c: c.index)
        ]
        mine = TPGroups.scatter_from_tp(results, gathered, per_prompt=params.n)
        for g in mine:
            g.prompt_index -= gathered.start
        return mine

    @contextlib.contextmanager
    def stepper(self) -> Iterator[_Stepper]:
        """vLLM's ``add_request`` / ``step`` / ``abort_request`` loop (what ``LLM.generate`` runs inside),
        for multi-turn rollouts; the same RNG and settings isolation as :meth:`generate`."""
        self._require_weights("stepper")
        self._wake(("weights", "kv_cache"))
        stepper = _Stepper(
            self.llm.llm_engine,
            self.end_of_turn_ids,
            self.world,
            seed_per_request=self.seed_per_request,
            device_type=self.device_type,
        )
        with _isolated_rng(self.device_type), self._settings.engine_call():
            try:
                yield stepper
            finally:
                stepper.abort_all()

    # ---- weights ----------------------------------------------------------------------------------------

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> LoadSeconds:
        """All weights in one call into the engine, pulled lazily from ``weights``: the model's own
        ``load_weights`` (``self.weight_load`` "direct": each tensor written into the live parameter) or
        vLLM's in-place reload ("reload", below).

        vLLM's checkpoint-format reload (0.32: ``model_executor/model_loader/reload/inplace.py``; 0.24:
        inline in ``gpu_model_runner.reload_weights``) moves every
        layer to the meta device, loads whatever the iterator yields, and at the end puts the *old*
        tensors back into layers that got nothing -- and runs layers that got only part of their
        weights (q but not k, v) on uninitialized memory. So it must see every weight in one call;
        buckets arrive through the iterator, and a layer is processed (and its buffered inputs freed)
        as soon as its last weight arrives.

        Until it returns the weights count as invalid: a load that raises leaves some layers on the meta
        device or at old values (garbage after a level-2 sleep), and ``generate`` then refuses to run.
        """
        self._weights_discarded = True
        t0 = time.perf_counter()
        self._wake(("weights",))
        t_wake = time.perf_counter()
        seen: set[str] = set()

        def tracked() -> Iterator[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                seen.add(name)
                yield name, tensor

        # vllm_worker.reload_weights also rebuilds the packed CPU GEMM copies the reload left stale. The
        # weights are produced by the trainer's code (its gathers and broadcasts), in the trainer's world.
        load = vllm_worker.load_weights_direct if self.weight_load == "direct" else vllm_worker.reload_weights
        with self.world.vllm():
            self.last_refreshed = self.llm.collective_rpc(load, args=(self.world.trainer_side(tracked()),))[0]
        t_load = time.perf_counter()
        missing = sorted(self.expected_weights - seen)
        if missing:
            raise RuntimeError(
                f"weight load left {len(missing)} engine weights at their old values: {missing[:6]}; "
                "the trainer's parameter names do not map onto the checkpoint's (see "
                "spmdrl.rollout.weight_sync.engine_name)"
            )
        # Prefix-cache blocks hold KV computed with the old weights; a new request sharing a prompt
        # prefix would reuse them. Nothing is running between steps, so the reset cannot fail.
        with self.world.vllm():
            reset = self.llm.reset_prefix_cache()
        if not reset:
            raise RuntimeError(
                "vLLM refused to reset its prefix cache after a weight load (requests running?)"
            )
        self._weights_discarded = False
        return LoadSeconds(t_wake - t0, t_load - t_wake, time.perf_counter() - t_load)

    def weight_fingerprint(self, seed: int) -> Fingerprint:
        """The engine's weights as its kernels see them (spmdrl.rollout.fingerprint), summed over the TP group."""
        self._require_weights("weight_fingerprint")
        self._wake(("weights",))
        # vLLM's own matmul settings ("highest" float32 precision unless VLLM_FLOAT32_MATMUL_PRECISION
        # lowers it): no TF32, so an fp32 engine's probe reads its weights exactly.
        with self._settings.engine_call(), self.world.vllm():
            fp: Fingerprint = self.llm.collective_rpc(
                vllm_worker.fingerprint, args=(seed, self.groups.tp_rank, self.dtype)
            )[0]
        if self.groups.group is not None:
            keys = sorted(fp.values)
            sums = torch.tensor([fp.values[k] for k in keys], dtype=torch.float64)
            dist.all_reduce(sums, group=self.groups.group)
            fp.values = {k: sums[i].tolist() for i, k in enumerate(keys)}
        return fp

    def close(self) -> None:
        """Release the engine but keep torch.distributed alive; call it before destroy_process_group.

        vLLM's own shutdown (``EngineCore.shutdown`` -> ``cleanup_dist_env_and_memory`` in
        ``distributed/parallel_state.py``) ends with ``torch.distributed.destroy_process_group()``:
        the trainer's default group, not just vLLM's. vLLM 0.32's in-process client runs it from a
        finalizer at exit, after the program destroyed the group, and fails ("Invalid process group
        specified"); 0.24's never runs it. So this detaches that finalizer where there is one and does
        the rest of the teardown: executor, scheduler, vLLM's groups.

        A sleeping engine is woken first. Sleep unmaps and releases the memory of the sleeping allocations
        but keeps their records (``CuMemAllocator.sleep`` in ``device_allocator/cumem.py``); tearing the
        engine down frees them once more (0.32's ``Worker.shutdown`` calls ``CuMemAllocator.release_pools``;
        0.24 leaves the pools to interpreter exit), and on CUDA that free runs ``cuMemUnmap`` on unmapped
        memory (0.32's ``_python_free_callback`` special-cases only ROCm). The allocator's C extension
        keeps the error in a global, which makes it skip ``cuMemRelease`` for every allocation freed after
        it (``unmap_and_release`` in ``csrc/cumem_allocator.cpp``): device memory lost to the rest of the
        process. The last step usually ends asleep (generate, sleep, train, then the sync wakes only the
        weights); waking costs one KV-cache allocation, which every generate makes anyway.
        """
        llm = getattr(self, "llm", None)
        if llm is None:
            return
        self._wake(("weights", "kv_cache"))
        client = llm.llm_engine.engine_core  # the in-process client (VLLM_ENABLE_V1_MULTIPROCESSING=0)
        finalizer = getattr(client, "_finalizer", None)  # vLLM 0.32; 0.24's InprocClient has none
        if finalizer is not None:
            finalizer.detach()
        from vllm.distributed import parallel_state

        core = client.engine_core
        # The worker's shutdown unfreezes every object (the trainer's startup freeze too): inert here.
        with self.world.vllm(), inert_freezes():
            core.model_executor.shutdown()
            core.scheduler.shutdown()
            parallel_state.destroy_model_parallel()
            if parallel_state._WORLD is not None:
                parallel_state._WORLD.destroy()  # vLLM's world subgroups; the default group stays
                parallel_state._WORLD = None
        del self.llm
        gc.collect()

    # ---- sleep / wake (CUDA) -----------------------------------------------------------------------------

    def sleep(self, *, keep_weights: bool = True) -> None:
        """Free the engine's device memory while the trainer uses it (CUDA with rollout.free_cache_engine).

        The KV cache is dropped either way. ``keep_weights=True`` (vLLM sleep level 1) copies the weights to
        host memory and back at the next wake: for when the engine may generate before the next
        ``load_weights``. ``keep_weights=False`` (level 2) discards them, with no host copy and no copies
        either way: for when the next use is ``load_weights`` (a GRPO step: generate, sleep, train, sync),
        which overwrites every weight. ``generate`` raises until it has run.

        Level 2 loses nothing the reload does not send: vLLM copies the model's buffers (the rotary
        ``cos_sin_cache``, attention scales) to host before discarding and back when the weights wake
        (``Worker.sleep`` / ``Worker.wake_up``, ``v1/worker/gpu_worker.py``, 0.24 and 0.32), and the reload
        gives layers it sends nothing to (the rotary embedding) those tensors back. The weights' memory
        itself is remapped at the same addresses, so captured CUDA graphs stay valid.
        """
        if not self._sleep_supported():
            return
        if not self._sleeping:
            with self.world.vllm():
                self.llm.sleep(level=1 if keep_weights else 2)
            self._sleeping = {"weights", "kv_cache"}
            self._weights_discarded = not keep_weights

    def wake_up(self) -> None:
        self._wake(("weights", "kv_cache"))

    def _wake(self, tags: tuple[str, ...]) -> None:
        """Wake the sleeping parts among ``tags`` (whether the weights are valid is ``load_weights``'s
        business: it alone clears ``_weights_discarded``, after a load that succeeded)."""
        todo = [t for t in tags if t in self._sleeping]
        if todo:
            if self.device_type == "cuda" and not _wake_empties_cache():
                # The blocks the trainer freed stay reserved by PyTorch's caching allocator, while vLLM maps
                # its sleep-mode memory with cuMemCreate outside that cache: without this the wake can run
                # out of memory that is free in all but name. Only here, before a wake, is that memory
                # needed. vLLM 0.32's CuMemAllocator.wake_up empties the cache itself (a second call would
                # be one more device sync for nothing); 0.24's does not, nor, unchecked, those between.
                torch.cuda.empty_cache()
            with self.world.vllm():
                self.llm.wake_up(tags=todo)
            self._sleeping.difference_update(todo)

    def _require_weights(self, what: str) -> None:
        if self._weights_discarded:
            raise RuntimeError(
                f"{what}: the engine's weights are not valid: discarded by sleep(keep_weights=False) with no "
                "load_weights since, or the last load_weights failed; load weights first "
                "(spmdrl.rollout.weight_sync.sync_weights), or sleep with keep_weights=True when the engine "
                "generates before the next weight sync"
            )

    def _sleep_supported(self) -> bool:
        if self.sleep_enabled:
            return True
        if not self._warned_no_sleep:
            why = (
                "on CPU vLLM has no device memory to free"
                if self.device_type == "cpu"
                else ("rollout.free_cache_engine is false")
            )
            log.info("vLLM sleep/wake skipped: %s", why)
            self._warned_no_sleep = True
        return False


def resolve_weight_load(
    setting: str, device_type: str, gemm_paths: dict[str, int], quantized: bool = False
) -> str:
    """rollout.weight_load for a built engine: "direct" where every linear layer computes from its live
    parameter (CUDA's unquantized layers; on CPU, the layers on the torch GEMM path), else "reload". A
    quantized checkpoint's layers compute from what vLLM's processing made of the weights: reload."""
    if quantized:
        reads_params = False
        why = "this checkpoint is quantized: its kernels compute from the processed weights"
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


@functools.cache
def _wake_empties_cache() -> bool:
    """Whether the installed vLLM's sleep-mode wake empties PyTorch's CUDA cache itself (0.32 does)."""
    from packaging.version import Version

    from spmdrl.rollout.vllm_version import installed_vllm

    found = installed_vllm()
    return found is not None and Version(found[1]).release[:2] >= (0, 32)


class _Stepper:
    """One multi-turn rollout's view of the in-process ``LLMEngine`` (see ``VLLMEngine.stepper``)."""

    def __init__(
        self,
        llm_engine: Any,
        end_of_turn_ids: list[int],
        world: EngineWorld,
        *,
        seed_per_request: bool = True,
        device_type: str = "cpu",
    ) -> None:
        self.engine = llm_engine
        self.end_of_turn_ids = end_of_turn_ids
        # rollout.seed_per_request=false: requests carry no seed; the first one's seeds the sampler.
        self.seed_per_request = seed_per_request
        self.device_type = device_type
        self._sampler_seeded = False
        # Each call into vLLM runs in its world; the agent loop between calls in the trainer's.
        self.world = world
        self.unfinished: set[str] = set()
        # track_partial requests: their latest cumulative (token ids, logprobs, whether logprobs are on),
        # as vLLM's output processor hands them out (without detokenizing, references to its own lists,
        # so no copy per step); converted only when read.
        self.progress: dict[str, tuple[Any, Any, bool]] = {}

    def add(
        self, request_id: str, prompt_ids: list[int], params: SamplingSpec, *, track_partial: bool = False
    ) -> None:
        from vllm.inputs import TokensPrompt

        if params.n != 1:
            raise ValueError(f"EngineStepper.add: one sample per request, got n={params.n}")
        if request_id in self.unfinished:
            raise ValueError(f"EngineStepper.add: request {request_id!r} is already running")
        # Tracked requests report every step (vLLM's cumulative output kind), the others only at the end.
        if not self.seed_per_request and not self._sampler_seeded:
            _seed_sampler(params.seed if params.seed is not None else 0, self.device_type)
            self._sampler_seeded = True
        sampling = _sampling_params(
            params,
            final_only=not track_partial,
            end_of_turn_ids=self.end_of_turn_ids,
            seeded=self.seed_per_request,
        )
        with self.world.vllm():
            self.engine.add_request(request_id, TokensPrompt(prompt_token_ids=prompt_ids), sampling)
        self.unfinished.add(request_id)

    def partial(self, request_id: str) -> TurnOutput | None:
        seen = self.progress.get(request_id)
        if seen is None:
            return None
        token_ids, lps, want_logprobs = seen
        ids = list(token_ids)
        return TurnOutput(request_id, ids, _sampled_logprobs(lps, ids) if want_logprobs else [], "")

    def step(self) -> list[TurnOutput]:
        done: list[TurnOutput] = []
        with self.world.vllm():
            outputs = self.engine.step()
        for out in outputs:
            if not out.finished:
                (completion,) = out.outputs
                self.progress[out.request_id] = (
                    completion.token_ids,
                    completion.logprobs,
                    completion.logprobs is not None,
                )
                continue
            self.unfinished.discard(out.request_id)
            self.progress.pop(out.request_id, None)
            (completion,) = out.outputs
            gen = _to_generation(0, completion, completion.logprobs is not None)
            done.append(TurnOutput(out.request_id, gen.token_ids, gen.logprobs, gen.finish_reason))
        return done

    def abort(self, request_ids: list[str]) -> None:
        ids = [r for r in request_ids if r in self.unfinished]
        if ids:
            with self.world.vllm():
                self.engine.abort_request(ids)
            self.unfinished.difference_update(ids)
            for r in ids:
                self.progress.pop(r, None)

    def abort_all(self) -> None:
        self.abort(sorted(self.unfinished))

    def num_unfinished(self) -> int:
        return len(self.unfinished)


def _to_generation(prompt_index: int, completion: Any, want_logprobs: bool) -> Generation:
    if completion.finish_reason not in ("stop", "length"):
        raise RuntimeError(f"vLLM finished a request with {completion.finish_reason!r} (aborted?)")
    token_ids = list(completion.token_ids)
    logprobs: list[float] = []
    if want_logprobs:
        logprobs = _sampled_logprobs(completion.logprobs, token_ids)
    return Generation(prompt_index, token_ids, logprobs, completion.finish_reason)


def _sampled_logprobs(lps: Any, token_ids: list[int]) -> list[float]:
    """The sampled token's logprob at each position (``logprobs=0`` returns exactly that one entry)."""
    from vllm.logprobs import FlatLogprobs

    if lps is None or len(lps) != len(token_ids):
        raise RuntimeError(
            f"vLLM returned {0 if lps is None else len(lps)} logprobs for {len(token_ids)} tokens"
        )
    if isinstance(lps, FlatLogprobs):
        if len(lps.logprobs) == len(token_ids) and lps.token_ids == token_ids:
            return list(lps.logprobs)
        # More than one entry at some position (should not happen with logprobs=0): pick the sampled one.
        out = []
        for pos, tok in enumerate(token_ids):
            span = range(lps.start_indices[pos], lps.end_indices[pos])
            out.append(next(lps.logprobs[j] for j in span if lps.token_ids[j] == tok))
        return out
    return [position[tok].logprob for position, tok in zip(lps, token_ids, strict=True)]
