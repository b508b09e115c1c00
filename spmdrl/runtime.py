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

from spmdrl.config import Config, Derived
from spmdrl.config_loader import to_yaml
from spmdrl.distributed.env import DistEnv, broadcast_str, init_distributed
from spmdrl.logging.metrics import MetricLogger, NullLogger
from spmdrl.models.tiny import default_cache_dir

log = logging.getLogger("spmdrl")


@dataclass(frozen=True)
class Run:
    cfg: Config
    env: DistEnv
    output_dir: Path
    cache_dir: Path

    def metric_logger(self, total_steps: int, subdir: str = "") -> NullLogger:
        """Rank 0's logger into output_dir (or output_dir/subdir, for a stage such as the SFT warm-start)."""
        if not self.env.is_main:
            return NullLogger()
        lc = self.cfg.logging
        out = self.output_dir / subdir
        out.mkdir(parents=True, exist_ok=True)
        return MetricLogger(
            out,
            total_steps=total_steps,
            tensorboard=lc.tensorboard,
            progress_bar=lc.progress_bar,
            console_every=lc.console_every,
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


def start_run(cfg: Config) -> Run:
    env = init_distributed(cfg.trainer.device, cfg.trainer.collective_timeout_min)
    setup_logging(env.rank)
    # Rank 0 chooses the directory (timestamps differ between processes) and tells the others.
    chosen = cfg.trainer.output_dir or os.path.join(
        "outputs", cfg.name, datetime.datetime.now(datetime.UTC).strftime("%Y%m%d-%H%M%S")
    )
    output_dir = Path(broadcast_str(str(Path(chosen).resolve()) if env.is_main else "")).resolve()
    if env.is_main:
        output_dir.mkdir(parents=True, exist_ok=True)
        (output_dir / "config.yaml").write_text(to_yaml(cfg))
    torch.distributed.barrier()
    log.info("output directory: %s", output_dir)
    log.info("world size %d on %s", env.world_size, env.device)
    seed_everything(cfg.trainer.seed)
    return Run(cfg=cfg, env=env, output_dir=output_dir, cache_dir=default_cache_dir(cfg.model.cache_dir))
