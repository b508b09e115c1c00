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
from spmdrl.rollout.config import MultiTurnConfig

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


def check_env_turns(cfg: EnvConfig, mt: MultiTurnConfig, collective_timeout_min: float) -> str:
    """A multi-turn environment's turns fit the rollout.multi_turn settings that bound them (the agent loop
    drives them: spmdrl.rollout.vf_turns); returns a few words for ``--check``'s line."""
    if not load_env(cfg).multi_turn:
        return "single-turn"
    if mt.enable:
        raise ConfigError(
            f"env.source={cfg.source} is a multi-turn environment that gives its own turns, and "
            "rollout.multi_turn.enable=true would add spmdrl's tools beside them; set "
            "rollout.multi_turn.enable=false (the rollout.multi_turn limits still bound the environment's turns)"
        )
    if mt.max_assistant_turns <= 0 or mt.max_user_turns < 0 or mt.tool_timeout_s <= 0:
        raise ConfigError(
            "env.source's turns are bounded by rollout.multi_turn.max_assistant_turns (> 0), max_user_turns "
            f"(>= 0) and tool_timeout_s (> 0, each environment call); got {mt.max_assistant_turns}, "
            f"{mt.max_user_turns}, {mt.tool_timeout_s}"
        )
    limit_s = collective_timeout_min * 60
    if mt.rollout_deadline_s >= limit_s or mt.tool_timeout_s >= limit_s:
        # As for spmdrl's tools (spmdrl.config): a rank still driving an environment must not be what ends
        # the others' wait in the next collective, unnamed.
        raise ConfigError(
            f"rollout.multi_turn.rollout_deadline_s={mt.rollout_deadline_s} and tool_timeout_s={mt.tool_timeout_s} "
            f"bound env.source={cfg.source}'s turns and must stay below trainer.collective_timeout_min="
            f"{collective_timeout_min:g} minutes: the other ranks wait in the next collective while a rank "
            "finishes its rollout"
        )
    return f"multi-turn: up to {mt.max_assistant_turns} assistant turns, {mt.tool_timeout_s:g} s per environment call"


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
