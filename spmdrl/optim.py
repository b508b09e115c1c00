"""Optimizer and learning-rate schedule.

The schedule (:func:`lr_lambda`) is a linear warm-up whose first step already trains at
``lr / warmup_steps``, then constant or a cosine down to ``min_lr_ratio * lr``, reached at
``total_steps`` and held after it. Why not transformers' schedulers: none gives this sequence.
``get_constant_schedule_with_warmup`` and ``get_cosine_with_min_lr_schedule_with_warmup`` (and verl's
own, by default) run the first warm-up step at LR 0, which in RL spends a whole rollout, reward and
update on no change; after the warm-up the latter equals ours step for step, and its ``_lr_rate``
variant, whose warm-up matches ours, moves the decay one step earlier and has no constant form. Taking
either would change the LR of every recipe with a warm-up (grpo_tiny, sft_tiny, grpo_tools_tiny, whose
results the docs quote) for no gain in function; tests/unit/test_optim.py pins the difference. The
schedule's settings are not saved (the lambda is a plain function, so the LambdaLR state holds only the
step count and the LRs): a resumed run rebuilds it from its config and goes on from the saved step.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from spmdrl.trainer_config import OptimConfig


def build_optimizer(model: nn.Module, cfg: OptimConfig) -> torch.optim.Optimizer:
    # After a forward, FSDP2's root unit (reshard_after_forward=False) exposes its unsharded parameters,
    # which never receive gradients: an optimizer built on them would silently never train the
    # embeddings and final norm. Resharding first makes model.parameters() the sharded DTensors.
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()
    # Norms and biases are not decayed (the usual transformer recipe).
    decay, no_decay = [], []
    for p in model.parameters():
        if p.requires_grad:
            (decay if p.ndim >= 2 else no_decay).append(p)
    groups = [
        {"params": decay, "weight_decay": cfg.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    # On CUDA fused=True: one kernel for the whole update of every shard, its step counters on the device
    # (as torchtitan runs AdamW under FSDP2). Elsewhere foreach=True: a few multi-tensor kernels instead
    # of a Python loop per parameter; CPU runs (and their golden update) keep it. With model.offload_params
    # the shards live in host memory, so that is foreach too.
    on_cuda = bool(decay or no_decay) and all(p.device.type == "cuda" for p in decay + no_decay)
    kind = {"fused": True} if on_cuda else {"foreach": True}
    return ShardLocalAdamW(groups, lr=cfg.lr, betas=(cfg.betas[0], cfg.betas[1]), eps=cfg.eps, **kind)


def _local(t: torch.Tensor) -> torch.Tensor:
    # The DTensor's own local tensor: writes to it are writes to the shard. Read as the attribute, not through
    # to_local(), an autograd function (a view and a graph node per tensor with grad enabled, as in the clip:
    # ~35 us per tensor on a CPU host, 10 ms for 290 tensors, more than the rest of the clip).
    return t._local_tensor if isinstance(t, DTensor) else t


class ShardLocalAdamW(torch.optim.AdamW):
    """AdamW that steps FSDP2's DTensor shards as the plain tensors they hold.

    AdamW is elementwise, so each rank's shard of a parameter steps alone, with the same kernels
    (fused or foreach) on the same numbers: the result is the DTensor step's to the last bit
    (tests/unit/test_optim.py). What it saves is DTensor's dispatch of those multi-tensor kernels, host time
    per step that grows with the parameter count (benchmarks/optimizer_step.py measures both; the figures
    are in docs/performance.md). The state stays DTensors
    (created by the base class from the parameters), so checkpoints save and reshard it as before.
    """

    def _init_group(self, group: dict, *lists: list[torch.Tensor]) -> bool:  # type: ignore[override]
        # Adam's lists, in its order: params with a gradient, gradients, the two moments, amsgrad's maximum,
        # the step counters (plain tensors already). Passed through whole, so the signature is Adam's own.
        has_complex = super()._init_group(group, *lists)
        for tensors in lists:
            tensors[:] = [_local(t) for t in tensors]
        return has_complex


def lr_lambda(step: int, *, warmup_steps: int, total_steps: int, schedule: str, min_lr_ratio: float) -> float:
    """Multiplier of the base LR at optimizer step ``step`` (0-based): linear warm-up, then constant or cosine."""
    if warmup_steps > 0 and step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "constant":
        return 1.0
    decay_steps = max(total_steps - warmup_steps, 1)
    progress = min((step - warmup_steps) / decay_steps, 1.0)
    return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def build_lr_scheduler(
    opt: torch.optim.Optimizer, cfg: OptimConfig, total_steps: int
) -> torch.optim.lr_scheduler.LambdaLR:
    def fn(step: int) -> float:
        return lr_lambda(
            step,
            warmup_steps=cfg.warmup_steps,
            total_steps=total_steps,
            schedule=cfg.schedule,
            min_lr_ratio=cfg.min_lr_ratio,
        )

    return torch.optim.lr_scheduler.LambdaLR(opt, fn)


def clip_grad_norm(model: nn.Module, max_norm: float) -> float:
    """Clips in place; returns the total norm before clipping (a float every rank agrees on).

    With FSDP2 the grads are DTensor shards; clip_grad_norm_ reduces the norm over the mesh.
    """
    every = list(model.parameters())  # one walk of the module tree (~5 ms for a 24-layer model on a CPU host)
    if isinstance(model, FSDPModule) and not all(isinstance(p, DTensor) for p in every):
        # Every unit reshards in its post-backward; one still gathered had none: its gradients sit on the
        # gathered copy, and the optimizer, which steps the shards, would silently skip them.
        raise RuntimeError(
            f"FSDP2's backward did not finish on {type(model).__name__}: some parameters are still gathered "
            "after backward, their gradients never reduced into the shards. The loss must pass through the "
            "model's outputs (spmdrl.models.parallelize.through_outputs)"
        )
    params = [p for p in every if p.grad is not None]
    if not params:  # a silent no-op update otherwise
        raise RuntimeError(
            f"no parameter of {type(model).__name__} has a gradient after backward: the loss does not depend on "
            "the model's outputs (with FSDP2 a loss must pass through them, or the gradients are never reduced "
            "into the sharded parameters: spmdrl.models.parallelize.through_outputs)"
        )
    grads = [p.grad for p in params]
    limit = max_norm if max_norm > 0 else float("inf")
    if not isinstance(grads[0], DTensor):
        return float(torch.nn.utils.clip_grad_norm_(params, limit))
    return float(_clip_shards(grads, limit))


def _clip_shards(grads: list[torch.Tensor], max_norm: float) -> torch.Tensor:
    """clip_grad_norm_ over DTensor gradients computed on their local shards, with DTensor's arithmetic in
    DTensor's order, so the norm and the clipped gradients are its own to the last bit
    (tests/unit/test_optim.py): each tensor's norm over its shards (per sharded mesh dimension, the square of
    each rank's norm summed over that dimension's ranks, one all_reduce for all tensors, and the square root
    taken), the total norm of those, the clip coefficient from it. What it saves is DTensor's dispatch of
    each multi-tensor op (benchmarks/optimizer_step.py). Replicated dimensions
    (HSDP's) hold the same gradients and are not summed. Returns the total norm before clipping.

    Under expert parallelism (parallel.ep) the experts' gradients live on another mesh (efsdp x ep) than the
    rest: each group of one mesh and placement has its norms reduced over its own dimensions, and the total
    is over every group's."""
    groups: dict[tuple[object, object], list[torch.Tensor]] = {}
    for g in grads:
        if not isinstance(g, DTensor):
            raise ValueError("clip_grad_norm: every gradient must be a DTensor when one is")
        groups.setdefault((g.device_mesh, g.placements), []).append(g)
    norms = torch.cat([_shard_norms(group) for group in groups.values()])
    total = torch.linalg.vector_norm(norms, 2.0)
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    torch._foreach_mul_([_local(g) for g in grads], coef)
    return total


def _shard_norms(grads: list[torch.Tensor]) -> torch.Tensor:
    """Each gradient's norm over all its shards; the gradients share one mesh and one placement."""
    first = grads[0]
    assert isinstance(first, DTensor)
    mesh, placements = first.device_mesh, first.placements
    norms = torch.stack(torch._foreach_norm([_local(g) for g in grads], 2.0))
    for dim, placement in enumerate(placements):
        # _StridedShard (FSDP2's shard of the experts over efsdp, on top of their ep shard) is no subclass
        # of Shard in torch 2.13, but its ranks hold disjoint parts all the same.
        if isinstance(placement, (Shard, _StridedShard)):
            norms = norms**2.0
            if mesh.size(dim) > 1:  # on the mesh's device: offloaded shards' norms are on the CPU
                on_mesh = norms.to(mesh.device_type)
                dist.all_reduce(on_mesh, group=mesh.get_group(dim))
                norms = on_mesh.to(norms.device)
            norms = norms ** (1.0 / 2.0)
    return norms


class OptimizerOffload:
    """The optimizer's per-parameter state (AdamW's moments) in host memory outside ``on_device()`` blocks
    (verl's optimizer_offload): the update phase has it on the GPU, the rollout and the log-prob passes
    get its memory.

    Each state tensor gets one host buffer for the whole run, pinned on CUDA, so both copies are
    asynchronous DMA instead of pageable copies, and nothing is allocated per step. FSDP2's state is
    DTensors: the buffers hold their local shards, and the DTensor is rebuilt around the moved shard with
    its mesh, placements and global shape unchanged. The 0-dim ``step`` counters are never moved:
    AdamW's non-capturable step expects them on the CPU.
    """

    def __init__(self, opt: torch.optim.Optimizer, device: torch.device, enabled: bool = True) -> None:
        self.opt, self.device, self.enabled = opt, device, enabled
        self._host: dict[tuple[int, str], torch.Tensor] = {}

    def _tensors(self) -> Iterator[tuple[tuple[int, str], dict, str, torch.Tensor]]:
        for state in self.opt.state.values():
            for key, value in state.items():
                if isinstance(value, torch.Tensor) and value.dim() > 0:
                    yield (id(state), key), state, key, value

    def offload(self) -> None:
        # A resumed checkpoint rebuilds the state dicts: buffers of the replaced ones are dropped, not kept.
        live = {slot for slot, *_ in self._tensors()}
        self._host = {slot: buf for slot, buf in self._host.items() if slot in live}
        for slot, state, key, value in self._tensors():
            local = value.to_local() if isinstance(value, DTensor) else value
            host = self._host.get(slot)
            if host is None or host.shape != local.shape or host.dtype != local.dtype:
                host = torch.empty(local.shape, dtype=local.dtype, pin_memory=local.is_cuda)
                self._host[slot] = host
            if host.data_ptr() != local.data_ptr():
                host.copy_(local, non_blocking=local.is_cuda)
            state[key] = _rewrap(value, host)
        if self.device.type == "cuda":
            # The host copies must land before anything reads them (a checkpoint save, say).
            torch.cuda.current_stream(self.device).synchronize()

    def load(self) -> None:
        for _, state, key, value in self._tensors():
            local = value.to_local() if isinstance(value, DTensor) else value
            state[key] = _rewrap(value, local.to(self.device, non_blocking=True))

    @contextlib.contextmanager
    def on_device(self) -> Iterator[None]:
        """The state is on the compute device inside the block, in host memory after it (when enabled).
        AdamW creates its state on the first step, so the first block starts with nothing to move."""
        if not self.enabled:
            yield
            return
        self.load()
        try:
            yield
        finally:
            self.offload()


def _rewrap(like: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """``local`` as the same kind of tensor as ``like``: a DTensor with like's spec (mesh, placements,
    global shape), its local shard wherever ``local`` is.

    Not ``DTensor.from_local``: that moves a host shard onto the mesh's device, which silently undid the
    offload on the H100 (the moments never left the GPU). This is how FSDP2 itself wraps its offloaded
    shards (``_from_local_no_grad``): the DTensor constructor with the spec.
    """
    if not isinstance(like, DTensor):
        return local
    return DTensor(local, like._spec, requires_grad=False)  # type: ignore[call-arg]
