"""Checkpoints that are never half-written: torch.distributed.checkpoint per role, published by a rename.

Layout of ``<output_dir>/checkpoints/``::

    step-40/                  complete: published by one atomic rename, after everything below
      actor/                  DCP: model, optimizer, LR scheduler, sharded over the actor's ranks
      critic/                 DCP: the same for the critic (PPO)
      hf/actor/, hf/critic/   config, tokenizer, generation config: what ``spmdrl.export`` needs
      trainer.pt              step, sampler position, KL controller: the same on every rank (rank 0 writes)
      rng/rank-<r>.pt         each rank's torch / numpy / python RNG states
      <extra files>           a rank's own files, named by the caller (``extra``): the asynchronous
                              pipeline's queue, rollout/queue-<j>.pt (spmdrl/rl/async_queue.py)
      meta.json               step, world size, placement, bytes, seconds
    .partial-step-50/         a save in progress, or one killed mid-way: never read, removed by the next

A kill at any moment leaves the previous checkpoint as the newest complete one: nothing is deleted
before the new one is published, and only directories named ``step-<N>`` with a ``meta.json`` count.
The directory must be on storage every rank sees (a shared file system across nodes).

DCP writes each rank's shards and the planner reshards on load, so a checkpoint saved on 2 ranks loads
on 1 or 4 (tests/integration/test_checkpoint.py). Each role saves over its own process group, so under a split
placement the actor's and the critic's ranks write at the same time.
"""

from __future__ import annotations

import contextlib
import errno
import io
import json
import logging
import os
import random
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from spmdrl.distributed.env import broadcast_str
from spmdrl.errors import ConfigError
from spmdrl.models.lora import is_adapter_param, lora_scale

log = logging.getLogger(__name__)

PREFIX = "step-"
PARTIAL = ".partial-"


class CheckpointError(RuntimeError):
    pass


@dataclass
class RoleState:
    """One trained role as a checkpoint sees it. ``holds``: this rank has it (False: skip its save/load)."""

    name: str
    holds: bool
    model: nn.Module | None = None
    optimizer: torch.optim.Optimizer | None = None
    scheduler: torch.optim.lr_scheduler.LRScheduler | None = None
    group: dist.ProcessGroup | None = None
    # Writes the files export needs (config, tokenizer) into a directory; run on the role's first rank.
    write_hf: Callable[[Path], None] | None = None
    # The role's ranks (None: every rank); an asynchronous save makes a process group of its own over them.
    ranks: list[int] | None = None

    def _state(self) -> dict[str, Any]:
        assert self.model is not None and self.optimizer is not None and self.scheduler is not None
        options = self._options()
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer, options=options)
        if options.ignore_frozen_params:
            # A tied LM head is no parameter of its own, so get_state_dict keeps it: the adapters alone.
            model_sd = {k: v for k, v in model_sd.items() if is_adapter_param(k)}
        return {"model": model_sd, "optim": optim_sd, "scheduler": self.scheduler.state_dict()}

    def _options(self) -> StateDictOptions:
        """A LoRA model's frozen base is not saved: only its adapters (and their optimizer state) change,
        and a resumed run rebuilds the base from model.path as the first run did (docs/checkpointing.md)."""
        frozen_base = self.model is not None and lora_scale(self.model) is not None
        return StateDictOptions(ignore_frozen_params=frozen_base, strict=not frozen_base)


@dataclass(frozen=True)
class SaveStats:
    path: Path
    seconds: float
    bytes: int


def checkpoint_root(output_dir: Path) -> Path:
    return output_dir / "checkpoints"


def complete_checkpoints(root: Path) -> list[tuple[int, Path]]:
    """(step, path) of every complete checkpoint under ``root``, oldest first."""
    if not root.is_dir():
        return []
    found = []
    for p in root.iterdir():
        if p.name.startswith(PREFIX) and p.name[len(PREFIX) :].isdigit() and (p / "meta.json").is_file():
            found.append((int(p.name[len(PREFIX) :]), p))
    return sorted(found)


def latest_checkpoint(root: Path) -> Path | None:
    done = complete_checkpoints(root)
    return done[-1][1] if done else None


def resolve_resume(resume: str, output_dir: Path) -> Path | None:
    """The checkpoint ``trainer.resume`` names: "auto" (newest complete one here, or None), "off", or a path."""
    if resume == "off":
        return None
    if resume == "auto":
        return latest_checkpoint(checkpoint_root(output_dir))
    path = Path(resume).expanduser().resolve()
    if not (path / "meta.json").is_file():
        newest = latest_checkpoint(path / "checkpoints") or latest_checkpoint(path)
        if newest is None:
            raise ConfigError(
                f"trainer.resume={resume}: no complete checkpoint there (a checkpoint is a step-<N> directory "
                "with a meta.json; an output directory holds them under checkpoints/)"
            )
        path = newest
    return path


def plan_resume(resume: str, output_dir: Path, *, restarted: bool) -> Path | None:
    """The checkpoint this run continues from, or None to start at step 0; refuses to start a second run
    over a first one's outputs (their metrics and samples would mix) unless torchrun restarted this one."""
    path = resolve_resume(resume, output_dir)
    if path is None and not restarted and (output_dir / "metrics.jsonl").exists():
        raise ConfigError(
            f"{output_dir} already holds a run (its metrics.jsonl) and trainer.resume={resume} gives no checkpoint "
            "to continue from; a new run there would mix its metrics and samples with the earlier one's. Choose "
            f"another trainer.output_dir (or leave it empty for a new timestamped one), or delete {output_dir}"
        )
    return path


_REFUSED = "refused:"  # no path starts so: paths broadcast here are absolute


def plan_resume_all_ranks(resume: str, output_dir: Path, *, restarted: bool) -> Path | None:
    """:func:`plan_resume` decided on rank 0 and told to every rank (they must all agree on it); a refusal
    is raised on every rank, so the job reports it once (spmdrl.config_exit) rather than as rank 0's error
    and the other ranks' broken collective."""
    answer = ""
    if dist.get_rank() == 0:
        try:
            answer = str(plan_resume(resume, output_dir, restarted=restarted) or "")
        except ConfigError as e:
            answer = _REFUSED + str(e)
    answer = broadcast_str(answer)
    if answer.startswith(_REFUSED):
        raise ConfigError(answer[len(_REFUSED) :])
    return Path(answer) if answer else None


def log_saved(saved: SaveStats | None) -> None:
    if saved is not None:
        log.info("checkpoint %s: %.1f MB in %.2f s", saved.path, saved.bytes / 1e6, saved.seconds)


def _rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "numpy": np.random.get_state(),
        "python": random.getstate(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def save_checkpoint(
    root: Path,
    step: int,
    roles: list[RoleState],
    trainer_state: dict[str, Any],
    *,
    keep: int,
    meta: dict[str, Any] | None = None,
    extra: dict[str, object] | None = None,
) -> SaveStats:
    """Save everything a run needs to continue at ``step + 1``. Every rank calls it; ``extra``: this
    rank's own files (checkpoint-relative path -> object, torch.save'd), written before the publish."""
    pending = _start_save(
        root, step, roles, trainer_state, keep=keep, meta=meta, async_groups=None, extra=extra
    )
    return pending.publish()


@dataclass
class PendingSave:
    """A save whose files are written (or being written, asynchronously) but not yet published."""

    root: Path
    step: int
    keep: int
    meta: dict[str, Any]
    t0: float
    futures: list[Any]
    blocking_s: float = 0.0

    @property
    def partial(self) -> Path:
        return self.root / f"{PARTIAL}{PREFIX}{self.step}"

    def publish(self) -> SaveStats:
        """Wait for this rank's writes, then (all ranks done) publish with one rename. Every rank calls it."""
        final = self.root / f"{PREFIX}{self.step}"
        rank = dist.get_rank()
        nbytes = 0
        try:
            for fut in self.futures:
                fut.result()
            dist.barrier()
            if rank == 0:
                nbytes = _dir_bytes(self.partial)
                info = {"step": self.step, "world_size": dist.get_world_size(), "bytes": nbytes, **self.meta}
                info["seconds"] = round(time.perf_counter() - self.t0, 3)
                info["blocking_seconds"] = round(self.blocking_s, 3)
                (self.partial / "meta.json").write_text(json.dumps(info, indent=2) + "\n")
                os.replace(self.partial, final)  # the moment the checkpoint starts to count
                _fsync_dir(self.root)
                for _, old in complete_checkpoints(self.root)[: -self.keep]:
                    shutil.rmtree(old, ignore_errors=True)
            dist.barrier()
        except (OSError, CheckpointException) as e:
            cause = e if isinstance(e, OSError) else _first_failure(e)
            raise CheckpointError(_save_error(cause, self.partial, self.root)) from e
        return SaveStats(final, time.perf_counter() - self.t0, nbytes)


def _start_save(
    root: Path,
    step: int,
    roles: list[RoleState],
    trainer_state: dict[str, Any],
    *,
    keep: int,
    meta: dict[str, Any] | None,
    async_groups: dict[str, dist.ProcessGroup] | None,
    extra: dict[str, object] | None = None,
) -> PendingSave:
    t0 = time.perf_counter()
    rank = dist.get_rank()
    final = root / f"{PREFIX}{step}"
    partial = root / f"{PARTIAL}{PREFIX}{step}"
    futures: list[Any] = []
    try:
        if rank == 0:
            root.mkdir(parents=True, exist_ok=True)
            for old in root.glob(f"{PARTIAL}*"):  # earlier saves that never finished
                shutil.rmtree(old, ignore_errors=True)
            if final.exists():  # this step saved before (a resumed run that repeats it): replace it
                shutil.rmtree(final)
            partial.mkdir()
            (partial / "rng").mkdir()
        dist.barrier()
        for role in roles:
            if not role.holds:
                continue
            where = str(partial / role.name)
            if async_groups is None:
                dcp.save(role._state(), checkpoint_id=where, process_group=role.group)
            else:
                # Staged (copied) now, written by a background thread over a gloo group of its own, so its
                # collectives never interleave with training's.
                futures.append(
                    dcp.async_save(role._state(), checkpoint_id=where, process_group=async_groups[role.name])
                )
            if role.write_hf is not None and dist.get_rank(role.group) == 0:
                role.write_hf(partial / "hf" / role.name)
        _save_small(_rng_state(), partial / "rng" / f"rank-{rank}.pt")
        # Written now, also under async_save (small, and the state of this moment): the publish below waits
        # for every rank, so a checkpoint never counts without them.
        for name, obj in (extra or {}).items():
            (partial / name).parent.mkdir(parents=True, exist_ok=True)
            _save_small(obj, partial / name)
        if rank == 0:
            _save_small({"step": step, **trainer_state}, partial / "trainer.pt")
    except (OSError, CheckpointException) as e:
        # DCP gathers every rank's write failure and raises them together, on every rank.
        cause = e if isinstance(e, OSError) else _first_failure(e)
        raise CheckpointError(_save_error(cause, partial, root)) from e
    info = {"roles": [r.name for r in roles], **(meta or {})}
    return PendingSave(root, step, keep, info, t0, futures, blocking_s=time.perf_counter() - t0)


class Checkpointer:
    """Saves on a schedule, synchronously or (``async_save``) in the background.

    Asynchronous: a save copies the state to memory and returns; a background thread writes it while
    training goes on, and the checkpoint is published (meta.json, the rename) at the next save or at
    :meth:`finish`, once every rank's writes are done. Until then the previous checkpoint is the newest
    complete one, so a kill in between loses nothing already published. Every rank constructs it
    (it creates process groups) and calls its methods.
    """

    def __init__(self, root: Path, roles: list[RoleState], *, keep: int, async_save: bool = False) -> None:
        self.root, self.roles, self.keep = root, roles, keep
        self._pending: PendingSave | None = None
        self._groups: dict[str, dist.ProcessGroup] | None = None
        if async_save:
            self._groups = {r.name: dist.new_group(r.ranks, backend="gloo") for r in roles}

    def save(
        self,
        step: int,
        trainer_state: dict[str, Any],
        meta: dict[str, Any] | None = None,
        extra: dict[str, object] | None = None,
    ) -> SaveStats | None:
        """Sync: the published checkpoint's stats. Async: the previous save's, published now (or None).
        ``extra``: this rank's own files (see :func:`save_checkpoint`), part of the same checkpoint."""
        if self._groups is None:
            return save_checkpoint(
                self.root, step, self.roles, trainer_state, keep=self.keep, meta=meta, extra=extra
            )
        done = self.finish()
        self._pending = _start_save(
            self.root,
            step,
            self.roles,
            trainer_state,
            keep=self.keep,
            meta=meta,
            async_groups=self._groups,
            extra=extra,
        )
        log.info(
            "checkpoint step-%d staged in %.2f s; writing in the background", step, self._pending.blocking_s
        )
        return done

    def finish(self) -> SaveStats | None:
        """Publish the save in flight, if any (waits for its writes)."""
        if self._pending is None:
            return None
        pending, self._pending = self._pending, None
        return pending.publish()


def _save_small(obj: object, path: Path) -> None:
    """torch.save through memory: a failed write raises the OSError itself (torch's zip writer reports
    it as an unrelated RuntimeError)."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    path.write_bytes(buf.getvalue())


def _first_failure(e: CheckpointException) -> BaseException:
    """The first rank's failure, or the OSError under it (DCP's writer may wrap it in a RuntimeError)."""
    first = next(iter(e.failures.values()))[0]
    exc: BaseException | None = first
    while exc is not None and not isinstance(exc, OSError):
        exc = exc.__cause__ or exc.__context__
    return exc or first


def _save_error(e: BaseException, partial: Path, root: Path) -> str:
    reasons = {
        errno.ENOSPC: "the disk is full",
        errno.EDQUOT: "the disk quota is exhausted",
        errno.EACCES: "permission denied",
        errno.EROFS: "the file system is read-only",
        errno.EFBIG: "a file-size limit was reached",
    }
    why = reasons.get(e.errno or 0, type(e).__name__) if isinstance(e, OSError) else "a write failed"
    with contextlib.suppress(OSError):
        why += f", {shutil.disk_usage(root).free / 2**30:.1f} GiB free there"
    newest = latest_checkpoint(root)
    kept = (
        f"the newest complete checkpoint, {newest}, is intact" if newest else "no earlier checkpoint exists"
    )
    return (
        f"saving checkpoint {partial.name.removeprefix(PARTIAL)} under {root} failed: {why} "
        f"({str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__}). Nothing "
        f"saved before is lost: {kept}. Free space or fix the permissions of {root}, then rerun with the same "
        "trainer.output_dir: the run resumes from the newest complete checkpoint."
    )


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def load_checkpoint(path: Path, roles: list[RoleState]) -> dict[str, Any]:
    """Restore every held role (resharded onto this world) and this rank's RNG; returns the trainer state."""
    meta = json.loads((path / "meta.json").read_text())
    for role in roles:
        if not role.holds:
            continue
        if not (path / role.name).is_dir():
            raise CheckpointError(
                f"{path} has no '{role.name}' state (it holds {meta.get('roles')}); resume a run of the same algorithm"
            )
        state = role._state()
        dcp.load(state, checkpoint_id=str(path / role.name), process_group=role.group)
        assert role.model is not None and role.optimizer is not None and role.scheduler is not None
        set_state_dict(
            role.model,
            role.optimizer,
            model_state_dict=state["model"],
            optim_state_dict=state["optim"],
            options=role._options(),
        )
        role.scheduler.load_state_dict(state["scheduler"])
    rng = path / "rng" / f"rank-{dist.get_rank()}.pt"
    if rng.is_file() and meta["world_size"] == dist.get_world_size():
        _set_rng_state(torch.load(rng, weights_only=False))
    else:
        log.warning(
            "%s was saved on %d ranks, this run has %d: RNG states are not restored (the run continues, "
            "but not bit for bit)",
            path,
            meta["world_size"],
            dist.get_world_size(),
        )
    return torch.load(path / "trainer.pt", weights_only=False)
