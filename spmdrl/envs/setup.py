"""What the RL job and ``--check`` do with the ``env`` section: load the environment, make its rows, and
give the reward function that scores them.

Every rank loads the environment (a multi-turn one drives its turns on every rank); rank 0's rows are
broadcast, so every rank trains on the same prompts whatever the environment's dataset code does, and
each rank writes them to the same content-named files (spmdrl.envs.rows.write_rows).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

from spmdrl.envs.config import EnvConfig
from spmdrl.envs.load import LoadedEnv
from spmdrl.envs.reward import EnvReward, cached_env
from spmdrl.envs.rows import EnvRows, env_rows, write_rows

log = logging.getLogger("spmdrl")


@dataclass(frozen=True)
class EnvJob:
    """The environment of a run: what build_job reads instead of data.*_files and reward.fn."""

    loaded: LoadedEnv
    train_file: Path
    val_file: Path | None  # None: no validation rows (env.num_val=0 and no eval dataset)
    reward_fn: EnvReward
    rows: EnvRows


def load_env(cfg: EnvConfig) -> LoadedEnv:
    """The environment env.source names, loaded once per process (ConfigError for every failure)."""
    return cached_env(cfg.source, cfg.kind_and_name()[1], _args_json(cfg))


def _args_json(cfg: EnvConfig) -> str:
    return json.dumps(dict(cfg.args), sort_keys=True)


def env_reward(cfg: EnvConfig) -> EnvReward:
    return EnvReward(cfg.source, cfg.kind_and_name()[1], _args_json(cfg))


def build_env_job(cfg: EnvConfig, cache_dir: Path, *, distributed: bool = True) -> EnvJob:
    """The environment loaded on this rank and its rows (rank 0's, when ``distributed``) written under
    ``cache_dir``. Every rank calls it."""
    loaded = load_env(cfg)
    if distributed:
        import torch.distributed as dist

        from spmdrl.distributed.env import broadcast_object

        rows = broadcast_object(env_rows(loaded, cfg) if dist.get_rank() == 0 else None)
    else:
        rows = env_rows(loaded, cfg)
    train, val = write_rows(rows, cache_dir, loaded.name)
    log.info("environment %s: %s", loaded.describe(), rows.describe())
    return EnvJob(loaded, train, val, env_reward(cfg), rows)


def check_env(cfg: EnvConfig) -> str:
    """``--check``'s line: the environment loads, its rubric can be scored sample by sample, it has rows."""
    loaded = load_env(cfg)
    return f"{loaded.describe()}: {env_rows(loaded, cfg).describe()}"


def env_train_rows(cfg: EnvConfig) -> int:
    """The training prompts the environment gives (the plan's rows for ``--check --world-size N``)."""
    return len(env_rows(load_env(cfg), cfg).train)
