"""An environment's tasks as spmdrl's prompt rows (verl's schema), split into train and validation.

Each row holds the prompt messages, the task's answer as ``reward_model.ground_truth`` (what the samples
log shows), and in ``extra_info.env_task`` the task itself as JSON (a 0.3.x dataset row, or a v1 task's
data), which the reward (spmdrl.envs.reward) rebuilds the task from in a worker process. Validation is the
environment's eval dataset where it has one, else the last env.num_val tasks, held out of training.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa

from spmdrl.data.parquet import verl_schema, write_parquet_atomic
from spmdrl.envs import legacy
from spmdrl.envs.config import EnvConfig
from spmdrl.envs.load import LEGACY, LoadedEnv
from spmdrl.errors import ConfigError

TASK_KEY = "env_task"
SCHEMA = verl_schema([("split", pa.string()), ("index", pa.int64()), (TASK_KEY, pa.string())])

# (prompt messages, ground truth, payload): one task, whichever generation it came from.
Task = tuple[list[dict[str, Any]], str, dict[str, Any]]


@dataclass(frozen=True)
class EnvRows:
    """The train and validation rows and where validation's came from (logged at start)."""

    train: list[dict[str, Any]]
    val: list[dict[str, Any]]
    val_from: str  # "eval dataset", "held out of the dataset" or "none"

    def describe(self) -> str:
        return f"{len(self.train)} training prompts, {len(self.val)} validation prompts ({self.val_from})"


def env_rows(loaded: LoadedEnv, cfg: EnvConfig) -> EnvRows:
    """The rows of ``loaded`` under env.num_train / env.num_val (module docstring)."""
    if loaded.generation == LEGACY:
        legacy.check_rubric(loaded.source, loaded.env)
        train, val, val_from = _legacy_tasks(loaded.env, cfg)
    else:
        train, val, val_from = _v1_tasks(loaded.env, cfg)
    if not train:
        raise ConfigError(
            f"env.source={loaded.source}: no training tasks are left (env.num_train={cfg.num_train}, "
            f"env.num_val={cfg.num_val} {val_from}); lower env.num_val or give the environment more tasks"
        )
    return EnvRows(
        [_row(loaded, t, "train", i) for i, t in enumerate(train)],
        [_row(loaded, t, "val", i) for i, t in enumerate(val)],
        val_from,
    )


def _legacy_tasks(env: Any, cfg: EnvConfig) -> tuple[list[Task], list[Task], str]:
    if legacy.has_eval_dataset(env):
        train = [legacy.task_row(r) for r in legacy.dataset_rows(env, "train", cfg.num_train)]
        val = [legacy.task_row(r) for r in legacy.dataset_rows(env, "eval", cfg.num_val)]
        return train, val, "eval dataset"
    return _held_out([legacy.task_row(r) for r in legacy.dataset_rows(env, "train", 0)], cfg)


def _v1_tasks(taskset: Any, cfg: EnvConfig) -> tuple[list[Task], list[Task], str]:
    from spmdrl.envs import v1

    if not taskset.bounded:
        if not cfg.num_train:
            raise ConfigError(
                f"the taskset {type(taskset).__name__} is infinite; set env.num_train to bound it"
            )
        taskset = taskset.take(cfg.num_train + cfg.num_val)
    return _held_out([v1.task_row(t) for t in v1.iter_tasks(taskset)], cfg)


def _held_out(tasks: list[Task], cfg: EnvConfig) -> tuple[list[Task], list[Task], str]:
    """No eval split: the last num_val tasks validate, the first num_train of the rest train."""
    cut = len(tasks) - cfg.num_val if cfg.num_val else len(tasks)
    train, val = tasks[: max(cut, 0)], tasks[max(cut, 0) :]
    if cfg.num_train:
        train = train[: cfg.num_train]
    return train, val, "held out of the dataset" if val else "none"


def _row(loaded: LoadedEnv, task: Task, split: str, index: int) -> dict[str, Any]:
    messages, ground_truth, payload = task
    return {
        "data_source": loaded.data_source,
        "prompt": messages,
        "ability": "env",
        "reward_model": {"style": "verifiers", "ground_truth": ground_truth},
        "extra_info": {"split": split, "index": index, TASK_KEY: json.dumps(payload, default=str)},
    }


def write_rows(rows: EnvRows, cache_dir: Path, name: str) -> tuple[Path, Path | None]:
    """The rows as ``train.parquet`` (and ``val.parquet`` where there are validation rows) under
    ``cache_dir/env-<name>-<hash of the rows>/``: the same rows, the same files, written once; safe from
    every rank at once (each file appears whole)."""
    digest = hashlib.sha256(json.dumps([rows.train, rows.val], sort_keys=True).encode()).hexdigest()[:12]
    out = Path(cache_dir).expanduser() / f"env-{name}-{digest}"
    out.mkdir(parents=True, exist_ok=True)
    paths: dict[str, Path] = {}
    for split, split_rows in (("train", rows.train), ("val", rows.val)):
        if split_rows:
            paths[split] = out / f"{split}.parquet"
            if not paths[split].is_file():
                write_parquet_atomic(split_rows, paths[split], SCHEMA)
    return paths["train"], paths.get("val")
