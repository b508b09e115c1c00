"""What every recipe does first: process group, logging, one agreed output directory, seeds."""

from __future__ import annotations

import datetime
import json
import logging
import os
import random
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from spmdrl.config import Config
from spmdrl.config_loader import to_yaml
from spmdrl.data.sampler import DistributedSampler
from spmdrl.derived import Derived
from spmdrl.distributed.env import DistEnv, broadcast_str, init_distributed
from spmdrl.logging.backends import read_run_params
from spmdrl.logging.metrics import MetricLogger, NullLogger
from spmdrl.logging.trackers import Tracking
from spmdrl.models.tiny import default_cache_dir
from spmdrl.trainer_config import VAL_ONLY_STAGE

log = logging.getLogger("spmdrl")


@dataclass(frozen=True)
class Run:
    cfg: Config
    env: DistEnv
    output_dir: Path
    cache_dir: Path

    def metric_logger(self, total_steps: int, subdir: str = "", resume_step: int = 0) -> NullLogger:
        """Rank 0's logger into output_dir (or output_dir/subdir, for a stage such as the SFT warm-start)."""
        if not self.env.is_main:
            return NullLogger()
        lc = self.cfg.logging
        out = self.output_dir / subdir
        out.mkdir(parents=True, exist_ok=True)
        tracking = None
        if {"wandb", "mlflow"} & set(lc.backends):
            name = lc.experiment or f"{self.cfg.name}-{self.output_dir.name}"
            tracking = Tracking(
                project=lc.project,
                name=f"{name}-{subdir}" if subdir else name,
                params=read_run_params(_config_yaml(self.output_dir, out), out / "derived.json"),
                mlflow_tracking_uri=lc.mlflow_tracking_uri,
            )
        return MetricLogger(
            out,
            total_steps=total_steps,
            backends=tuple(lc.backends),
            progress_bar=lc.progress_bar,
            console_every=lc.console_every,
            resume_step=resume_step,
            tracking=tracking,
        )

    def train_sampler(self, num_samples: int, batch_size_per_rank: int) -> DistributedSampler:
        """This rank's share of each global batch of the training data, in data.seed's order."""
        return DistributedSampler(
            num_samples,
            rank=self.env.rank,
            world_size=self.env.world_size,
            batch_size_per_rank=batch_size_per_rank,
            seed=self.cfg.data.seed,
            shuffle=self.cfg.data.shuffle,
        )

    def log_derived(self, derived: Derived, stage: str = "", **extra: object) -> None:
        """Logs the derived values once and saves them (output_dir[/stage]/derived.json)."""
        values = {**derived.as_dict(), **extra}
        log.info(
            "derived%s: %s", f" ({stage})" if stage else "", "  ".join(f"{k}={v}" for k, v in values.items())
        )
        if self.env.is_main:
            (self.output_dir / stage).mkdir(parents=True, exist_ok=True)
            (self.output_dir / stage / "derived.json").write_text(json.dumps(values, indent=2) + "\n")


def _config_yaml(output_dir: Path, out: Path) -> Path:
    """The config a logger in ``out`` records: its own (trainer.val_only's), else the run's."""
    own = out / "config.yaml"
    return own if own.is_file() else output_dir / "config.yaml"


def setup_logging(rank: int) -> None:
    # Rank 0 speaks at INFO; the others only warn, so the terminal is readable at any world size.
    level = logging.INFO if rank == 0 else logging.WARNING
    logging.basicConfig(
        level=level,
        format=f"%(asctime)s [rank{rank}] %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
        force=True,
    )
    for noisy in ("httpx", "urllib3", "filelock"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def restart_count() -> int:
    """How many times torchrun (--max-restarts) has restarted this job's workers; 0 on the first attempt."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)


def _launch_key() -> str:
    """What stays the same across torchrun's restarts of one job: its rendezvous id (set it under Slurm:
    --rdzv-id=$SLURM_JOB_ID), else the agent's process id (standalone torchrun on one machine)."""
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "")
    return run_id if run_id not in ("", "none") else f"agent-{os.getppid()}"


def choose_output_dir(cfg: Config) -> str:
    """trainer.output_dir, or outputs/<recipe>/<UTC timestamp>; a restarted job finds the directory its
    first attempt chose (recorded under outputs/<recipe>/.launches/), so it resumes its own run."""
    if cfg.trainer.output_dir:
        return str(Path(cfg.trainer.output_dir).resolve())
    base = Path("outputs") / cfg.name
    pointer = base / ".launches" / _launch_key()
    if restart_count() > 0 and pointer.is_file():
        return pointer.read_text().strip()
    chosen = str((base / datetime.datetime.now(datetime.UTC).strftime("%Y%m%d-%H%M%S")).resolve())
    pointer.parent.mkdir(parents=True, exist_ok=True)
    pointer.write_text(chosen + "\n")
    return chosen


def usable_cores() -> int:
    """The cores this process may run on: its CPU affinity, which Slurm, containers and taskset narrow."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def cpu_threads(requested: int) -> tuple[int, str]:
    """Threads for torch in this rank and why: ``requested`` if > 0, else this process's usable cores
    (its CPU affinity, which Slurm and containers narrow) over the ranks on this node, at least 1."""
    if requested > 0:
        return requested, "trainer.cpu_threads"
    cores = usable_cores()
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    return max(cores // local, 1), f"trainer.cpu_threads=0: {cores} usable cores / {local} ranks on this node"


def start_run(cfg: Config) -> Run:
    env = init_distributed(cfg.trainer.device, cfg.trainer.collective_timeout_min)
    setup_logging(env.rank)
    # Rank 0 chooses the directory (timestamps differ between processes) and tells the others.
    chosen = choose_output_dir(cfg) if env.is_main else ""
    output_dir = Path(broadcast_str(chosen)).resolve()
    if env.is_main:
        # trainer.val_only writes beside a training run's outputs, not over them (its own config.yaml).
        config_dir = output_dir / VAL_ONLY_STAGE if cfg.trainer.val_only else output_dir
        config_dir.mkdir(parents=True, exist_ok=True)
        (config_dir / "config.yaml").write_text(to_yaml(cfg))
    torch.distributed.barrier()
    log.info("output directory: %s", output_dir)
    log.info("world size %d on %s", env.world_size, env.device)
    threads, why = cpu_threads(cfg.trainer.cpu_threads)
    torch.set_num_threads(threads)
    log.info("torch threads per rank: %d (%s)", threads, why)
    seed_everything(cfg.trainer.seed)
    return Run(cfg=cfg, env=env, output_dir=output_dir, cache_dir=default_cache_dir(cfg.model.cache_dir))
