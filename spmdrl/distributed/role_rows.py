"""Where a step's rows live for each role, and the moves that put them there (one RL step's data plane).

Colocated without balancing, nothing moves: every rank trains on the rollouts it generated. Otherwise
the rows are numbered globally (spmdrl.distributed.exchange) and

- ``split``: the rollouts go to the actor's ranks and to the critic's ranks; the critic's values go to
  the actor (GAE runs there, next to the KL and correction terms); the returns and the final response
  mask go back to the critic;
- ``parallel.balance_tokens``: each role's layout gives every rank the same number of rows and about
  the same number of tokens, mini-batch by mini-batch (``RowLayout.balanced``). Colocated, the rows
  move only after the advantages, which may need a rank's whole groups.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from spmdrl.algos.batch import PolicyBatch
from spmdrl.config import Config, RLDerived
from spmdrl.distributed.exchange import RowLayout, gather_lengths, move_rows
from spmdrl.distributed.placement import Placement


@dataclass
class RowPlan:
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

    def _move(
        self, batch: PolicyBatch | None, spec: dict[str, torch.dtype], src: RowLayout, dst: RowLayout
    ) -> PolicyBatch | None:
        fields = None if batch is None else {k: v for k, v in batch.tensors().items() if k in spec}
        out = move_rows(fields, spec, src, dst, width=self.width, device=self.device)
        return None if out is None else PolicyBatch.from_tensors(out)

    def to_actor(self, local: PolicyBatch) -> PolicyBatch | None:
        """The actor's rows on its ranks (None elsewhere)."""
        if not self.placement.is_split:
            return local
        assert self.world is not None and self.actor is not None
        return self._move(local, local.field_spec(), self.world, self.actor)

    def to_critic(self, local: PolicyBatch) -> PolicyBatch | None:
        """The critic's rows on its ranks (None elsewhere)."""
        if not self.placement.is_split:
            return local
        assert self.world is not None and self.critic is not None
        return self._move(local, local.field_spec(), self.world, self.critic)

    def values_to_actor(
        self, critic_batch: PolicyBatch | None, batch: PolicyBatch | None
    ) -> PolicyBatch | None:
        if not self.placement.is_split:
            assert batch is not None and critic_batch is not None
            return batch.replace(values_BT=critic_batch.values_BT)
        assert self.critic is not None and self.actor is not None
        fields = None if critic_batch is None else {"values_BT": critic_batch.values_BT}
        out = move_rows(
            fields,
            {"values_BT": torch.float32},
            self.critic,
            self.actor,
            width=self.width,
            device=self.device,
        )  # type: ignore[arg-type]
        return batch if batch is None or out is None else batch.replace(values_BT=out["values_BT"])

    def returns_to_critic(
        self, batch: PolicyBatch | None, critic_batch: PolicyBatch | None
    ) -> PolicyBatch | None:
        """The returns and the response mask (after any rejection) from the actor to the critic."""
        if not self.placement.is_split:
            return critic_batch
        assert self.critic is not None and self.actor is not None
        spec = {"returns_BT": torch.float32, "response_mask_BT": torch.bool}
        fields = None if batch is None else {k: getattr(batch, k) for k in spec}
        out = move_rows(fields, spec, self.actor, self.critic, width=self.width, device=self.device)  # type: ignore[arg-type]
        return critic_batch if critic_batch is None or out is None else critic_batch.replace(**out)

    def balance_colocated(
        self, batch: PolicyBatch | None, sampled_mask_BT: torch.Tensor | None
    ) -> tuple[PolicyBatch | None, torch.Tensor | None]:
        """Colocated with balance_tokens: the whole batch (and the sampled mask) to the balanced layout."""
        if self.placement.is_split or not self.balance:
            return batch, sampled_mask_BT
        assert batch is not None and sampled_mask_BT is not None
        assert self.world is not None and self.actor is not None
        fields = {**batch.tensors(), "sampled_mask_BT": sampled_mask_BT}
        spec = {k: v.dtype for k, v in fields.items()}
        out = move_rows(fields, spec, self.world, self.actor, width=self.width, device=self.device)
        assert out is not None
        sampled = out.pop("sampled_mask_BT")
        return PolicyBatch.from_tensors(out), sampled


def plan_rows(
    cfg: Config,
    placement: Placement,
    rl_actor: RLDerived,
    rl_critic: RLDerived,
    local: PolicyBatch,
    device: torch.device,
) -> RowPlan:
    """This step's layouts. Every rank calls it (two small all_gathers of row lengths when rows move)."""
    balance = cfg.parallel.balance_tokens
    plan = RowPlan(placement, balance, device)
    if not placement.is_split and not balance:
        return plan
    sizes, lengths_N = gather_lengths(local.attention_mask_BT.sum(dim=1), device)
    plan.width = int(lengths_N.max())
    plan.world = RowLayout.from_counts(sizes)
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
    plan.critic = layout("critic", rl_critic) if placement.is_split else plan.actor
    return plan
