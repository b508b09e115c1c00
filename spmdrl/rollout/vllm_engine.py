"""vLLM inside every rank's process (``distributed_executor_backend="external_launcher"``).

Every rank builds the engine (built on a subset of ranks it hangs in its init) and calls every method.
``tp`` consecutive ranks form one engine: they all-gather their prompts (:mod:`spmdrl.rollout.groups`),
each runs the same scheduler on the same requests, and each keeps its own slice of the results.

What building vLLM in the trainer's process would otherwise change, and is put back here:
- the RNGs (python, numpy, torch CPU/CUDA): vLLM reseeds them at init and its CPU sampler draws from the
  global torch RNG on every step. The trainer's random stream must not depend on how much was generated
  (exact resume), so construction and each generate run inside a saved-and-restored RNG state, and
  every request carries its own seed instead (which also keeps TP ranks sampling identically even if
  the trainer consumed different amounts of randomness on them).
- on CPU, ``CPUWorker.init_device`` replaces ``torch.set_num_threads`` with a no-op (it assumes a
  thread-pinned worker process, which in-process execution never does), and vLLM sets torch's thread
  count for serving; both are restored.

Sleep mode (CUDA only, ``rollout.free_cache_engine``): ``sleep()`` offloads weights and drops the KV
cache (level 1); ``load_weights`` wakes only the weights, ``generate`` wakes the rest. On CPU vLLM's
worker has nothing to free, so the calls are skipped (logged once).
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import random
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from spmdrl.config import ConfigError, RolloutConfig
from spmdrl.rollout.engine import Generation, SamplingSpec
from spmdrl.rollout.groups import TPGroups

log = logging.getLogger(__name__)

_DTYPES = {
    "auto": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
}


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


@contextlib.contextmanager
def _keep_thread_settings() -> Iterator[None]:
    set_num_threads, num_threads = torch.set_num_threads, torch.get_num_threads()
    try:
        yield
    finally:
        torch.set_num_threads = set_num_threads  # type: ignore[assignment]
        torch.set_num_threads(num_threads)


def _request_seed(base: int, dp_index: int, prompt_index: int) -> int:
    """A well-mixed 31-bit seed per (call seed, engine, prompt); vLLM adds 0..n-1 for the n samples."""
    state = np.random.SeedSequence((base & 0xFFFFFFFF, dp_index, prompt_index)).generate_state(1)[0]
    return int(state) & 0x3FFFFFFF


class _ExpectedReloadWarnings(logging.Filter):
    """Drops vLLM's "<Layer>: Failed to load weights" for layers a reload never sends weights to.

    ``finalize_layerwise_processing`` (``model_executor/model_loader/reload/layerwise.py``) warns for
    every layer that received nothing and puts its old tensors back. That is right for the rotary
    embedding (a computed cache, not in checkpoints) and for a tied lm_head (it shares the embedding's
    tensor, which was loaded); warning about them on every sync would teach users to ignore warnings.
    Real omissions are caught by VLLMEngine.load_weights's own name check.
    """

    def __init__(self, tied: bool) -> None:
        super().__init__()
        self.layers = ("RotaryEmbedding", "ParallelLMHead") if tied else ("RotaryEmbedding",)

    def filter(self, record: logging.LogRecord) -> bool:
        msg = record.getMessage()
        return not (msg.endswith(": Failed to load weights") and msg.split(":", 1)[0] in self.layers)


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


# Prefill tokens per engine step on CPU (chunked prefill off): large enough to admit a whole
# rollout batch's prompts in a few steps.
_CPU_MAX_BATCHED_TOKENS = 16384


class VLLMEngine:
    """A :class:`~spmdrl.rollout.engine.RolloutEngine` backed by an in-process vLLM ``LLM``."""

    def __init__(self, model_dir: Path, cfg: RolloutConfig, *, max_model_len: int, device_type: str) -> None:
        if not dist.is_initialized():
            raise RuntimeError(
                "VLLMEngine needs torch.distributed initialized first (spmdrl.dist.env.init_distributed): "
                "vLLM's external_launcher joins the existing process group"
            )
        if cfg.dtype not in _DTYPES:
            raise ConfigError(f"rollout.dtype={cfg.dtype!r} is not one of {', '.join(_DTYPES)}")
        if max_model_len < 2:
            raise ConfigError(f"rollout max_model_len must be >= 2, got {max_model_len}")
        if device_type not in ("cpu", "cuda"):
            raise ValueError(f"VLLMEngine: device_type must be 'cpu' or 'cuda', got {device_type!r}")
        self.device_type = device_type
        self.dtype = _DTYPES[cfg.dtype]
        self.max_model_len = max_model_len
        self.groups = TPGroups(cfg.tp)
        # Different engines (data-parallel groups) must sample differently; the ranks of one engine alike.
        self.seed = cfg.seed + self.groups.dp_index
        self._calls = 0
        self.sleep_enabled = device_type == "cuda" and cfg.free_cache_engine
        self._sleeping: set[str] = set()
        self._warned_no_sleep = False

        _prepare_environment()
        from vllm import LLM

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
        if device_type == "cpu":
            # The engine argument behind VLLM_CPU_KVCACHE_SPACE, in bytes: fractions of a GiB work, and
            # an explicit size also skips the CPU worker's profiling warm-up.
            kwargs["kv_cache_memory_bytes"] = int(cfg.cpu_kvcache_gib * (1 << 30))
            # No chunked prefill on CPU: a request whose prefill is split over steps has its sampled
            # token discarded, and vLLM 0.32 then rewinds the request's seeded generator with
            # Generator.set_offset, which CPU generators do not support ("CPU Generator does not use
            # offset", gpu_model_runner._bookkeeping_sync). Whole prefills never take that path.
            kwargs["enable_chunked_prefill"] = False
            kwargs["max_num_batched_tokens"] = max(max_model_len, _CPU_MAX_BATCHED_TOKENS)
        log.info(
            "building vLLM (external_launcher, tp=%d, engine %d of %d, seed %d, %s, max_model_len %d)",
            cfg.tp,
            self.groups.dp_index,
            self.groups.num_engines,
            self.seed,
            kwargs["dtype"],
            max_model_len,
        )
        with _isolated_rng(device_type), _keep_thread_settings():
            self.llm = LLM(**kwargs)
        hf_config = self.llm.llm_engine.model_config.hf_config
        self.tied_embeddings = bool(getattr(hf_config, "tie_word_embeddings", False))
        self.expected_weights = _checkpoint_names(model_dir, self.tied_embeddings)
        reload_log = logging.getLogger("vllm.model_executor.model_loader.reload.layerwise")
        for f in [f for f in reload_log.filters if isinstance(f, _ExpectedReloadWarnings)]:
            reload_log.removeFilter(f)  # from an engine built earlier in this process
        reload_log.addFilter(_ExpectedReloadWarnings(self.tied_embeddings))

    # ---- generation -------------------------------------------------------------------------------------

    def generate(self, prompts: list[list[int]], params: SamplingSpec) -> list[Generation]:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        gathered = self.groups.gather_for_tp(prompts)
        self._calls += 1
        # Checked on the gathered prompts, so every rank of a TP group raises together (not one rank
        # raising while the others wait in the engine).
        for i, p in enumerate(gathered.prompts):
            if not p or len(p) >= self.max_model_len:
                raise ValueError(
                    f"a prompt in this engine's batch (index {i}) has {len(p)} tokens; the engine takes "
                    f"1..{self.max_model_len - 1} (max_model_len={self.max_model_len}): raise "
                    "rollout.max_model_len or filter long prompts (data.max_prompt_length)"
                )
        if not gathered.prompts:
            return []
        self._wake(("weights", "kv_cache"))
        base = params.seed if params.seed is not None else self.seed * 1_000_003 + self._calls
        sampling = [
            SamplingParams(
                n=params.n,
                temperature=params.temperature,
                top_p=params.top_p,
                top_k=params.top_k,
                max_tokens=params.max_tokens,
                stop=list(params.stop) or None,
                seed=_request_seed(base, self.groups.dp_index, i),
                logprobs=0 if params.logprobs else None,
                flat_logprobs=True,
                # Recipes decode token ids themselves; vLLM's incremental detokenizer is per-token
                # Python work (about 5-10% of CPU rollout time). Stop strings need it.
                detokenize=bool(params.stop),
            )
            for i in range(len(gathered.prompts))
        ]
        with _isolated_rng(self.device_type):
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

    # ---- weights ----------------------------------------------------------------------------------------

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """All weights in one ``reload_weights`` call, pulled lazily from ``weights``.

        vLLM's checkpoint-format reload (``model_executor/model_loader/reload/inplace.py``) moves every
        layer to the meta device, loads whatever the iterator yields, and at the end puts the *old*
        tensors back into layers that got nothing -- and runs layers that got only part of their
        weights (q but not k, v) on uninitialized memory. So it must see every weight in one call;
        buckets arrive through the iterator, and a layer is processed (and its buffered inputs freed)
        as soon as its last weight arrives.
        """
        self._wake(("weights",))
        seen: set[str] = set()

        def tracked() -> Iterator[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                seen.add(name)
                yield name, tensor

        self.llm.collective_rpc(
            "reload_weights", kwargs=dict(weights_iterator=tracked(), is_checkpoint_format=True)
        )
        missing = sorted(self.expected_weights - seen)
        if missing:
            raise RuntimeError(
                f"weight load left {len(missing)} engine weights at their old values: {missing[:6]}; "
                "the trainer's parameter names do not map onto the checkpoint's (see "
                "spmdrl.rollout.weight_sync.engine_name)"
            )
        # Prefix-cache blocks hold KV computed with the old weights; a new request sharing a prompt
        # prefix would reuse them. Nothing is running between steps, so the reset cannot fail.
        if not self.llm.reset_prefix_cache():
            raise RuntimeError(
                "vLLM refused to reset its prefix cache after a weight load (requests running?)"
            )

    def close(self) -> None:
        """Release the engine but keep torch.distributed alive; call it before destroy_process_group.

        vLLM's own shutdown (``EngineCore.shutdown`` -> ``cleanup_dist_env_and_memory`` in
        ``distributed/parallel_state.py``) ends with ``torch.distributed.destroy_process_group()``:
        the trainer's default group, not just vLLM's. Left to itself it runs from a finalizer at exit,
        after the program destroyed the group, and fails ("Invalid process group specified"). So this
        detaches that finalizer and does the rest of the teardown: executor, scheduler, vLLM's groups.
        """
        llm = getattr(self, "llm", None)
        if llm is None:
            return
        from vllm.distributed import parallel_state

        client = llm.llm_engine.engine_core  # the in-process client (VLLM_ENABLE_V1_MULTIPROCESSING=0)
        client._finalizer.detach()
        core = client.engine_core
        core.model_executor.shutdown()
        core.scheduler.shutdown()
        parallel_state.destroy_model_parallel()
        if parallel_state._WORLD is not None:
            parallel_state._WORLD.destroy()  # vLLM's world subgroups; the default group stays
            parallel_state._WORLD = None
        del self.llm
        gc.collect()

    # ---- sleep / wake (CUDA) -----------------------------------------------------------------------------

    def sleep(self) -> None:
        if not self._sleep_supported():
            return
        if not self._sleeping:
            # Level 1 keeps a host copy of the weights: the engine stays usable even if a step generates
            # before the next weight sync (validation, say). The KV cache is dropped either way.
            self.llm.sleep(level=1)
            self._sleeping = {"weights", "kv_cache"}

    def wake_up(self) -> None:
        self._wake(("weights", "kv_cache"))

    def _wake(self, tags: tuple[str, ...]) -> None:
        todo = [t for t in tags if t in self._sleeping]
        if todo:
            self.llm.wake_up(tags=todo)
            self._sleeping.difference_update(todo)

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
