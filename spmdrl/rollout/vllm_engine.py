"""vLLM inside every rank's process (``distributed_executor_backend="external_launcher"``).

Every rank builds the engine and calls every method, or, with ``build_engine(ranks=...)``, every rank of a
block does, vLLM's world then being that block (:mod:`spmdrl.rollout.engine_ranks`).
``tp`` consecutive ranks form one engine: they all-gather their prompts (:mod:`spmdrl.rollout.groups`),
each runs the same scheduler on the same requests, and each keeps its own slice of the results.

What building vLLM in the trainer's process changes (its RNGs, thread settings, process-wide torch
settings, gc freezes), and what is done about it: :mod:`spmdrl.rollout.vllm_process`. What it is built
with (dtype, KV cache, weight-load mode): :mod:`spmdrl.rollout.vllm_plan`. Its requests and outputs:
:mod:`spmdrl.rollout.vllm_requests`.

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
import sys
import time
from collections.abc import Iterable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from spmdrl.errors import ConfigError
from spmdrl.gc_heap import inert_freezes
from spmdrl.rollout import cpu_gemm, cpu_shm, routing_capture, vllm_logs, vllm_worker
from spmdrl.rollout.config import RolloutConfig
from spmdrl.rollout.engine import (
    Generation,
    LoadSeconds,
    SamplingSpec,
    check_model_runner,
    check_prompt_lengths,
    request_seed,
)
from spmdrl.rollout.engine_ranks import EngineWorld
from spmdrl.rollout.fingerprint import Fingerprint
from spmdrl.rollout.groups import TPGroups
from spmdrl.rollout.quantization import check_quantization
from spmdrl.rollout.vllm_plan import kv_cache_bytes, resolve_engine_dtype, resolve_weight_load
from spmdrl.rollout.vllm_process import SettingsSwap, isolated_rng, keep_thread_settings, prepare_environment
from spmdrl.rollout.vllm_requests import VLLMStepper, sampling_params, seed_sampler, to_generation
from spmdrl.rollout.vllm_version import require_supported_vllm

log = logging.getLogger(__name__)


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


def _image_token_ids(model_dir: Path) -> list[int]:
    """A vision-language model's image tokens, which only its processor writes and the engine never samples
    (spmdrl.data.vision.image_token_ids); none for a text model."""
    from spmdrl.data.vision import image_token_ids
    from spmdrl.models.load import load_processor

    processor = load_processor(model_dir)
    return [] if processor is None else image_token_ids(processor)


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
        routed_experts: bool = False,
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
        self.image_token_ids = _image_token_ids(model_dir)

        prepare_environment()
        # Before vLLM's import, which logs some of the warnings spmdrl demotes (spmdrl.rollout.vllm_logs).
        vllm_logs.install(device_type, dist.get_rank())
        check_model_runner(cfg, device_type)
        check_quantization(cfg.quantization, str(self.dtype).removeprefix("torch."), device_type)
        if cfg.model_runner != "auto":  # read when the engine's config is built (LLM(...) below)
            os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "1" if cfg.model_runner == "v2" else "0"
        require_supported_vllm()
        self._settings = SettingsSwap()  # before importing vLLM, which changes some of them
        with inert_freezes():  # no collection while its ~300,000 objects load (spmdrl.gc_heap)
            from vllm import LLM

        if device_type == "cpu":
            cpu_gemm.force_cpu_gemm(cfg.cpu_gemm, self.dtype)
            cpu_gemm.avoid_zentorch_moe()
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
            # Without a terminal tqdm's bar over the checkpoint's shards is a block of lines in the log at
            # every build; the log says when the engine is built either way.
            use_tqdm_on_load=sys.stderr.isatty(),
        )
        if cfg.quantization != "none":
            kwargs["quantization"] = cfg.quantization
        # Router replay: each token's experts come back with its generation. vLLM returns them itself
        # (enable_return_routed_experts) with its Model Runner V2 only, which needs Triton (CUDA); on CPU
        # (the V1 runner) spmdrl records them at the engine's routers (spmdrl.rollout.routing_capture), with
        # the prefix cache off, since a cached prompt token is never run through the routers.
        self.routed_experts = ("vllm" if device_type == "cuda" else "recorded") if routed_experts else ""
        if self.routed_experts == "vllm":
            if not cfg.enable_prefix_caching:  # vLLM keeps the routing with the prefix cache's blocks
                raise ConfigError(
                    "model.router_replay=r3 on CUDA needs vLLM's prefix cache (its routed-experts output "
                    "keeps the routing with the cache's blocks): set rollout.enable_prefix_caching=true"
                )
            kwargs["enable_return_routed_experts"] = True
        elif self.routed_experts == "recorded":
            kwargs["enable_prefix_caching"] = False
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
            isolated_rng(device_type),
            keep_thread_settings(),
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
        # A vision-language model's: every token but its image tokens (None: all).
        vocab = self.llm.llm_engine.model_config.get_vocab_size()
        banned = set(self.image_token_ids)
        self.allowed_token_ids = [i for i in range(vocab) if i not in banned] if banned else None
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
        if self.routed_experts == "recorded":
            with self.world.vllm():
                layers, top_k = self.llm.collective_rpc(routing_capture.install)[0]
            log.info("router replay: recording the engine's routing (%d MoE layers, top-%d)", layers, top_k)
        quantized = getattr(self.llm.llm_engine.model_config, "quantization", None) is not None
        self.weight_load = resolve_weight_load(cfg.weight_load, device_type, self.gemm_paths, quantized)
        log.info("weight sync loads by %s (rollout.weight_load=%s)", self.weight_load, cfg.weight_load)

    # ---- generation -------------------------------------------------------------------------------------

    def generate(
        self, prompts: list[list[int]], params: SamplingSpec, images: list[list[Any]] | None = None
    ) -> list[Generation]:
        # Before any collective: the state is the same on every rank, so a TP group raises together.
        self._require_weights("generate")
        from vllm.inputs import TokensPrompt

        # A vision-language model's images travel with their prompts to the TP group's other ranks.
        items: list[Any] = prompts if images is None else list(zip(prompts, images, strict=True))
        gathered = self.groups.gather_for_tp(items)
        ids = gathered.prompts if images is None else [p for p, _ in gathered.prompts]
        self._calls += 1
        check_prompt_lengths(ids, self.max_model_len)
        if not gathered.prompts:
            return []
        self._wake(("weights", "kv_cache"))
        base = params.seed if params.seed is not None else self.seed * 1_000_003 + self._calls
        sampling = [
            sampling_params(
                replace(params, seed=request_seed(base, self.groups.dp_index, i)),
                end_of_turn_ids=self.end_of_turn_ids,
                seeded=self.seed_per_request,
                allowed_token_ids=self.allowed_token_ids,
            )
            for i in range(len(gathered.prompts))
        ]
        with isolated_rng(self.device_type), self._settings.engine_call(), self.world.vllm():
            if not self.seed_per_request:
                seed_sampler(request_seed(base, self.groups.dp_index), self.device_type)
            requests = [TokensPrompt(prompt_token_ids=p) for p in ids]
            if images is not None:
                for request, (_, row_images) in zip(requests, gathered.prompts, strict=True):
                    if row_images:
                        request["multi_modal_data"] = {"image": list(row_images)}
            outputs = self.llm.generate(requests, sampling, use_tqdm=False)
        results = [
            to_generation(i, completion, params.logprobs)
            for i, out in enumerate(outputs)
            for completion in sorted(out.outputs, key=lambda c: c.index)
        ]
        if self.routed_experts:
            self._attach_routing(outputs, results, params.n)
        mine = TPGroups.scatter_from_tp(results, gathered, per_prompt=params.n)
        for g in mine:
            g.prompt_index -= gathered.start
        return mine

    def _attach_routing(self, outputs: list[Any], results: list[Generation], n: int) -> None:
        """Each generation's routed experts, (positions, layers, k), from vLLM's output or the recorder."""
        recorded: dict[str, Any] = {}
        if self.routed_experts == "recorded":
            with self.world.vllm():
                recorded = self.llm.collective_rpc(routing_capture.take)[0]
        it = iter(results)
        for out in outputs:
            for completion in sorted(out.outputs, key=lambda c: c.index):
                gen = next(it)
                if self.routed_experts == "vllm":
                    rows = completion.routed_experts
                else:
                    rows = recorded.get(routing_capture.request_key(out.request_id, completion.index, n))
                if rows is None:
                    raise RuntimeError(
                        f"router replay: the engine returned no routed experts for request {out.request_id} "
                        f"sample {completion.index}"
                    )
                gen.routed_experts = rows

    @contextlib.contextmanager
    def stepper(self) -> Iterator[VLLMStepper]:
        """vLLM's ``add_request`` / ``step`` / ``abort_request`` loop (what ``LLM.generate`` runs inside),
        for multi-turn rollouts; the same RNG and settings isolation as :meth:`generate`."""
        self._require_weights("stepper")
        self._wake(("weights", "kv_cache"))
        stepper = VLLMStepper(
            self.llm.llm_engine,
            self.end_of_turn_ids,
            self.world,
            seed_per_request=self.seed_per_request,
            device_type=self.device_type,
            allowed_token_ids=self.allowed_token_ids,
        )
        with isolated_rng(self.device_type), self._settings.engine_call():
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
            if self.image_token_ids:  # a vision-language model
                # Likewise the vision tower's outputs for images seen before the load (its scheduler's record
                # of them and the runner's copies, together: the reload drops some of the runner's, and a
                # record without its copy fails the next request with "Encoder cache miss").
                self.llm.llm_engine.reset_encoder_cache()
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


@functools.cache
def _wake_empties_cache() -> bool:
    """Whether the installed vLLM's sleep-mode wake empties PyTorch's CUDA cache itself (0.32 does)."""
    from packaging.version import Version

    from spmdrl.rollout.vllm_version import installed_vllm

    found = installed_vllm()
    return found is not None and Version(found[1]).release[:2] >= (0, 32)
