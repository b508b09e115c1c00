"""Optimizer and learning-rate schedule."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule

from spmdrl.config import OptimConfig


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
    # foreach=True: one fused kernel over the DTensor shards instead of a Python loop per parameter.
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.betas[0], cfg.betas[1]), eps=cfg.eps, foreach=True)


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
    params = [p for p in model.parameters() if p.grad is not None]
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm if max_norm > 0 else float("inf"))
    if hasattr(norm, "full_tensor"):
        norm = norm.full_tensor()
    return float(norm)


def move_optimizer_state(opt: torch.optim.Optimizer, device: torch.device) -> None:
    """Move every per-parameter state tensor (AdamW's moments) to ``device``, in place.

    The 0-dim ``step`` counters stay where the optimizer made them: AdamW's non-capturable step
    expects them on the CPU.
    """
    non_blocking = device.type == "cuda"  # host -> GPU may overlap; GPU -> host must land before reuse
    for state in opt.state.values():
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                state[key] = value.to(device, non_blocking=non_blocking)


@contextlib.contextmanager
def optimizer_state_on(opt: torch.optim.Optimizer, device: torch.device, offload: bool) -> Iterator[None]:
    """With ``offload``, the optimizer state is on ``device`` inside the block and in host memory outside
    it (verl's optimizer_offload): the update phase has it, the rollout and the log-prob passes get its
    memory. AdamW creates its state on the first step, so the first block starts with nothing to move."""
    if not offload:
        yield
        return
    move_optimizer_state(opt, device)
    try:
        yield
    finally:
        move_optimizer_state(opt, torch.device("cpu"))
