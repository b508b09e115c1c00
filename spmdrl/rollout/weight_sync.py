"""Trainer -> engine weight sync: FSDP2 shards become full tensors bucket by bucket and load in place.

After each actor update every rank holds 1/N of each parameter (a DTensor sharded on dim 0). The engine
needs full tensors (vLLM's weight loaders cut their own tensor-parallel slices out of them). Per bucket
of about ``bucket_mb`` MB:

1. pack this rank's shards, cast to the engine dtype and padded to the FSDP shard size, into one buffer
   (casting first halves the bytes sent when the trainer keeps fp32 and the engine bf16);
2. one ``all_gather_into_tensor`` over the shard dimension's process group (``dp_shard``; under HSDP the
   replicas already hold the same shard, so only the shard group gathers);
3. cut the full tensors out of the gathered buffer and hand them to the engine;
4. drop the buffer before the next bucket.

The buckets come from a generator the engine consumes lazily inside one ``reload_weights`` call, so a
rank never holds a second full copy of the model: at most a bucket in flight plus what the engine has
buffered for a layer whose last weight has not arrived yet (parameters come in module order, so that
is at most one layer).

Why not vLLM's native weight-transfer engines (``weight_transfer_config`` / ``init_weight_transfer_engine``,
``vllm/distributed/weight_transfer/``)? They move weights *between processes*: ``nccl`` opens a separate
NCCL group from a trainer process, ``ipc`` passes CUDA IPC handles, others use RDMA; none exists for
CPU, and all of them assume the weights live elsewhere. Here the trainer and the engine share a process,
so the weights are already in memory after the gather; ``reload_weights`` with an iterator is the direct
path, works the same on CPU and CUDA, and needs no extra process group.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from spmdrl.distributed.reduce import all_reduce_max
from spmdrl.models.experts import split_all
from spmdrl.models.lora import adapted_weight_names, lora_scale, merge_weights
from spmdrl.rollout.engine import LoadSeconds, RolloutEngine
from spmdrl.rollout.expert_probe import ExpertOutputs, observe_experts
from spmdrl.rollout.fingerprint import Fingerprint, WeightSyncError, compare, observe, sync_error

log = logging.getLogger(__name__)

# benchmarks/weight_sync.py on 2 CPU ranks (gloo): 4-32 MB buckets gathered a 65 MB model in ~0.6x the
# time of 128-256 MB ones (large buffers are fresh mmaps, page-faulted on every sync) and in ~0.3x the
# time of one full_tensor() per parameter. Rerun it on GPUs (NCCL) before raising this.
DEFAULT_BUCKET_MB = 32.0

# torch 2.13 renamed all_gather_into_tensor (now deprecated) to all_gather_single.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

# Activation checkpointing (spmdrl.models.parallelize.apply_ac) inserts this module into parameter paths;
# the engine knows the checkpoint's names. (spmdrl wraps models in nothing else.)
_AC_PART = "_checkpoint_wrapped_module."


def engine_name(fqn: str) -> str:
    """The HF checkpoint name of a trainer parameter. The one place names are mapped."""
    return fqn.replace(_AC_PART, "")


@dataclass(frozen=True)
class SyncCheck:
    """Prove after the load that the engine serves exactly these weights (spmdrl.rollout.fingerprint)."""

    # Chooses the probed columns; pass something that changes every sync (the step).
    seed: int
    tol: float = 1e-9


@dataclass(frozen=True)
class Fanout:
    """``parallel.placement=split``: ranks that hold no actor shards still run an engine that must serve
    the actor's weights. The first actor rank forwards each bucket of full tensors it gathered to them
    with one broadcast over ``group`` (itself and those ranks); they never hold a second copy either.
    ``parallel.placement=async``: the same, to the rollout ranks, from a sender that loads no engine."""

    group: dist.ProcessGroup
    src: int  # the forwarding rank (global rank)
    receiving: bool  # this rank holds no shards: it receives


@dataclass(frozen=True)
class SyncStats:
    seconds: float
    # Bytes of full tensors handed to the engine (engine dtype).
    bytes: int
    num_buckets: int
    num_tensors: int
    # Of ``seconds``: the check's share, and how many (layer, input size) groups it compared (0: no check).
    check_seconds: float = 0.0
    checked_groups: int = 0
    # Of ``seconds``: the engine's load_weights, split (LoadSeconds); the gather runs inside ``load``.
    load: LoadSeconds = field(default_factory=LoadSeconds)

    def phases(self) -> dict[str, float]:
        """The sync's parts as timing phases (timing/weight_sync_<part>_s), for a step's PhaseTimer."""
        return {
            "weight_sync_wake": self.load.wake,
            "weight_sync_load": self.load.load,
            "weight_sync_prefix_reset": self.load.prefix_cache_reset,
            "weight_sync_check": self.check_seconds,
        }


@dataclass
class SyncCounter:
    """Filled in by iter_full_tensors as the engine pulls tensors (the sync is lazy, so counts come last)."""

    bytes: int = 0
    num_buckets: int = 0
    num_tensors: int = 0


@dataclass(frozen=True)
class _Gather:
    """How to make a parameter full: gather dim 0 over ``group`` of ``size`` ranks, or not at all."""

    kind: str  # "shard0": one dim-0 shard per rank of group; "local": already full; "fallback": full_tensor()
    group: dist.ProcessGroup | None = None
    size: int = 1


def _gather_plan(t: torch.Tensor) -> _Gather:
    if not isinstance(t, DTensor):
        # Not sharded: a plain module, or FSDP2 params left unsharded after a forward (reshard_after_forward=False).
        return _Gather("local")
    shard_dims = [i for i, p in enumerate(t.placements) if isinstance(p, Shard)]
    others_replicated = all(
        isinstance(p, Replicate) for i, p in enumerate(t.placements) if i not in shard_dims
    )
    # type() and not isinstance(): a Shard subclass laid out differently takes the fallback, as does
    # _StridedShard (TP + FSDP, or FSDP2 over ep-sharded experts), which torch 2.13 no longer derives from Shard.
    if len(shard_dims) == 1 and others_replicated:
        mesh_dim = shard_dims[0]
        placement = t.placements[mesh_dim]
        if type(placement) is Shard and placement.dim == 0:
            return _Gather("shard0", t.device_mesh.get_group(mesh_dim), t.device_mesh.size(mesh_dim))
    if not t.placements or all(isinstance(p, Replicate) for p in t.placements):
        return _Gather("local")
    return _Gather("fallback")  # strided / multi-dim / partial placements: let DTensor do it


def _buckets(
    named: list[tuple[str, torch.Tensor]], bucket_bytes: int, dtype: torch.dtype
) -> Iterator[tuple[_Gather, list[tuple[str, torch.Tensor]]]]:
    """Consecutive parameters with the same gather plan, about ``bucket_bytes`` of full tensors each.

    Decided from global shapes and placements only, so every rank forms the same buckets (they issue
    the same collectives in the same order).
    """
    itemsize = torch.empty((), dtype=dtype).element_size()
    current: list[tuple[str, torch.Tensor]] = []
    plan: _Gather | None = None
    size = 0
    for name, t in named:
        p = _gather_plan(t)
        nbytes = t.numel() * itemsize
        same = plan is not None and p.kind == plan.kind and p.group is plan.group
        if current and (not same or size + nbytes > bucket_bytes):
            assert plan is not None
            yield plan, current
            current, size = [], 0
        current.append((name, t))
        plan = p
        size += nbytes
    if current:
        assert plan is not None
        yield plan, current


def _gather_shard0(
    bucket: list[tuple[str, torch.Tensor]], plan: _Gather, dtype: torch.dtype, device: torch.device | None
) -> Iterator[tuple[str, torch.Tensor]]:
    """One all_gather for the bucket; yields full tensors cut out of the gathered buffer."""
    world = plan.size
    # FSDP2 (like torch.chunk) gives each rank ceil(dim0 / world) rows, the last ranks fewer or none.
    # Padding every shard to that size makes the gathered buffer rank-major with equal strides.
    layout = []
    offset = 0
    for name, t in bucket:
        rows = t.shape[0]
        padded_rows = math.ceil(rows / world)
        row_numel = math.prod(t.shape[1:])
        layout.append((name, t, offset, padded_rows, row_numel))
        offset += padded_rows * row_numel
    device = device or bucket[0][1].device
    send = torch.empty(offset, dtype=dtype, device=device)
    for _, t, off, _, _ in layout:
        local = t.to_local()
        send[off : off + local.numel()].copy_(local.reshape(-1))  # cast happens in the copy
    recv = torch.empty(world * offset, dtype=dtype, device=device)
    _all_gather_single(recv, send, group=plan.group)
    del send
    recv_WN = recv.view(world, offset)
    out = []
    for name, t, off, padded_rows, row_numel in layout:
        part = recv_WN[:, off : off + padded_rows * row_numel]
        # (world, padded_rows * rest) -> (world * padded_rows, *rest): a copy; then drop the padding rows.
        full = part.reshape(world * padded_rows, *t.shape[1:])[: t.shape[0]]
        out.append((name, full))
    del recv, recv_WN
    yield from out


def _full_tensor(t: DTensor) -> torch.Tensor:
    """``t.full_tensor()``; a strided shard (FSDP2's shard of the experts over efsdp under parallel.ep, on
    top of their Shard(0) over ep) one mesh dimension at a time, outermost first: DTensor's own
    full_tensor() does the same two all-gathers but warns on every rank that it cannot merge them."""
    if not any(isinstance(p, _StridedShard) for p in t.placements):
        return t.full_tensor()
    placements = list(t.placements)
    for dim in range(len(placements)):
        placements[dim] = Replicate()
        t = t.redistribute(placements=placements)
    return t.to_local()


def iter_full_tensors(
    named_tensors: Iterable[tuple[str, torch.Tensor]],
    *,
    dtype: torch.dtype,
    bucket_mb: float = DEFAULT_BUCKET_MB,
    counter: SyncCounter | None = None,
    device: torch.device | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, full tensor in ``dtype``) for each input, gathered bucket by bucket. Every rank of the
    shard groups must drain it (it runs collectives). Names are passed through unchanged.

    ``device``: where to gather (default: where the tensors are). Offloaded shards live in host memory;
    gathering them on the GPU keeps the collective on NCCL and hands the engine GPU tensors."""
    if bucket_mb <= 0:
        raise ValueError(f"bucket_mb must be > 0, got {bucket_mb}")
    named = [(n, t.detach()) for n, t in named_tensors]
    for plan, bucket in _buckets(named, int(bucket_mb * 1e6), dtype):
        if counter is not None:
            counter.num_buckets += 1
        if plan.kind == "shard0" and plan.size > 1:
            items: Iterable[tuple[str, torch.Tensor]] = _gather_shard0(bucket, plan, dtype, device)
        elif plan.kind == "fallback":
            items = ((n, _full_tensor(t).to(device=device, dtype=dtype)) for n, t in bucket)
        else:
            items = (
                (n, (t.to_local() if isinstance(t, DTensor) else t).to(device=device, dtype=dtype))
                for n, t in bucket
            )
        for name, full in items:
            if counter is not None:
                counter.bytes += full.numel() * full.element_size()
                counter.num_tensors += 1
            yield name, full
        del items


def trainer_weights(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """(checkpoint name, parameter) in module order, each tensor once (tied weights under their first name)."""
    tied = bool(getattr(getattr(model, "config", None), "tie_word_embeddings", False))
    for fqn, p in model.named_parameters():
        name = engine_name(fqn)
        if tied and name == "lm_head.weight":
            continue  # the engine ties it to embed_tokens, which comes first
        yield name, p


def engine_weights(
    model: nn.Module, full: Iterator[tuple[str, torch.Tensor]]
) -> Iterator[tuple[str, torch.Tensor]]:
    """The engine's tensors from the full tensors of :func:`trainer_weights`: a LoRA model's adapters merged
    into their weights (W + alpha/r B A, spmdrl.models.lora), so the engine serves the base model's names and
    needs no LoRA support of its own; a mixture-of-experts model's fused experts as the checkpoint's
    per-expert matrices (views; spmdrl.models.experts), the names the engine's loader and the check know."""
    scale = lora_scale(model)
    if scale is not None:
        full = merge_weights(full, adapted_weight_names(n for n, _ in trainer_weights(model)), scale)
    return split_all(full)


def engine_shapes(model: nn.Module) -> list[tuple[str, torch.Size]]:
    """(name, shape) of what :func:`engine_weights` yields, in its order: the same merge run over
    meta-device stand-ins (no memory, no collective)."""
    stand_ins = ((n, torch.empty(p.shape, device="meta")) for n, p in trainer_weights(model))
    return [(n, t.shape) for n, t in engine_weights(model, stand_ins)]


def tied_uses(model: nn.Module) -> dict[str, int]:
    """Trainer tensors that more than one engine layer computes from: a tied input embedding is also the
    engine's LM head (a layer of its own, with its own packed copy on CPU)."""
    if not bool(getattr(getattr(model, "config", None), "tie_word_embeddings", False)):
        return {}
    emb = model.get_input_embeddings().weight  # type: ignore[operator]
    return {engine_name(n): 2 for n, p in model.named_parameters() if p is emb}


def _forward(
    stream: Iterator[tuple[str, torch.Tensor]] | None,
    shapes: list[tuple[str, torch.Size]],
    dtype: torch.dtype,
    fanout: Fanout,
    bucket_bytes: int,
    device: torch.device,
) -> Iterator[tuple[str, torch.Tensor]]:
    """The full tensors of ``shapes`` (module order) on every rank of the fanout group, bucket by bucket:
    the source packs ``stream``'s tensors and broadcasts them; the receivers cut them out of the buffer.

    Buckets are decided from names and shapes alone, which both sides know (the receivers from a
    meta-device copy of the actor), so they agree without exchanging anything.
    """
    itemsize = torch.empty((), dtype=dtype).element_size()
    bucket: list[tuple[str, torch.Size]] = []
    size = 0
    for i, (name, shape) in enumerate(shapes):
        bucket.append((name, shape))
        size += math.prod(shape) * itemsize
        if size < bucket_bytes and i + 1 < len(shapes):
            continue
        numels = [math.prod(s) for _, s in bucket]
        flat = torch.empty(sum(numels), dtype=dtype, device=device)
        offsets = [sum(numels[:j]) for j in range(len(numels))]
        if not fanout.receiving:
            assert stream is not None
            for (want, _), off, n in zip(bucket, offsets, numels, strict=True):
                got, full = next(stream)
                if got != want:
                    raise RuntimeError(f"weight fanout out of order: expected {want}, got {got}")
                flat[off : off + n].copy_(full.reshape(-1))
        dist.broadcast(flat, src=fanout.src, group=fanout.group)
        for (name, shp), off, n in zip(bucket, offsets, numels, strict=True):
            yield name, flat[off : off + n].view(shp)
        bucket, size = [], 0
        del flat


def _count(
    weights: Iterator[tuple[str, torch.Tensor]], counter: SyncCounter
) -> Iterator[tuple[str, torch.Tensor]]:
    for name, t in weights:
        counter.bytes += t.numel() * t.element_size()
        counter.num_tensors += 1
        yield name, t


def sync_weights(
    model: nn.Module,
    engine: RolloutEngine | None,
    *,
    bucket_mb: float = DEFAULT_BUCKET_MB,
    check: SyncCheck | None = None,
    fanout: Fanout | None = None,
    device: torch.device | None = None,
    dtype: torch.dtype | None = None,
) -> SyncStats:
    """Load the trainer's current weights into the engine, in place; with ``check``, prove they arrived.

    Every rank calls it. The check fingerprints the full tensors as they stream past (no second
    gather), asks the engine for the same fingerprint through its kernels, and raises WeightSyncError
    on every rank together if any rank's engine differs.

    With ``fanout`` (split placement), ranks that hold no shards pass a meta-device copy of the actor
    as ``model`` (names and shapes only) and ``device``, and receive the weights from ``fanout.src``.

    ``engine`` None (async placement: a trainer rank, the sender among them): the rank gathers (and
    sends) but loads nothing and checks nothing of its own; ``dtype`` is then the engines' dtype. It still
    takes part in the check's verdict, so a stale engine stops every rank.
    """
    if engine is None and dtype is None:
        raise ValueError("sync_weights without an engine needs the engines' dtype")
    dtype = dtype if dtype is not None else engine.dtype  # type: ignore[union-attr]
    t0 = time.perf_counter()
    # FSDP2 keeps the root unit's parameters unsharded after a forward (reshard_after_forward=False):
    # a full copy that would otherwise sit in memory through generation. Resharding first frees it
    # and makes every parameter a dim-0 shard, gathered in one pass.
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()
    device = device or next(model.parameters()).device
    counter = SyncCounter()
    sent = Fingerprint()
    with torch.no_grad():
        weights: Iterator[tuple[str, torch.Tensor]] | None = None
        if fanout is None or not fanout.receiving:
            weights = engine_weights(
                model,
                iter_full_tensors(
                    trainer_weights(model),
                    dtype=dtype,
                    bucket_mb=bucket_mb,
                    counter=counter,
                    device=device,
                ),
            )
        if fanout is not None and (fanout.receiving or dist.get_rank() == fanout.src):
            shapes = engine_shapes(model)
            weights = _forward(weights, shapes, dtype, fanout, int(bucket_mb * 1e6), device)
            if fanout.receiving:
                weights = _count(weights, counter)
        assert weights is not None
        if engine is None:
            for _ in weights:  # drain: the gathers (and the sender's broadcasts) run as it is consumed
                pass
            load = LoadSeconds()
        else:
            if check is not None:
                weights = observe(weights, sent, check.seed, tied_uses(model))
                weights = observe_experts(weights, ExpertOutputs(sent, check.seed))
            load = engine.load_weights(weights)
    t_check = time.perf_counter()
    groups = 0
    if check is not None:
        divergences = (
            [] if engine is None else compare(engine.weight_fingerprint(check.seed), sent, check.tol)
        )
        groups = len(sent.values)
        # Every rank stops together, also those whose own engine is fine (another engine may not be).
        failed = all_reduce_max({"failed": float(bool(divergences))}, device)["failed"]
        if failed:
            if not divergences:
                raise WeightSyncError(
                    f"weight sync check (seed {check.seed}) failed on another rank's engine; its log "
                    "says which layers differ"
                )
            raise sync_error(divergences, f"(seed {check.seed})")
    done = time.perf_counter()
    stats = SyncStats(
        done - t0,
        counter.bytes,
        counter.num_buckets,
        counter.num_tensors,
        check_seconds=done - t_check,
        checked_groups=groups,
        load=load if isinstance(load, LoadSeconds) else LoadSeconds(),  # an engine that does not say
    )
    log.debug("weight sync: %s", stats)
    return stats


def sync_with_fallback(
    sync: Callable[[], SyncStats], engine: RolloutEngine | None, device: torch.device, auto: bool
) -> SyncStats:
    """``sync()``, a checked :func:`sync_weights`; under ``rollout.weight_load=auto`` (``auto``), once more
    with vLLM's reload if the check failed on an engine that loaded directly.

    ``auto`` chooses the direct load from what it can see (CUDA, unquantized: the layers compute from
    their parameters). A vLLM release whose loaders or kernels break that assumption (a processed copy, a
    layout the loaders rewrite) is what the check catches, and the reload, which re-processes every layer,
    does not depend on it: better a run that goes on, slower, with a warning, than one that stops at its
    first sync. Every rank raised WeightSyncError together (the verdict is all-reduced), and whether any
    engine loaded directly is all-reduced too, so the ranks retry or raise together. An engine that fell
    back stays on reload; a failure then, or with the load chosen by hand, is raised.
    """
    try:
        return sync()
    except WeightSyncError as e:
        if not auto:
            raise
        direct = engine is not None and engine.weight_load == "direct"
        if not all_reduce_max({"direct": float(direct)}, device)["direct"]:
            raise
        if engine is not None and direct:
            engine.weight_load = "reload"
            log.warning(
                "weight sync check failed after a direct load (rollout.weight_load=auto chose it): this "
                "engine loads by vLLM's reload from now on, and the sync is repeated. Please report the "
                "vLLM version and device; set rollout.weight_load=reload to skip the attempt. The check "
                "said: %s",
                str(e).splitlines()[0],
            )
        return sync()
