"""Tensor-parallel rollout groups: consecutive ranks share one engine, so they must send it the same prompts.

Under vLLM's ``external_launcher`` every rank of a TP group runs its own copy of the scheduler, and the
copies stay in step only if they see identical requests. Each rank holds its own shard of the batch, so
before generating the group all-gathers its prompts, every rank generates for the concatenation (the
model's work is split by TP, not repeated), and each rank keeps its own slice of the results. Nothing
moves back: every rank of the group already has every result.

vLLM lays out its TP groups the same way ([0..tp-1], [tp..2tp-1], ...), which is why the grouping here
is by consecutive ranks.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

import torch.distributed as dist

from spmdrl.distributed.placement import rollout_tp_groups

T = TypeVar("T")


@dataclass(frozen=True)
class Gathered(Generic[T]):
    """The prompts of a whole TP group in rank order, and where this rank's part starts and ends."""

    prompts: list[T]
    start: int
    stop: int


def engine_tp_groups(tp: int, ranks: Sequence[int] | None = None) -> list[list[int]]:
    """The engines' TP groups: blocks of ``tp`` consecutive ranks of ``ranks`` (None: the whole world;
    a subset is checked by :func:`spmdrl.rollout.engine_ranks.check_engine_ranks`)."""
    if ranks is None:
        return rollout_tp_groups(dist.get_world_size() if dist.is_initialized() else 1, tp)
    return [list(ranks[i : i + tp]) for i in range(0, len(ranks), tp)]


def new_tp_subgroups(groups: list[list[int]]) -> dist.ProcessGroup | None:
    """This rank's gloo group among ``groups`` (None outside them, or for one-rank groups). Every rank of
    the world calls it, those without an engine too, as torch requires."""
    if len(groups[0]) == 1:
        return None
    # Object collectives (lists of token ids) need a CPU group; gloo serves them whatever the default
    # backend is.
    group, _ = dist.new_subgroups_by_enumeration(groups, backend="gloo")
    return group


class TPGroups:
    """The TP subgroups of the rollout engine, built once. Construct on every engine rank; the other ranks
    call :func:`new_tp_subgroups` at the same point (it makes process groups)."""

    def __init__(self, tp: int, ranks: Sequence[int] | None = None) -> None:
        rank = dist.get_rank() if dist.is_initialized() else 0
        groups = engine_tp_groups(tp, ranks)
        self.tp = tp
        # The data-parallel index of this engine (which TP group this rank is in) and the rank's place in it.
        self.dp_index = next(i for i, g in enumerate(groups) if rank in g)
        self.tp_rank = groups[self.dp_index].index(rank)
        self.num_engines = len(groups)
        self.group = new_tp_subgroups(groups)

    def gather_for_tp(self, local_prompts: list[T]) -> Gathered[T]:
        """All prompts (token ids, or anything picklable per prompt) of this rank's TP group in rank
        order, and this rank's range within them."""
        if self.group is None:
            return Gathered(prompts=list(local_prompts), start=0, stop=len(local_prompts))
        parts: list[list[T] | None] = [None] * self.tp
        dist.all_gather_object(parts, list(local_prompts), group=self.group)
        sizes = [len(p) for p in parts if p is not None]
        start = sum(sizes[: self.tp_rank])
        merged = [prompt for part in parts if part is not None for prompt in part]
        return Gathered(prompts=merged, start=start, stop=start + len(local_prompts))

    @staticmethod
    def scatter_from_tp(results: Sequence[T], gathered: Gathered, per_prompt: int = 1) -> list[T]:
        """This rank's results out of the group's (``per_prompt`` consecutive results for each prompt)."""
        expected = len(gathered.prompts) * per_prompt
        if len(results) != expected:
            raise ValueError(
                f"scatter_from_tp: got {len(results)} results for {len(gathered.prompts)} prompts x {per_prompt}"
            )
        return list(results[gathered.start * per_prompt : gathered.stop * per_prompt])
