"""The batches generated ahead, in a checkpoint (parallel.placement=async, recipes/grpo_async.py).

At the checkpoint of step i (taken after the weights of version i reached the engines) each rollout rank
holds batches i+1 .. i+k generated ahead (k = trainer.max_staleness; fewer near the last step), each
with the version that generated it, and its sampler stands k batches past the trainer's. Without them a
resumed run would generate those batches again with version i: other samples than the uninterrupted
run's. So every rollout rank writes, into the checkpoint being saved,

    rollout/queue-<j>.pt    j = its index among the rollout ranks: the checkpoint's step, the queued
                            batches (step, version, this rank's rows) and its sampler's state

through the checkpointer's per-rank files, before the checkpoint is published (meta.json and the rename
come after every rank's writes: a kill mid-save leaves no checkpoint that looks complete without its
queue). meta.json's ``async`` entry records the pipeline's shape (k, the number of rollout ranks, the
global batch size, rollout.n). A run with other rows per rank (rollout ranks, batch size, rollout.n)
cannot continue the saved queue and is refused at start, before any model or engine is built. Another k
continues it: the queued batches are sent first, so a larger k generates the missing batches ahead with
the checkpoint's version, and a smaller one sends batches older than it, which trainer.stale_policy drops
or regenerates.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch
import torch.distributed as dist

from spmdrl.config import Config
from spmdrl.distributed.env import broadcast_str
from spmdrl.distributed.placement import Placement
from spmdrl.errors import ConfigError
from spmdrl.rl.async_rows import fill_missing_fields

log = logging.getLogger("spmdrl")

QUEUE_DIR = "rollout"
META_KEY = "async"


def queue_file(index: int) -> str:
    """The checkpoint-relative file of rollout rank ``index`` (its index among the rollout ranks)."""
    return f"{QUEUE_DIR}/queue-{index}.pt"


@dataclass(frozen=True)
class QueuedBatch:
    """A batch generated ahead: the update that trains on it, the version that generated it, this rank's rows."""

    step: int
    version: int
    rows: dict[str, torch.Tensor]


@dataclass(frozen=True)
class SavedQueue:
    """What a rollout rank restores on resume."""

    batches: list[QueuedBatch]
    sampler: dict[str, Any]
    # The names of the rows' "measured" columns when they were saved (None: a queue saved before the names
    # were, spmdrl.rl.async_rows.fill_missing_fields reads it by its width).
    carried: list[str] | None = None

    def upgraded(self) -> list[QueuedBatch]:
        """The batches with every field of today's rows (a queue of an earlier release lacks some)."""
        return [
            QueuedBatch(b.step, b.version, fill_missing_fields(b.rows, b.version, self.carried))
            for b in self.batches
        ]


@dataclass(frozen=True)
class PipelineShape:
    """The pipeline a checkpoint's queue belongs to: a resumed run must have the same rows per rank
    (KEYS); max_staleness may differ (see the module's docstring)."""

    max_staleness: int
    rollout_ranks: int
    global_batch_size: int
    rollout_n: int

    # The fields a resumed run must keep, with their settings, for the refusal's message.
    KEYS: ClassVar[dict[str, str]] = {
        "rollout_ranks": "parallel.rollout_ranks",
        "global_batch_size": "trainer.global_batch_size",
        "rollout_n": "rollout.n",
    }

    @classmethod
    def of(cls, cfg: Config, placement: Placement) -> PipelineShape:
        return cls(
            cfg.trainer.max_staleness,
            placement.role("rollout").num_ranks,
            cfg.trainer.global_batch_size,
            cfg.rollout.n,
        )

    def as_meta(self) -> dict[str, dict[str, int]]:
        """meta.json's entry (rank 0 writes it)."""
        return {META_KEY: asdict(self)}


def queue_payload(
    step: int, batches: Iterable[QueuedBatch], sampler: dict[str, Any], carried: Sequence[str] = ()
) -> dict[str, Any]:
    """A rollout rank's file at the checkpoint of ``step``: its queue (rows on the CPU, so any device
    loads them), its sampler's state, and the names of the rows' measured metrics (``carried``, in their
    column order: a later release that lists them otherwise reads them by name)."""
    return {
        "step": step,
        "batches": [
            {"step": b.step, "version": b.version, "rows": {k: v.cpu() for k, v in b.rows.items()}}
            for b in batches
        ],
        "sampler": sampler,
        "carried": list(carried),
    }


def load_queue(checkpoint: Path, index: int, step: int, device: torch.device) -> SavedQueue | None:
    """Rollout rank ``index``'s queue saved in ``checkpoint`` (of step ``step``), its rows on ``device``;
    None for a checkpoint without one (k = 0 from before queues were saved: nothing was queued)."""
    path = checkpoint / queue_file(index)
    if not path.is_file():
        return None
    saved = torch.load(path, map_location="cpu", weights_only=True)
    batches = [
        QueuedBatch(int(b["step"]), int(b["version"]), {k: v.to(device) for k, v in b["rows"].items()})
        for b in saved["batches"]
    ]
    # The queue holds the batches right after the checkpoint, in order (the rollout loop sends them so).
    expected = list(range(step + 1, step + 1 + len(batches)))
    if int(saved["step"]) != step or [b.step for b in batches] != expected:
        raise RuntimeError(
            f"{path} is the queue of step {saved['step']} with batches {[b.step for b in batches]}; "
            f"the checkpoint is of step {step}, whose queue holds batches {expected}"
        )
    carried = saved.get("carried")
    return SavedQueue(batches, saved["sampler"], None if carried is None else [str(c) for c in carried])


def restore_queue(
    checkpoint: Path, index: int, step: int, total_steps: int, device: torch.device, sampler: Any
) -> list[QueuedBatch]:
    """A resumed rollout rank's batches generated ahead of ``checkpoint`` (of ``step``), every field of
    today's rows in them, and its ``sampler`` past them; none past ``total_steps`` (a shorter resumed run
    never sends them). A checkpoint without a queue (k = 0, saved before queues were) queued nothing, and
    the trainer's sampler position is the rollout rank's."""
    saved = load_queue(checkpoint, index, step, device)
    if saved is None:
        return []
    sampler.load_state_dict(saved.sampler)
    return [b for b in saved.upgraded() if b.step <= total_steps]


def check_resume(checkpoint: Path, shape: PipelineShape) -> str:
    """Refuses a checkpoint this run cannot continue: one saved by a pipeline with other rows per rank, or
    one without the queue files while k >= 1 (the run's or the checkpoint's). Returns what a change of
    trainer.max_staleness does to the queued batches, for the log ("" when k is unchanged)."""
    meta = json.loads((checkpoint / "meta.json").read_text())
    saved = meta.get(META_KEY)
    k = shape.max_staleness
    if saved is None:
        if k == 0:  # from before queues were saved: with k = 0 nothing is queued at a step's end
            return ""
        raise ConfigError(
            f"trainer.max_staleness={k}: the checkpoint {checkpoint} holds no queue of the batches generated "
            f"ahead (its meta.json has no '{META_KEY}' entry and it has no {queue_file(0)}, ...); it was not "
            "written by parallel.placement=async with this version. It cannot be continued exactly with "
            "k >= 1: resume it with trainer.max_staleness=0, or start a new run in another trainer.output_dir"
        )
    for name, setting in PipelineShape.KEYS.items():
        was, now = saved.get(name), getattr(shape, name)
        if was != now:
            raise ConfigError(
                f"the checkpoint {checkpoint} was saved with {setting}={was}, this run has {setting}={now}: "
                f"its queue holds the batches that pipeline generated ahead, which this one cannot continue "
                f"exactly. Set {setting}={was} to resume it, or start a new run in another trainer.output_dir"
            )
    was_k = int(saved.get("max_staleness", 0))
    if max(k, was_k) == 0:
        return ""
    missing = [
        f for f in (queue_file(j) for j in range(shape.rollout_ranks)) if not (checkpoint / f).is_file()
    ]
    if missing:
        raise ConfigError(
            f"trainer.max_staleness={k}: the checkpoint {checkpoint} lacks {', '.join(missing)} (the batches "
            "its rollout ranks generated ahead, and their samplers); it cannot be continued exactly. Resume "
            "from an earlier complete checkpoint (trainer.resume=<its step-<N> directory>), or start a new "
            "run in another trainer.output_dir"
        )
    return staleness_change(was_k, k)


def staleness_change(was: int, now: int) -> str:
    """What resuming a checkpoint saved with trainer.max_staleness=``was`` under ``now`` does, in words."""
    if now > was:
        return (
            f"trainer.max_staleness={now}, the checkpoint was saved with {was}: its queued batches are sent "
            f"first, the next {now - was} are generated ahead by the checkpoint's version"
        )
    if now < was:
        return (
            f"trainer.max_staleness={now}, the checkpoint was saved with {was}: its queued batches are sent "
            f"first, and those older than {now} versions are dropped or generated again "
            "(trainer.stale_policy; async/dropped_frac, async/regenerated_frac)"
        )
    return ""


def check_resume_all_ranks(checkpoint: Path, shape: PipelineShape) -> None:
    """:func:`check_resume` on rank 0, its refusal raised on every rank (the job then reports it once);
    rank 0 prints what a change of trainer.max_staleness does."""
    refusal = ""
    if dist.get_rank() == 0:
        try:
            change = check_resume(checkpoint, shape)
            if change:
                log.info("resuming %s: %s", checkpoint, change)
        except ConfigError as e:
            refusal = str(e)
    refusal = broadcast_str(refusal)
    if refusal:
        raise ConfigError(refusal)
