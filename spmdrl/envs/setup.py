"""What the RL job and ``--check`` do with the ``env`` section: load the environment, make its rows, and
give the reward function that scores them.

Every rank loads the environment (a multi-turn one drives its turns on every rank); rank 0's rows are
broadcast, so every rank trains on the same prompts whatever the environment's dataset code does, and
each rank writes them to the same content-named files (spmdrl.envs.rows.write_rows).
"""

from __future__ import annotations

import functools
import json
import logging
from dataclasses import dataclass
from pathlib import Path

from spmdrl.envs.config import EnvConfig
from spmdrl.envs.load import LoadedEnv
from spmdrl.envs.reward import EnvReward, cached_env
from spmdrl.envs.rows import EnvRows, env_rows, write_rows
from spmdrl.errors import ConfigError

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

        rows = broadcast_object(rows_of(cfg) if dist.get_rank() == 0 else None)
    else:
        rows = rows_of(cfg)
    train, val = write_rows(rows, cache_dir, loaded.name)
    log.info("environment %s: %s", loaded.describe(), rows.describe())
    return EnvJob(loaded, train, val, env_reward(cfg), rows)


def check_env(cfg: EnvConfig, reward_fn: str = "auto") -> str:
    """``--check``'s line (and every rank's start check): reward.fn left alone, the environment loads, its
    rubric can be scored sample by sample, it has rows."""
    if reward_fn.strip() != "auto":
        raise ConfigError(
            f"env.source={cfg.source} scores with the environment's rubric, and reward.fn={reward_fn} would be "
            "ignored; leave reward.fn unset (auto), or drop env.source to train on data.train_files with it"
        )
    loaded = load_env(cfg)
    return f"{loaded.describe()}: {rows_of(cfg).describe()}"


def env_train_rows(cfg: EnvConfig) -> int:
    """The training prompts the environment gives (the plan's rows for ``--check --world-size N``)."""
    return len(rows_of(cfg).train)


def rows_of(cfg: EnvConfig) -> EnvRows:
    """The environment's rows, made once per process (the start checks, the plan and the job all ask)."""
    return _rows(cfg.source, _args_json(cfg), cfg.num_train, cfg.num_val)


@functools.lru_cache(maxsize=4)
def _rows(source: str, args_json: str, num_train: int, num_val: int) -> EnvRows:
    cfg = EnvConfig(source=source, args=json.loads(args_json), num_train=num_train, num_val=num_val)
    return env_rows(load_env(cfg), cfg)


def forget_loaded() -> None:
    """Drops this process's loaded environments and rows (tests that change the import path)."""
    cached_env.cache_clear()
    _rows.cache_clear()
