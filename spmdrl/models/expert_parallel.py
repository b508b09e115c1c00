"""Expert parallelism (parallel.ep): each rank of an ep group holds E / ep of every MoE layer's experts, and
the tokens travel to them and back by all-to-all.

The experts seam only: transformers' MoE block runs its router (``mlp.gate``: logits, top-k weights and
indices) as it does without EP, then calls ``mlp.experts(hidden, top_k_index, top_k_weights)``, whose forward
:func:`apply_ep` replaces. That forward, on every rank of the ep group at once:

1. sorts this rank's (token, slot) pairs by expert (slot-major within an expert, the order transformers'
   own loop visits them) and exchanges the per-expert counts with the group;
2. sends each pair's hidden row to the rank holding its expert (all_to_all, variable splits);
3. runs each local expert on the rows it received (from every rank of the group);
4. sends the results back by the reverse all_to_all, and sums them into each token with the router's
   weights, in the order transformers' loop does.

Both all-to-alls are autograd-aware (:class:`_AllToAll`: the backward is the reverse exchange of the
gradients), so an expert's weight gradient collects every token of the group routed to it; FSDP2 then sums
it over the other ep groups (the ``efsdp`` dimension of the experts' mesh,
spmdrl.distributed.placement.Meshes.experts). Every rank of an ep group must run the same number of
forwards and backwards (each is a collective), as every rank of a role does (the same micro-batches).

The parameters stay transformers' fused 3-D ``gate_up_proj`` (E x 2I x H) and ``down_proj`` (E x H x I)
under their names, as DTensors ``Shard(0)`` on the ``ep`` mesh (FSDP2 shards them further, over
``efsdp``): the weight sync, the checkpoint and the export read them full like any DTensor.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from spmdrl.errors import ConfigError
from spmdrl.models.families import check_ep
from spmdrl.models.parallelize import decoder_layers

log = logging.getLogger(__name__)


class _AllToAll(torch.autograd.Function):
    """all_to_all_single with variable splits; its backward sends the gradients back the way they came."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, x: torch.Tensor, out_splits: list[int], in_splits: list[int], group: dist.ProcessGroup
    ) -> torch.Tensor:
        ctx.splits, ctx.group = (out_splits, in_splits), group
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, None, None, None]:  # type: ignore[override]
        out_splits, in_splits = ctx.splits
        back = grad.new_empty((sum(in_splits), *grad.shape[1:]))
        dist.all_to_all_single(back, grad.contiguous(), in_splits, out_splits, group=ctx.group)
        return back, None, None, None


def all_to_all(
    x: torch.Tensor, out_splits: list[int], in_splits: list[int], group: dist.ProcessGroup
) -> torch.Tensor:
    """Rows ``x`` (``in_splits[r]`` of them for rank r, in rank order) exchanged over ``group``; returns the
    rows received (``out_splits[r]`` from rank r). Differentiable: gradients take the reverse route."""
    return _AllToAll.apply(x, out_splits, in_splits, group)


def _local(t: torch.Tensor) -> torch.Tensor:
    # to_local() is autograd-aware: the local experts' gradients reach the DTensor parameter.
    return t.to_local() if isinstance(t, DTensor) else t


def ep_experts_forward(
    experts: nn.Module,
    group: dist.ProcessGroup,
    ep: int,
    hidden: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
) -> torch.Tensor:
    """transformers' Qwen3MoeExperts.forward with this rank's E / ep experts and all-to-all dispatch."""
    num_experts = experts.num_experts
    per_rank = num_experts // ep
    tokens, k = top_k_index.shape
    with torch.no_grad():
        # Pair i = slot * tokens + token: a stable sort by expert keeps slot-major order within each expert.
        expert_of_pair = top_k_index.t().reshape(-1)
        order = torch.argsort(expert_of_pair, stable=True)
        token_of_pair = torch.arange(tokens, device=hidden.device).repeat(k)[order]
        counts = torch.bincount(expert_of_pair, minlength=num_experts)
        # recv[s, l]: how many pairs rank s sends to this rank's local expert l.
        recv = torch.empty_like(counts)
        dist.all_to_all_single(recv, counts, group=group)
        recv_SL = recv.view(ep, per_rank)
        send_splits = counts.view(ep, per_rank).sum(1).tolist()
        recv_splits = recv_SL.sum(1).tolist()
        # Received rows come source-major; each local expert's rows gathered in source order.
        local_expert = torch.repeat_interleave(
            torch.arange(per_rank, device=hidden.device).repeat(ep), recv_SL.reshape(-1)
        )
        by_expert = torch.argsort(local_expert, stable=True)
        rows_per_expert = recv_SL.sum(0).tolist()
    received = all_to_all(hidden[token_of_pair], recv_splits, send_splits, group)[by_expert]
    gate_up, down = _local(experts.gate_up_proj), _local(experts.down_proj)
    outs = []
    for e, x in enumerate(received.split(rows_per_expert)):
        gate, up = nn.functional.linear(x, gate_up[e]).chunk(2, dim=-1)
        outs.append(nn.functional.linear(experts.act_fn(gate) * up, down[e]))
    computed = torch.cat(outs) if outs else received
    # Back to source-major order, then home.
    unsorted = torch.empty_like(computed).index_copy(0, by_expert, computed)
    returned = all_to_all(unsorted, send_splits, recv_splits, group)
    weights = top_k_weights.t().reshape(-1)[order]
    contribution = returned * weights[:, None]
    return torch.zeros_like(hidden).index_add(0, token_of_pair, contribution.to(hidden.dtype))


def moe_experts(model: nn.Module) -> list[nn.Module]:
    """Each decoder layer's experts module (``mlp.experts`` holding fused ``gate_up_proj``), in layer order."""
    found = []
    for layer in decoder_layers(model):
        mlp = getattr(layer, "mlp", None)
        experts = getattr(mlp, "experts", None)
        if experts is not None and isinstance(getattr(experts, "gate_up_proj", None), torch.Tensor):
            found.append(experts)
    return found


def apply_ep(model: nn.Module, ep_mesh: DeviceMesh) -> None:
    """Shards every MoE layer's experts over the 1-D ``ep_mesh`` (each rank keeps E / ep of them, a DTensor
    ``Shard(0)``) and gives the experts module the all-to-all forward. On a model still on the meta device,
    before FSDP2 (which shards them further over its own mesh, and gathers only this rank's experts)."""
    ep = ep_mesh.size()
    group = ep_mesh.get_group()
    rank = ep_mesh.get_local_rank()
    layers = moe_experts(model)
    if not layers:
        raise ConfigError(f"parallel.ep={ep}: {type(model).__name__} has no mixture-of-experts layers")
    check_ep(layers[0].num_experts, ep, type(model).__name__)
    for experts in layers:
        per_rank = experts.num_experts // ep
        for name in ("gate_up_proj", "down_proj"):
            full = getattr(experts, name)
            local = full.detach()[rank * per_rank : (rank + 1) * per_rank]
            shard = DTensor.from_local(local, ep_mesh, [Shard(0)], run_check=False)
            setattr(experts, name, nn.Parameter(shard, requires_grad=full.requires_grad))

        def forward(
            hidden: torch.Tensor,
            top_k_index: torch.Tensor,
            top_k_weights: torch.Tensor,
            _experts: nn.Module = experts,
        ) -> torch.Tensor:
            return ep_experts_forward(_experts, group, ep, hidden, top_k_index, top_k_weights)

        experts.forward = forward  # type: ignore[method-assign]
    log.info(
        "expert parallelism: %d MoE layers, %d experts each over %d ranks (%d per rank), all-to-all dispatch",
        len(layers),
        layers[0].num_experts,
        ep,
        layers[0].num_experts // ep,
    )
