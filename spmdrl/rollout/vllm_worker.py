"""Functions that run inside vLLM's worker (``LLM.collective_rpc(fn)``), next to the engine's model.

With ``external_launcher`` the worker lives in this rank's process, so ``collective_rpc`` calls these
directly with the worker as first argument; each rank's call sees only its own TP shard of the model.
They are plain functions, not worker methods, so no vLLM class is patched.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from spmdrl.rollout import cpu_gemm, expert_probe
from spmdrl.rollout.copy_plan import CopyPlan
from spmdrl.rollout.fingerprint import (
    Fingerprint,
    expert_key,
    kernel_key,
    matrix_key,
    vector_key,
    whole_key,
    whole_sums,
)

log = logging.getLogger(__name__)


def _model(worker: Any) -> nn.Module:
    return worker.model_runner.get_model()


def reload_weights(worker: Any, weights: Iterable[tuple[str, torch.Tensor]]) -> list[str]:
    """vLLM's in-place checkpoint-format reload, then the packed CPU GEMM copies it did not rebuild (and,
    before it, the CPU fused-MoE kernels forgotten, so that it prepacks their experts again).

    Returns the names of the layers re-dispatched (on CPU, a tied LM head; on CUDA, none: nothing has
    a ``cpu_linear``).
    """
    model = _model(worker)
    before = cpu_gemm.snapshot(model)
    # The reload may replace parameters: a copy plan recorded before it would write into the old ones.
    if hasattr(model, _PLAN):
        delattr(model, _PLAN)
    cpu_gemm.forget_moe_kernels(model)
    worker.reload_weights(weights_iterator=iter(weights), is_checkpoint_format=True)
    return cpu_gemm.refresh_unprocessed(model, before)


# The model's CopyPlan, recorded at its first direct load (an attribute of the engine's model: it lives
# and dies with the parameters it points into).
_PLAN = "_spmdrl_copy_plan"


def load_weights_direct(worker: Any, weights: Iterable[tuple[str, torch.Tensor]]) -> list[str]:
    """The model's own ``load_weights``: each tensor's weight loader writes it (its TP slice, its place in
    a merged qkv / gate_up tensor) into the live parameter, with no re-processing. Only where the kernels
    read those parameters (CUDA's unquantized layers, the CPU torch path, which VLLMEngine checks once at
    build); the packed CPU paths dropped their weight after packing. Nothing needs re-dispatching: returns
    no layer names (:func:`reload_weights` returns those it refreshed).

    The first load records what the loaders copied where; later loads replay it as batched copies
    (spmdrl.rollout.copy_plan), with the loaders only for tensors the plan cannot replay."""
    model = _model(worker)
    plan = getattr(model, _PLAN, None)
    if plan is None:
        plan = CopyPlan.record(model, weights, model.load_weights)
        setattr(model, _PLAN, plan)
        log.info(
            "direct weight load: %d of %d tensors replay as batched copies from the next sync on",
            plan.replayed_names,
            len(plan.entries),
        )
    else:
        plan.load(weights, model.load_weights)
    return []


def copy_plan_names(worker: Any) -> tuple[int, int] | None:
    """(tensors the direct load replays as copies, tensors it has seen), None before its first load."""
    plan = getattr(_model(worker), _PLAN, None)
    return None if plan is None else (plan.replayed_names, len(plan.entries))


def gemm_paths(worker: Any) -> dict[str, int]:
    return cpu_gemm.gemm_paths(_model(worker))


def _is_sliced(module: nn.Module) -> bool:
    """Whether the module's tensors are split over the TP group (else every TP rank holds a full copy)."""
    return int(getattr(module, "tp_size", 1)) > 1


def _output_sliced(module: nn.Module) -> bool:
    out, per = getattr(module, "output_size", None), getattr(module, "output_size_per_partition", None)
    return _is_sliced(module) and out is not None and per is not None and per < out


@dataclass(frozen=True)
class _Probed:
    """A layer the check probes through its kernel (a linear layer, an LM head): its input width, this
    rank's slice of it, and whether TP splits it."""

    name: str
    module: nn.Module
    k_global: int
    k_local: int
    start: int
    sliced: bool


@dataclass(frozen=True)
class _Read:
    """A tensor the check reads directly (an embedding table, a norm, a bias), by its module and name: a
    reload may replace the parameter object, never the module."""

    name: str
    module: nn.Module
    pname: str
    matrix: bool
    sliced: bool
    # More than 2 dimensions (a vision tower's patch-embedding convolution): summed whole.
    whole: bool = False


@dataclass(frozen=True)
class _Experts:
    """A fused-MoE layer, whose experts the check sums whole (spmdrl.rollout.fingerprint): its w13 (each
    expert's gate and up rows, this rank's TP slice of them) and w2 (down, this rank's slice)."""

    name: str
    module: nn.Module


@dataclass(frozen=True)
class _ProbePlan:
    """What :func:`fingerprint` probes and reads, found once per model: walking the modules and
    parameters and classifying each cost more host time per sync than the probes' own launches."""

    layers: list[_Probed]
    tensors: list[_Read]
    experts: list[_Experts]
    device: torch.device

    @classmethod
    def of(cls, model: nn.Module) -> _ProbePlan:
        from vllm.model_executor.layers.linear import LinearBase, ReplicatedLinear
        from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding

        layers: list[_Probed] = []
        probed: set[int] = set()
        # A model with no LM head module computes its logits from the input embedding itself (vLLM 0.32's
        # Gemma 2: logits_processor(model.embed_tokens, ...); 0.24's tied Qwen2: lm_head = model.embed_tokens).
        # That embedding is then two layers, as the trainer counts a tied embedding: the lookup (read
        # directly below) and the output projection, probed here through the kernel that computes the
        # logits (on CPU, a packed copy the reload must rebuild).
        head_less = not any(isinstance(m, ParallelLMHead) for m in model.modules())
        for name, m in model.named_modules():
            if isinstance(m, LinearBase):
                # (A replicated layer, such as an MoE router, may have no per-partition size: all of it.)
                k_global = int(m.input_size)
                k_local = int(getattr(m, "input_size_per_partition", k_global))
                start = int(getattr(m, "tp_rank", 0)) * k_local if k_local < k_global else 0
            elif isinstance(m, ParallelLMHead) or (
                head_less and isinstance(m, VocabParallelEmbedding) and vector_key(name).startswith("top")
            ):
                k_global = k_local = int(m.embedding_dim)
                start = 0
            else:
                continue
            # (A ReplicatedLinear, such as an MoE router, carries the TP size but every rank holds all of it.)
            sliced = _is_sliced(m) and not isinstance(m, ReplicatedLinear)
            layers.append(_Probed(name, m, k_global, k_local, start, sliced))
            if isinstance(m, (ParallelLMHead, LinearBase)):
                probed.add(id(m))  # (a head-less model's embedding is also read directly, as the lookup)
        tensors: list[_Read] = []
        experts: list[_Experts] = []
        for name, m in model.named_modules():
            if "w13_weight" in m._parameters:
                experts.append(_Experts(name, m))
            for pname, p in m.named_parameters(recurse=False):
                if pname == "weight" and id(m) in probed:
                    continue
                full = f"{name}.{pname}" if name else pname
                if p.dim() == 2:  # an embedding table (vocab-parallel when TP splits it)
                    # (A tied LM head that *is* the embedding module, vLLM 0.24's Qwen2: lm_head =
                    # model.embed_tokens, makes the model head-less: its LM-head use was probed above.)
                    tensors.append(_Read(full, m, pname, True, _is_sliced(m)))
                elif p.dim() == 1:
                    tensors.append(
                        _Read(full, m, pname, False, _output_sliced(m) and hasattr(p, "output_dim"))
                    )
                elif p.dim() > 2 and "w13_weight" not in m._parameters:  # (experts: summed per expert below)
                    tensors.append(_Read(full, m, pname, False, False, whole=True))
        return cls(layers, tensors, experts, next(model.parameters()).device)


def _times(sliced: bool, tp_rank: int) -> int:
    """How often this rank counts a tensor: a TP-split one on every rank, a replicated one on rank 0 only."""
    return 1 if sliced or tp_rank == 0 else 0


# Elements of expert weights summed per float64 copy (8 MB each).
_SUM_CHUNK_ELEMENTS = 1 << 20

# The model's _ProbePlan, found at its first fingerprint (an attribute of the engine's model, like _PLAN).
_PROBE_PLAN = "_spmdrl_probe_plan"


@torch.no_grad()
def fingerprint(worker: Any, seed: int, tp_rank: int, dtype: torch.dtype) -> Fingerprint:
    """This rank's share of the engine's fingerprint (see spmdrl.rollout.fingerprint).

    Linear layers and LM heads are probed through their kernels (``quant_method.apply``) with one-hot
    rows; other tensors are read directly. A tensor replicated over the TP group counts on TP rank 0
    only (with zero weight elsewhere, so every rank has the same keys), a split one on every rank: the
    sum over the group is then the whole model's, whatever the split. Fused-MoE experts are summed whole,
    per expert, from the parameters their kernel reads (every rank holds a TP slice of every expert; zero
    padding adds nothing), and probed through that kernel (spmdrl.rollout.expert_probe: each rank's
    outputs are partial sums over its slice, which add up over the group).
    """
    model = _model(worker)
    plan = getattr(model, _PROBE_PLAN, None)
    if plan is None:
        plan = _ProbePlan.of(model)
        setattr(model, _PROBE_PLAN, plan)
    fp = Fingerprint()
    probes = fp.probes(seed)
    for layer in plan.layers:
        m = layer.module
        y = m.quant_method.apply(
            m, probes.get(layer.k_global, layer.k_local, layer.start, dtype, plan.device)
        )
        fp.add(matrix_key(layer.name, layer.k_global), layer.name, y, _times(layer.sliced, tp_rank))
    for t in plan.tensors:
        p = t.module._parameters[t.pname]
        times = _times(t.sliced, tp_rank)
        if t.whole:
            fp.add_sums(whole_key(t.name), t.name, whole_sums(p), times)
        elif t.matrix:
            fp.add_matrix(t.name, p, seed, times)
        else:
            fp.add_vector(t.name, p, times)
    for layer in plan.experts:
        m = layer.module
        for pname, part in (("w13_weight", "gate_up"), ("w2_weight", "down")):
            w = m._parameters[pname]
            # A few experts at a time: the float64 copy of a large model's whole layer would be gigabytes.
            step = max(1, _SUM_CHUNK_ELEMENTS // max(1, w[0].numel()))
            for first in range(0, w.shape[0], step):
                sums_E3 = whole_sums(w[first : first + step], dims=(1, 2))
                for i in range(sums_E3.shape[0]):
                    e = first + i
                    fp.add_sums(expert_key(layer.name, e, part), f"{layer.name}.{pname}[{e}]", sums_E3[i])
        # Through the kernel too (spmdrl.rollout.expert_probe): its outputs for one-hot rows, one expert each.
        experts, hidden = m._parameters["w2_weight"].shape[:2]
        x, weights, ids, k = expert_probe.engine_rows(hidden, experts, seed, dtype, plan.device)
        y = m.quant_method.apply(m, x, weights, ids, None, None)
        s = expert_probe.signs(hidden, seed, y.device)
        for e in range(experts):
            fp.add_sums(
                kernel_key(layer.name, e), layer.name, expert_probe.reduce_outputs(y[e * k : (e + 1) * k], s)
            )
    return fp
