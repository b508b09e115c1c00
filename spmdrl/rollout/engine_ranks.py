"""The rollout engine on a subset of the ranks: vLLM is given those ranks as its whole world.

Why an engine on a subset hung (vLLM 0.32, ``external_launcher``): vLLM takes the *default* process
group for its world. ``init_distributed_environment`` (``distributed/parallel_state.py``) builds its world
``GroupCoordinator`` over ``range(torch.distributed.get_world_size())`` and ``initialize_model_parallel``
lays out its TP / PP / DP / EP groups over every rank of it, each with ``torch.distributed.new_group``,
which every rank of the default group must enter; then it all-gathers over that world to count nodes, and
``ExecutorWithExternalLauncher.determine_available_memory`` all-reduces the KV-cache budget (MIN) over it.
Ranks that build no engine enter none of these, so the engine ranks wait in the first ``new_group``.

What is done instead: every rank creates one process group over the engine ranks, and vLLM's code runs
with that group in place of the default one (:meth:`EngineWorld.vllm`): its world, its layout and its
collectives are the engine ranks' alone, numbered 0..R-1, whatever vLLM version or parallel settings
decide to create. Around construction ``RANK`` / ``WORLD_SIZE`` say the same (vLLM's executor reads
``RANK``; ``LOCAL_RANK``, which picks the device, stays). The trainer's code keeps the real world: the
weights a reload pulls are produced outside the swap (:meth:`EngineWorld.trainer_side`).

One trace of vLLM's groups remains on the other ranks: torch names default groups by a per-process
counter (``_world.group_count``), which vLLM's groups advanced on the engine ranks only. The same name
must mean the same group on every rank (its store keys), so after the build every rank takes the largest
count (:meth:`EngineWorld.agree_group_names`); any group created afterwards works as usual.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import TypeVar

import torch.distributed as dist
from torch.distributed import distributed_c10d

from spmdrl.errors import ConfigError

T = TypeVar("T")


def check_engine_ranks(ranks: Sequence[int], world_size: int, tp: int) -> tuple[int, ...]:
    """``ranks`` as the engine's block, or a ConfigError: consecutive ranks of the world, a multiple of
    ``tp`` of them (each engine is ``tp`` consecutive ranks inside the block)."""
    block = tuple(int(r) for r in ranks)
    where = f"the rollout engine's ranks {list(block)} (world size {world_size}, rollout.tp={tp})"
    if not block:
        raise ConfigError(f"{where}: no ranks; pass None to build the engine on every rank")
    if any(r < 0 or r >= world_size for r in block):
        raise ConfigError(f"{where}: every rank must be in 0..{world_size - 1}")
    if list(block) != list(range(block[0], block[0] + len(block))):
        raise ConfigError(
            f"{where}: must be consecutive and increasing (a block such as the first or last R ranks), "
            "since each engine's tensor-parallel group is consecutive ranks"
        )
    if tp < 1 or len(block) % tp:
        raise ConfigError(
            f"{where}: {len(block)} ranks are not a multiple of rollout.tp={tp}; give the engines "
            f"{tp}, {2 * tp}, ... ranks or change rollout.tp"
        )
    return block


@dataclass(frozen=True)
class EngineWorld:
    """The engine ranks and the process group vLLM takes for its world (None: every rank, nothing swapped)."""

    ranks: tuple[int, ...]
    rank: int
    group: dist.ProcessGroup | None
    # The default group when this was created (the trainer's world), put back for the trainer's code.
    world: dist.ProcessGroup | None = None

    @classmethod
    def everywhere(cls) -> EngineWorld:
        world = dist.get_world_size() if dist.is_initialized() else 1
        rank = dist.get_rank() if dist.is_initialized() else 0
        return cls(tuple(range(world)), rank, None)

    @classmethod
    def create(cls, ranks: Sequence[int] | None, tp: int) -> EngineWorld:
        """Every rank calls this together, with the same ``ranks`` (None: every rank, today's layout)."""
        if ranks is None:
            return cls.everywhere()
        world, rank = dist.get_world_size(), dist.get_rank()
        block = check_engine_ranks(ranks, world, tp)
        # Different lists on different ranks would hang in the group creations below: compare first, so
        # every rank raises together.
        seen: list[tuple[int, ...] | None] = [None] * world
        dist.all_gather_object(seen, block)
        if any(s != block for s in seen):
            raise ConfigError(
                f"build_engine(ranks=...) differs between ranks: {dict(enumerate(seen))}; every rank "
                "must pass the same engine ranks"
            )
        if len(block) == world:
            return cls.everywhere()
        return cls(block, rank, dist.new_group(list(block)), dist.GroupMember.WORLD)

    @property
    def holds_engine(self) -> bool:
        return self.rank in self.ranks

    @contextlib.contextmanager
    def vllm(self, *, building: bool = False) -> Iterator[None]:
        """Around code of vLLM's: the engine ranks' group is the default one (and, ``building``, ``RANK``
        and ``WORLD_SIZE`` are the rank's place among them), so that vLLM's world is the engine ranks."""
        if self.group is None:
            yield
            return
        env = (
            {"RANK": str(self.ranks.index(self.rank)), "WORLD_SIZE": str(len(self.ranks))} if building else {}
        )
        saved_env = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        try:
            with _default_group(self.group):
                yield
        finally:
            for k, v in saved_env.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v

    def trainer_side(self, items: Iterable[T]) -> Iterator[T]:
        """``items`` pulled with the real world in place, for iterators vLLM consumes inside :meth:`vllm`
        (the trainer's lazily gathered weights: their collectives and ranks are the trainer's)."""
        if self.group is None:
            yield from items
            return
        it = iter(items)
        while True:
            with _default_group(self.world):
                try:
                    item = next(it)
                except StopIteration:
                    return
            yield item

    def agree_group_names(self) -> None:
        """After the engine is built (or not, on the other ranks): every rank together. Makes torch's group
        counter equal on every rank again (see the module docstring)."""
        if self.group is None:
            return
        counts: list[int | None] = [None] * dist.get_world_size()
        dist.all_gather_object(counts, distributed_c10d._world.group_count)
        distributed_c10d._world.group_count = max(c for c in counts if c is not None)


@contextlib.contextmanager
def _default_group(group: dist.ProcessGroup | None) -> Iterator[None]:
    """``group`` as the default process group (what ``group=None`` and ``get_rank()`` mean) inside."""
    before = dist.GroupMember.WORLD
    dist.GroupMember.WORLD = group
    try:
        yield
    finally:
        dist.GroupMember.WORLD = before
