"""The step the tests of what travels with a moved row share (tests/unit/rl/test_role_rows_routing.py: router
replay's routing; test_role_rows_images.py: a VLM's images), on 2 gloo ranks: rank 0 generated the long
rows and rank 1 the short ones, so balancing moves rows; the teacher on rank 1 of its own sends every row
to rank 0."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from spmdrl.distributed.placement import Placement
from spmdrl.rl.batch import PolicyBatch

WORLD = 2
ROWS_PER_RANK = 4
N = WORLD * ROWS_PER_RANK


def step_rows(seed: int, extra: Callable[[torch.Generator, torch.Tensor], dict[str, Any]]) -> PolicyBatch:
    """Every row of the step in global order, with the fields ``extra(generator, attention_mask_BT)``
    returns (drawn after the lengths, before the tokens)."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.cat(
        [torch.randint(30, 40, (ROWS_PER_RANK,), generator=g), torch.randint(4, 9, (4,), generator=g)]
    )
    width = int(lengths.max())
    attn_BT = (torch.arange(width) < lengths[:, None]).long()
    resp_BT = attn_BT.bool() & (torch.arange(width) >= 2)
    fields = extra(g, attn_BT)
    return PolicyBatch(
        input_ids_BT=torch.randint(3, 500, (N, width), generator=g) * attn_BT,
        attention_mask_BT=attn_BT,
        response_mask_BT=resp_BT,
        engine_logprobs_BT=-torch.rand(N, width, generator=g) * resp_BT,
        advantages_BT=torch.randn(N, width, generator=g) * resp_BT,
        **fields,
    )


def local_rows(full: PolicyBatch, rank: int) -> PolicyBatch:
    """Rank ``rank``'s generated rows, trimmed to their own longest (as build_policy_batch makes them)."""
    rows = torch.arange(rank * ROWS_PER_RANK, (rank + 1) * ROWS_PER_RANK)
    return full.take(rows, int(full.attention_mask_BT[rows].sum(dim=1).max()))


def balance_and_send_to_actor(local: PolicyBatch, rank: int, world: int) -> dict:
    """Both moves, run by each rank: parallel.balance_tokens's (the rows it then holds, and their global
    indices), and the teacher's own rank's (every row to rank 0, the actor's only rank)."""
    from spmdrl.config import RLDerived
    from spmdrl.rl.role_rows import plan_rows, to_actor_ranks

    cpu = torch.device("cpu")
    rl = RLDerived(
        samples_per_prompt=2,
        train_ranks=world,
        mini_batches_per_step=1,
        per_rank_mini_batch_seqs=ROWS_PER_RANK,
        micro_batch_size=1,
        micro_batches_per_mini_batch=1,
        grad_accum_steps=1,
        optimizer_steps_per_step=1,
        max_model_len=128,
    )
    plan = plan_rows(True, Placement.colocated(world), rl, local, cpu)
    balanced, _ = plan.balance_colocated(local, local.response_mask_BT)
    assert balanced is not None and plan.actor is not None
    out: dict = {"balanced": balanced, "balanced_rows": torch.nonzero(plan.actor.owner_N == rank).flatten()}
    moved = to_actor_ranks(Placement.colocated(world).with_teacher(1), local, {}, cpu)
    out["to_actor"] = None if moved is None else moved[0]
    return out
