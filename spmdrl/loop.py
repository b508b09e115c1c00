"""The skeleton every training loop shares: the SFT stage (spmdrl/supervised/sft.py), the reward model
(recipes/rm.py) and each RL recipe (through spmdrl/rl/job.py). Where a run starts (a checkpoint's step or
0), when something is due (a checkpoint, a validation, a metrics row), the save and the end are written
here once; what differs between the loops is the step.

    plan = plan_start(run)          # first, before anything is built: rank 0 decides for every rank
    ...                             # data, models, optimizers, the sampler, a Checkpointer
    start = resume_or_start(run, plan, roles, sampler, total_steps)
    for step in range(start.step + 1, total_steps + 1):
        ...                         # the step; its metrics row when due(step, log_every, ...)
        if due(step, cfg.trainer.save_every, total_steps):
            save(checkpointer, step, sampler, meta={"total_steps": total_steps})
    finish(run, checkpointer, start.logger, outputs=..., curves=...)
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch.distributed as dist

from spmdrl.checkpoint.checkpointer import (
    Checkpointer,
    RoleState,
    load_checkpoint,
    log_saved,
    plan_resume_all_ranks,
)
from spmdrl.data.sampler import DistributedSampler
from spmdrl.logging.metrics import NullLogger, rewind_logs
from spmdrl.runtime import Run, restart_count

log = logging.getLogger("spmdrl")


def due(step: int, every: int, total_steps: int) -> bool:
    """Every ``every`` steps (0: never) and at the last step: the cadence of checkpoints
    (trainer.save_every) and of metrics rows (trainer.log_every)."""
    return step == total_steps or (every > 0 and step % every == 0)


def validation_due(step: int, every: int, total_steps: int, *, at_start: bool = True) -> bool:
    """trainer.val_every's cadence: :func:`due`, except that 0 turns validation off, at the last step too.
    Step 0 is due unless ``at_start`` is false (trainer.val_before_train): a run that starts measures its
    untrained model, the curves' first point."""
    if step == 0 and not at_start:
        return False
    return every > 0 and due(step, every, total_steps)


@dataclass(frozen=True)
class StartPlan:
    """Where a run starts, decided before anything is built (by rank 0, for every rank)."""

    resume_from: Path | None  # the checkpoint the run continues from; None: step 0
    # torchrun restarted this process: an attempt that died before its first checkpoint logged rows that
    # the new one logs again, so its logs start over.
    restarted: bool


def plan_start(run: Run) -> StartPlan:
    """trainer.resume's checkpoint (auto: the newest complete one in the output directory), or none; a
    second run into a directory that already holds one is refused (checkpointer.plan_resume)."""
    restarted = restart_count() > 0
    resume_from = plan_resume_all_ranks(run.cfg.trainer.resume, run.output_dir, restarted=restarted)
    return StartPlan(resume_from, restarted)


@dataclass
class Start:
    """What :func:`resume_or_start` hands the loop."""

    step: int  # the loop runs steps step + 1 .. total_steps
    logger: NullLogger  # the metric logger, opened after the rows past ``step`` were dropped
    state: dict[str, Any] = field(default_factory=dict)  # the checkpoint's trainer state ({} at step 0)


def resume_or_start(
    run: Run,
    plan: StartPlan,
    roles: list[RoleState],
    sampler: DistributedSampler,
    total_steps: int,
    stage: str = "",
    *,
    rewind: bool = True,
) -> Start:
    """Loads ``plan.resume_from`` (if any) into ``roles`` (models, optimizers, schedules; this rank's RNG)
    and ``sampler``; then opens the metric logger in the output directory (``stage``: a sub-directory of
    it). The rows a resumed run logged after its checkpoint are dropped first: the run logs those steps
    again (``rewind=False``: kept, for a job that trains nothing, trainer.val_only). Every rank calls it; the
    loop's own state (RL's KL coefficient) is in the returned ``state``."""
    log_dir = run.output_dir / stage
    step, state = 0, {}
    if plan.resume_from is not None:
        t_load = time.perf_counter()
        state = load_checkpoint(plan.resume_from, roles)
        log.info("loaded %s in %.2f s", plan.resume_from, time.perf_counter() - t_load)
        step = int(state["step"])
        sampler.load_state_dict(state["sampler"])
        if run.env.is_main and rewind:
            dropped = rewind_logs(log_dir, step)
            log.info(
                "resumed from %s: step %d of %d (%d later log rows dropped)",
                plan.resume_from,
                step,
                total_steps,
                dropped,
            )
    elif plan.restarted and run.env.is_main and rewind:
        rewind_logs(log_dir, -1)
    if step >= total_steps and rewind:
        log.info("the checkpoint is at the last step (%d): nothing left to train", step)
    return Start(step, run.metric_logger(total_steps, stage, resume_step=step), state)


def save(
    checkpointer: Checkpointer,
    step: int,
    sampler: DistributedSampler,
    *,
    meta: dict[str, Any],
    state: dict[str, Any] | None = None,
    extra: dict[str, object] | None = None,
) -> None:
    """step-<step>: the roles' states, the sampler's position and ``state`` (the loop's own); ``meta``: the
    entries of meta.json; ``extra``: this rank's own files (Checkpointer.save). Every rank calls it, after
    the step's metrics row: a kill between the two loses no row (the resumed run logs the step again)."""
    trainer_state = {"sampler": sampler.state_dict(), **(state or {})}
    log_saved(checkpointer.save(step, trainer_state, meta=meta, extra=extra))


def finish(
    run: Run,
    checkpointer: Checkpointer,
    logger: NullLogger,
    *,
    outputs: Callable[[], None],
    curves: Callable[[], None],
) -> None:
    """After the last step, on every rank: the save still in flight published, ``outputs`` (the HF
    exports), the metric logger closed, then ``curves`` drawn on rank 0; the ranks leave together."""
    log_saved(checkpointer.finish())
    outputs()
    logger.close()
    if run.env.is_main:
        curves()
    dist.barrier()
