"""Where a step's rows live for each role, and the moves that put them there (one RL step's data plane).

Colocated without balancing, nothing moves: every rank trains on the rollouts it generated. Otherwise
the rows are numbered globally (spmdrl.distributed.exchange) and

- ``split``: the rollouts go to the actor's ranks and to the critic's ranks; the critic's values go to
  the actor (GAE runs there, next to the KL and correction terms); the returns and the final response
  mask go back to the critic. These moves are the PPO recipe's (recipes/ppo.py), over ``RowPlan.move``;
- ``parallel.balance_tokens``: each role's layout gives every rank the same number of rows and about
  the same number of tokens, mini-batch by mini-batch (``RowLayout.balanced``). Colocated, the rows
  move only after the advantages, which may need a rank's whole groups (``RowPlan.balance_colocated``);
  so do they under ``async``, among the trainer ranks that received them;
- ``parallel.teacher_ranks`` (the teacher on ranks of its own): every rank's rows, with the teacher's
  logprobs (spmdrl.rl.experience.teacher_logprobs_apart), go to the actor's ranks in equal consecutive
  blocks of whole prompt groups (``to_actor_ranks``), and balancing, if asked, moves them among those.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from spmdrl.derived import RLDerived
from spmdrl.distributed.exchange import RowLayout, gather_lengths, move_rows
from spmdrl.distributed.placement import Placement
from spmdrl.rl.batch import IMAGES, ROUTED, PolicyBatch


@dataclass
class RowPlan:
    """This step's row layouts: as generated (``world``) and for each trained role's ranks, with the token
    imbalance of each (``metrics``). No layout: no row moves (colocated, not balanced)."""

    placement: Placement
    balance: bool
    device: torch.device
    width: int = 0
    world: RowLayout | None = None  # as generated
    actor: RowLayout | None = None
    critic: RowLayout | None = None
    metrics: dict[str, float] = field(default_factory=dict)

    @property
    def moves(self) -> bool:
        return self.world is not None

    def move(
        self,
        fields: dict[str, torch.Tensor] | None,
        spec: dict[str, torch.dtype],
        src: RowLayout,
        dst: RowLayout,
    ) -> dict[str, torch.Tensor] | None:
        """The rows of ``fields`` (None on a rank that holds none) from layout ``src`` to layout ``dst``
        (None on a rank of no ``dst`` rank). Every rank calls it. Router replay's routing (PolicyBatch's
        ROUTED field, tokens x layers x k wide) and a VLM's images (IMAGES, a row's images' pixels wide)
        make every field travel at its own width."""
        width = None if ROUTED in spec or IMAGES in spec else self.width
        return move_rows(fields, spec, src, dst, width=width, device=self.device)

    def balance_colocated(
        self, batch: PolicyBatch | None, sampled_mask_BT: torch.Tensor | None
    ) -> tuple[PolicyBatch | None, torch.Tensor | None]:
        """Colocated (or on the trainer ranks of parallel.placement=async) with balance_tokens: the whole
        batch (and the sampled mask) to the balanced layout; only the ranks that hold rows call it."""
        if self.placement.is_split or not self.balance:
            return batch, sampled_mask_BT
        assert batch is not None and sampled_mask_BT is not None
        assert self.world is not None and self.actor is not None
        fields = {**batch.tensors(), "sampled_mask_BT": sampled_mask_BT}
        spec = {k: v.dtype for k, v in fields.items()}
        out = self.move(fields, spec, self.world, self.actor)
        assert out is not None
        sampled = out.pop("sampled_mask_BT")
        return PolicyBatch.from_tensors(out), sampled


def plan_rows(
    balance_tokens: bool,
    placement: Placement,
    rl_actor: RLDerived,
    local: PolicyBatch,
    device: torch.device,
    rl_critic: RLDerived | None = None,
    group: dist.ProcessGroup | None = None,
) -> RowPlan:
    """This step's layouts (``rl_critic``: the critic's batch arithmetic, under a split placement). Every
    rank that holds rows calls it (two small all_gathers of row lengths when rows move): every rank, or
    the actor's ranks that received them (parallel.placement=async's trainer ranks, the actor's next to
    parallel.teacher_ranks), whose ``group`` it then takes. ``balance_tokens``:
    parallel.balance_tokens."""
    balance = balance_tokens
    plan = RowPlan(placement, balance, device)
    if not placement.is_split and not balance:
        return plan
    sizes, lengths_N = gather_lengths(local.attention_mask_BT.sum(dim=1), device, group)
    plan.width = int(lengths_N.max())
    # As received: async's trainer ranks, or the actor's next to a teacher's own ranks (the first ranks,
    # the group's order), else every rank in order.
    received = placement.is_async or placement.teacher_apart
    plan.world = RowLayout.from_counts(sizes, placement.role("actor").ranks if received else None)
    total = lengths_N.numel()

    def layout(role: str, rl: RLDerived) -> RowLayout:
        ranks = placement.role(role).ranks
        plain = RowLayout.contiguous(total, ranks) if placement.is_split else plan.world
        assert plain is not None
        before = plain.imbalance(lengths_N, ranks)
        out = RowLayout.balanced(lengths_N, ranks, chunks=rl.mini_batches_per_step) if balance else plain
        plan.metrics[f"balance/{role}_token_imbalance"] = out.imbalance(lengths_N, ranks)
        if balance:
            plan.metrics[f"balance/{role}_token_imbalance_before"] = before
        return out

    plan.actor = layout("actor", rl_actor)
    if placement.is_split:
        assert rl_critic is not None, "a split placement balances the critic's rows by its own arithmetic"
        plan.critic = layout("critic", rl_critic)
    else:
        plan.critic = plan.actor
    return plan


def to_actor_ranks(
    placement: Placement,
    batch: PolicyBatch,
    columns: dict[str, torch.Tensor],
    device: torch.device,
) -> tuple[PolicyBatch, dict[str, torch.Tensor]] | None:
    """parallel.teacher_ranks: every rank's rows (``batch``, with the teacher's logprobs by now) and their
    per-row ``columns`` ((B, K) tensors: ReMax's baselines, gdpo's reward components) to the actor's ranks,
    equal consecutive blocks in global order, so each holds whole prompt groups (plan_job checked that the
    step's prompts split so); None on the teacher's own ranks, which keep no rows. Every rank calls it, with
    the same fields set. Each field travels at its own width (a column costs one number per row)."""
    sizes, _ = gather_lengths(batch.attention_mask_BT.sum(dim=1), device)
    here = RowLayout.from_counts(sizes)
    there = RowLayout.contiguous(sum(sizes), placement.role("actor").ranks)
    fields = {**batch.tensors(), **columns}
    out = move_rows(fields, {k: v.dtype for k, v in fields.items()}, here, there, width=None, device=device)
    if out is None:
        return None
    moved = {k: out.pop(k) for k in columns}
    return PolicyBatch.from_tensors(out), moved


def fit_width(t_BT: torch.Tensor, width: int) -> torch.Tensor:
    """A moved field at the width of the batch it joins (split: the critic's values onto the actor's rows,
    the returns onto the critic's). The roles' batches can differ in width: with router replay's routing
    among the fields, each role's rows arrive as wide as its own longest row (RowPlan.move), and the
    columns past a batch's width are padding in every one of its rows."""
    if t_BT.shape[1] >= width:
        return t_BT[:, :width]
    return torch.nn.functional.pad(t_BT, (0, width - t_BT.shape[1]))
