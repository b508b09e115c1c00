"""Parallelism as free functions over a mesh, applied in a fixed order: activation checkpointing, compile,
then FSDP2 (or, for a one-rank mesh under model.fsdp_unit=none, bf16 autocast instead of FSDP2).

Each takes the model, a mesh and plain values (never the whole config) and logs what it did.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    FSDPModule,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
)

log = logging.getLogger(__name__)


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The repeated transformer blocks of an HF causal LM (``model.model.layers`` for Llama/Qwen/Mistral), or
    of a vision-language model's decoder (``model.model.text_model.layers``, Idefics3: its vision tower's
    blocks are :func:`vision_layers`)."""
    inner = getattr(model, "model", None)
    inner = getattr(inner, "text_model", inner)
    layers = getattr(inner, "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise TypeError(
            f"{type(model).__name__} has no model.layers ModuleList; spmdrl shards decoder-only HF models "
            "laid out like Llama/Qwen2 (model.model.layers)"
        )
    return layers


def vision_layers(model: nn.Module) -> nn.ModuleList | None:
    """A vision-language model's vision-tower blocks (Idefics3: ``model.model.vision_model.encoder.layers``);
    None for a text model. FSDP2 shards each as a unit of its own, like the decoder's layers."""
    tower = getattr(getattr(model, "model", None), "vision_model", None)
    layers = getattr(getattr(tower, "encoder", None), "layers", None)
    return layers if isinstance(layers, nn.ModuleList) else None


def apply_ac(model: nn.Module, mode: str = "full", every: int = 1) -> None:
    """Recompute activations in backward instead of keeping them, on every ``every``-th decoder layer (the
    every-th, 2 x every-th, ...: torchtitan's frequency), so only as many layers pay as memory needs.

    ``mode`` full: the whole layer (it keeps only its input; ~30% more compute). mlp: only the layer's MLP,
    whose activations (gate, its activation, up, their product: four of intermediate_size per token, each
    4-5x the hidden size in Llama/Qwen shapes) are the widest the layer keeps, for the recompute of one MLP forward; attention
    keeps its own.
    """
    if mode not in ("full", "mlp") or every < 1:
        raise ValueError(f"apply_ac: mode must be full or mlp and every >= 1, got {mode!r}, {every}")
    layers = decoder_layers(model)
    chosen = [i for i in range(len(layers)) if (i + 1) % every == 0]
    for i in chosen:
        if mode == "full":
            layers[i] = checkpoint_wrapper(layers[i], preserve_rng_state=False)
        else:
            mlp = getattr(layers[i], "mlp", None)
            if not isinstance(mlp, nn.Module):
                raise TypeError(
                    f"{type(layers[i]).__name__} has no .mlp module: use activation_checkpointing=full"
                )
            layers[i].mlp = checkpoint_wrapper(mlp, preserve_rng_state=False)
    log.info("activation checkpointing (%s) on %d of %d decoder layers", mode, len(chosen), len(layers))


def apply_compile(model: nn.Module) -> None:
    """torch.compile each decoder block in place (``Module.compile``: parameter names keep no ``_orig_mod``
    prefix, so checkpoints, the weight sync and LoRA see the eager names), after activation checkpointing
    and before fully_shard, as torchtitan orders them. Per block rather than the whole model: the blocks
    share one compiled graph (their parameters are graph inputs), and FSDP2's per-block all-gathers stay
    outside it. The first step of each new micro-batch shape compiles (tens of seconds on a CPU); after a
    second shape dynamo marks the sizes dynamic."""
    layers = decoder_layers(model)
    for layer in layers:
        layer.compile()
    log.info("torch.compile on %d decoder layers", len(layers))


def through_outputs(value: torch.Tensor, output: object) -> torch.Tensor:
    """``value`` plus an exact 0.0 computed from the model's output logits (a sum over none of them): the same
    numbers, now in a graph that passes through the model's outputs.

    For what a forward hook takes from inside the model (the LM head on chosen positions, a reward head's
    per-token scores): FSDP2 starts a unit's backward, and queues the reduce of every unit's gradients at the
    end of backward, from hooks on that unit's forward outputs. Per-layer units get there through their
    layers' outputs; a whole-model unit (model.fsdp_unit) has only the model's, so without this its
    gradients would never reach the sharded parameters.
    """
    logits = getattr(output, "logits", None)
    if isinstance(logits, torch.Tensor) and logits.requires_grad:
        return value + logits.flatten()[:0].sum()
    return value


# Set on a whole-model unit while gathered_through keeps it gathered between no-grad forwards.
_KEEP_GATHERED = "_spmdrl_keep_gathered"


def _reshard_after_no_grad(module: nn.Module, args: object, output: object) -> None:
    """A whole-model unit's forward hook: free the gathered parameters after a no-grad forward, which no
    backward will reshard (a training forward keeps them for its backward), unless a pass of several
    forwards keeps them (gathered_through)."""
    if (
        not torch.is_grad_enabled()
        and isinstance(module, FSDPModule)
        and not getattr(module, _KEEP_GATHERED, False)
    ):
        module.reshard()


@contextlib.contextmanager
def gathered_through(model: nn.Module) -> Iterator[None]:
    """A no-grad pass of several micro-batches: a whole-model unit is gathered once, by the first forward,
    and resharded when the pass ends, instead of once per micro-batch. Nothing for per-layer units, whose
    layers each gather per forward anyway."""
    if not isinstance(model, FSDPModule) or not hasattr(model, _KEEP_GATHERED):
        yield
        return
    setattr(model, _KEEP_GATHERED, True)
    try:
        yield
    finally:
        setattr(model, _KEEP_GATHERED, False)
        model.reshard()


# Set by apply_fsdp on the root: how its parameters are sharded, read by shard_ranks / offloaded_to_host.
# Not read off the parameters, which are plain tensors while a unit is gathered (the root of per-layer
# units stays gathered after a no-grad forward until the next backward).
_SHARD_RANKS = "_spmdrl_shard_ranks"
_OFFLOADED = "_spmdrl_offloaded_to_host"


def shard_ranks(model: nn.Module) -> int:
    """The ranks an FSDP2 model's parameters are sharded over (its mesh's last dimension: HSDP replicates
    over the others); 1 for a one-rank mesh or pure replication, and for a model that is not sharded."""
    return getattr(model, _SHARD_RANKS, 1)


def offloaded_to_host(model: nn.Module) -> bool:
    """Whether an FSDP2 model's shards live in host memory while it computes on another device
    (model.offload_params); False on a CPU mesh, where there is no other memory to keep them in."""
    return getattr(model, _OFFLOADED, False)


def gathered_between_micro_batches(model: nn.Module, keep: bool) -> None:
    """A whole-model unit (model.fsdp_unit) stays gathered after a training backward while ``keep``: the
    next micro-batch of the same mini-batch, on the same weights, then skips the gather's copy-in and
    copy-out and FSDP2's per-parameter work, at no memory a micro-batch does not already hold (the whole
    model is gathered in each). The mini-batch's last backward must reshard (``keep=False``): the
    optimizer steps the shards, and spmdrl.optim.clip_grad_norm refuses a model left gathered.
    Nothing for per-layer units, which would keep every layer gathered at once."""
    if isinstance(model, FSDPModule) and hasattr(model, _KEEP_GATHERED):
        model.set_reshard_after_backward(not keep)


def apply_autocast(model: nn.Module, param_dtype: torch.dtype, device_type: str) -> None:
    """model.fsdp_unit=none: no FSDP2, so its mixed precision is autocast's: the model's forward (and so the
    backward of what it records) runs under ``torch.autocast(param_dtype)`` over the float32 parameters, the
    matmuls in param_dtype and their gradients reaching the float32 parameters, as a one-GPU trainer
    without a framework (TRL under ``bf16=True``) runs. Each weight is cast once per forward (autocast's
    cache); FSDP2 would cast it in its gather. Nothing for float32 (the CPU's default): the bare module
    computes as FSDP2's one-rank unit does, kernel for kernel. A frozen model stored in param_dtype (the
    reference, spmdrl.models.build step 1c) computes in it either way.

    The numbers are autocast's, not FSDP2's bf16 parameters': the embeddings, norms' weights and the
    residual stream stay float32, the matmuls bf16 (the fused LM head casts its own inputs,
    spmdrl.models.head)."""
    if param_dtype == torch.float32:
        log.info("no FSDP2 (model.fsdp_unit=none): the bare module in float32")
        return
    forward = model.forward

    @functools.wraps(forward)
    def forward_under_autocast(*args: Any, **kwargs: Any) -> Any:
        with torch.autocast(device_type, dtype=param_dtype):
            return forward(*args, **kwargs)

    model.forward = forward_under_autocast  # type: ignore[method-assign]
    log.info("no FSDP2 (model.fsdp_unit=none): the bare module, its forward under %s autocast", param_dtype)


def apply_fsdp(
    model: nn.Module,
    mesh: DeviceMesh,
    *,
    param_dtype: torch.dtype,
    reduce_dtype: torch.dtype,
    reshard_after_forward: bool = True,
    offload: bool = False,
    whole_model: bool = False,
    experts_mesh: DeviceMesh | None = None,
) -> None:
    """fully_shard each decoder layer, then the root (embeddings, final norm, lm_head; tied weights stay tied);
    with ``whole_model``, the root alone, one unit for everything (model.fsdp_unit, below).

    Per-layer units let FSDP2 all-gather layer i+1 while layer i computes, and free each layer's
    full parameters after use. The root's last unit is not resharded after forward because
    backward needs it at once. ``offload``: the sharded parameters (and so their gradients and the
    optimizer state built on them) stay in host memory; FSDP2 copies each unit's shard to the compute
    device before its all-gather, and moves the reduced gradient shard back.

    The layers are resharded after forward on a one-rank mesh too, where their "all-gather" is a copy of
    their own shard that backward could reuse: kept, that copy would stay alive after every no-grad pass
    (the reference's, the old logprobs') until the next forward, a param_dtype copy of the whole model
    beside a waking engine, and ``reshard()`` on the root would no longer leave only DTensors.

    ``whole_model`` (model.fsdp_unit=model, and auto on a one-rank mesh: whole_model_unit): every unit costs
    host work in each forward and backward (its pre/post hooks, the gather's copy-in and copy-out, the
    reduce's), about 2 ms per layer per forward + backward measured on a CPU host, which a GPU step that the
    host bounds pays in full; one unit pays it once. That unit is the root: like the root of per-layer units
    it stays gathered from a training forward to its backward, which reshards it (its backward hooks sit on
    the model's outputs, which spmdrl.models.head ties the head's results to); a no-grad forward reshards it
    as it returns (_reshard_after_no_grad), for the reason above: no copy of the model outlives a no-grad
    pass (a pass of several micro-batches gathers it once: gathered_through).

    ``experts_mesh`` (parallel.ep > 1): the 2-D ("efsdp", "ep") mesh of the experts, which
    spmdrl.models.expert_parallel.apply_ep has already made DTensors on its ``ep`` dimension: FSDP2 shards
    them over ``efsdp`` (the ranks holding the same experts) and every other parameter over ``mesh``, in the
    same units (torchtitan's way: a per-parameter mesh from the unit's shard_placement_fn).
    """
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    placement_fn = _experts_placement(model, experts_mesh) if experts_mesh is not None else None
    # Pinned host memory makes the copies asynchronous; there is nothing to pin for on a CPU mesh.
    policy = CPUOffloadPolicy(pin_memory=mesh.device_type == "cuda") if offload else OffloadPolicy()
    layers = decoder_layers(model)
    if not whole_model:
        for layer in [*(vision_layers(model) or ()), *layers]:
            fully_shard(
                layer,
                mesh=mesh,
                mp_policy=mp,
                reshard_after_forward=reshard_after_forward,
                offload_policy=policy,
                shard_placement_fn=placement_fn,
            )
    fully_shard(
        model,
        mesh=mesh,
        mp_policy=mp,
        reshard_after_forward=False,
        offload_policy=policy,
        shard_placement_fn=placement_fn,
    )
    setattr(model, _SHARD_RANKS, mesh.size(mesh.ndim - 1))
    setattr(model, _OFFLOADED, offload and mesh.device_type != "cpu")
    if whole_model:
        setattr(model, _KEEP_GATHERED, False)
        model.register_forward_hook(_reshard_after_no_grad)
    # Sum gradients over ranks instead of averaging: every loss already divides by the global count of
    # its units (spmdrl/algos/aggregation.py), so no loss needs to know the world size (torchtitan's way).
    # A plain SUM collective, not PREMUL_SUM(1.0): gloo has no PREMUL_SUM, and on NCCL the two agree.
    for module in model.modules():
        if isinstance(module, FSDPModule):
            set_factor = (
                getattr(module, "set_gradient_divide_factor", None) or module.set_reduce_scatter_divide_factor
            )
            set_factor(1.0)
            if hasattr(module, "set_force_sum_reduction_for_comms"):
                module.set_force_sum_reduction_for_comms(True)
    log.info(
        "FSDP2 over mesh %s (%s): %s, param %s, reduce %s, gradients summed over ranks, "
        "layers resharded after forward: %s%s",
        tuple(mesh.shape),
        ",".join(mesh.mesh_dim_names or ()),
        f"the whole model one unit ({len(layers)} layers)"
        if whole_model
        else f"{len(layers) + len(vision_layers(model) or ())} layer units + root",
        param_dtype,
        reduce_dtype,
        reshard_after_forward,
        ", parameters offloaded to host memory" if offload else "",
    )
    if experts_mesh is not None:
        log.info("FSDP2 shards the experts over mesh %s (efsdp,ep)", tuple(experts_mesh.shape))


def _experts_placement(model: nn.Module, experts_mesh: DeviceMesh) -> Callable[[nn.Parameter], Any]:
    """FSDP2's shard_placement_fn under expert parallelism: the experts' DTensors dim 0 over ``efsdp``,
    every other parameter FSDP2's default (dim 0 over the unit's mesh)."""
    from torch.distributed.fsdp._fully_shard._fsdp_common import FSDPMeshInfo, ShardPlacementResult
    from torch.distributed.tensor import DTensor, Shard

    efsdp = FSDPMeshInfo(experts_mesh["efsdp"], shard_mesh_dim=0)
    experts = {id(p) for p in model.parameters() if isinstance(p, DTensor)}

    def placement(param: nn.Parameter) -> Any:
        if id(param) in experts:
            return ShardPlacementResult(placement=Shard(0), mesh_info=efsdp)
        return None

    return placement
