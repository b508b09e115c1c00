"""When FSDP2 reduces a trained model's gradients over its micro-batches: trainer.defer_grad_sync, for every
trainer (the RL update, SFT, the reward model's)."""

from __future__ import annotations

import torch
from torch.distributed.fsdp import FSDPModule

from spmdrl.config_section import switch_mode
from spmdrl.models.parallelize import gathered_between_micro_batches, offloaded_to_host, shard_ranks


def defers_grad_sync(model: torch.nn.Module, setting: str | bool) -> bool:
    """trainer.defer_grad_sync resolved for ``model``: true / false as set; auto: auto_defers."""
    mode = switch_mode(setting)
    if mode != "auto":
        return mode == "true"
    return isinstance(model, FSDPModule) and auto_defers(shard_ranks(model), offloaded_to_host(model))


def auto_defers(shard_ranks: int, offloaded: bool) -> bool:
    """trainer.defer_grad_sync=auto: defer where that costs no memory. With the parameters sharded over one
    rank the shard is the whole gradient anyway, and between micro-batches the deferred gradients take its
    place; but not with the shards offloaded (model.offload_params): their gradients live in host memory,
    and the deferred ones would stay on the device, a reduce_dtype copy of the model that offloading is
    there to avoid."""
    return shard_ranks == 1 and not offloaded


def describe_grad_sync(model: torch.nn.Module, setting: str | bool) -> str:
    """The gradient reduce a trainer runs, for the start-up log."""
    if not isinstance(model, FSDPModule):
        return "gradients accumulate in the parameters, nothing to reduce (no FSDP2: model.fsdp_unit=none)"
    when = "once per optimizer step" if defers_grad_sync(model, setting) else "after every micro-batch"
    mode, ranks = switch_mode(setting), shard_ranks(model)
    return f"gradients reduced {when} (trainer.defer_grad_sync={mode}, {ranks} shard rank(s))"


def gradient_sync(model: torch.nn.Module, defer: bool, *, last: bool) -> None:
    """Before each micro-batch's forward. ``defer`` (defers_grad_sync): FSDP2 reduces the gradients only in
    the backward of a mini-batch's last micro-batch (one reduce per optimizer step instead of one per
    micro-batch); the ones before accumulate into each rank's unsharded gradients, which stay allocated
    until then (a reduce_dtype copy of the trained parameters per rank). Every rank must run the same
    number of micro-batches, so the collectives still pair up. A whole-model unit also stays gathered
    until that last backward (gathered_between_micro_batches): its weights do not change before the
    optimizer step."""
    if not isinstance(model, FSDPModule):
        return
    if defer:
        model.set_requires_gradient_sync(last)
    gathered_between_micro_batches(model, keep=not last)
