"""What a recipe's start checks, checked by spmdrl.preflight.check_inputs before anything heavy: on every
rank before the process group, and by ``--check`` in one process, so that the two cannot disagree.

An RL recipe (its module declares ``ROLES``, spmdrl.rl.plan.Roles) at start reads its data, resolves
reward.fn, plans the job on the world size and starts the engine; each of these could fail there after
``--check`` had said ok. Checked here, each as the start does it (the same functions, the same messages):

- env.source: the environment loads, its rubric can score a sample, it has rows, and a multi-turn one's
  turns fit rollout.multi_turn (spmdrl.envs.setup);
- the reward's columns: every data file has ``reward_model`` with a ``ground_truth`` in every row (what
  spmdrl.data.prompts reads for every reward function, verl's signature or spmdrl's);
- reward.fn per ``data_source``: the values in the data (a file without the column: the empty source)
  checked by spmdrl.rewards.registry.check_data_sources (``reward.fn=auto`` needs a built-in reward for
  each; a math source needs math-verify), and reward.fn resolved as the recipe resolves it;
- the engine's release: the installed vLLM's version from its package metadata (vLLM is not imported);
- the SFT stage's response column, where one runs (the sft entry; an RL recipe's warm-start);
- a local or cached model's positions (prompt + response) and attention heads (rollout.tp);
- the placement and batch arithmetic (spmdrl.rl.plan.plan_job) on the world size the job runs on, where
  it is known (``--world-size N``, or WORLD_SIZE as torchrun sets it); the training set's size is its rows
  before the overlong filter, so a plan that fails only after that filter still fails at start.

Only the columns needed are read (``data_source``, ``reward_model``), through :func:`read_data_columns`;
no model, tokenizer or engine is loaded.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

import pyarrow as pa
import pyarrow.compute as pc

from spmdrl.config import Config
from spmdrl.data import reasoning_gym_task, tiny_shapes_task, tiny_task, tools_task
from spmdrl.data.config import DataConfig
from spmdrl.data.parquet import DataError, to_ground_truth
from spmdrl.data.sources import ReadOptions, check_sources, read_entry, read_options
from spmdrl.derived import max_sequence_length
from spmdrl.envs.config import EnvConfig
from spmdrl.errors import ConfigError
from spmdrl.models.config import ModelConfig
from spmdrl.models.tiny import BUILT_IN_MODELS
from spmdrl.rewards.tiny import SHAPES_DATA_SOURCE
from spmdrl.rollout.config import RolloutConfig

if TYPE_CHECKING:
    from spmdrl.rl.plan import Roles

# The world size a launched rank runs on (torchrun sets it); --check reads it too where a script exports it.
WORLD_SIZE_VARIABLE = "WORLD_SIZE"


def read_data_columns(
    path: str, columns: list[str], optional: list[str], options: ReadOptions | None = None
) -> pa.Table:
    """``columns`` (each required: a missing one is the start's DataError, naming the entry) and those of
    ``optional`` the entry has, read from the data entry ``path`` alone (a parquet file: column projection;
    spmdrl.data.sources, with ``options``' split and column mapping)."""
    options = options or ReadOptions()
    (view,) = check_sources([path], columns, options=options)
    return read_entry(view, [*columns, *(c for c in optional if c in view.columns)], options.columns)


def _options(data: DataConfig, key: str) -> ReadOptions:
    """The read options of the list ``key`` (``data.train_files[i]``) names an entry of."""
    return read_options(data, key.split("[", 1)[0])


def data_files(data: DataConfig) -> list[tuple[str, str]]:
    """(key, file) of every data file the run reads from disk (a built-in task's split is generated)."""
    prefixes = ("tiny:", tools_task.PREFIX, reasoning_gym_task.PREFIX, tiny_shapes_task.PREFIX)
    return [
        (f"{key}[{i}]", name)
        for key, names in (("data.train_files", data.train_files), ("data.val_files", data.val_files))
        for i, name in enumerate(names)
        if not name.startswith(prefixes)
    ]


def check_reward_data(data: DataConfig, reward_fn: str) -> str:
    """Every data file holds the reward's columns, and reward.fn scores each of its data sources (a
    reasoning-gym task's entry: its ``reasoning_gym/<task>``); returns a few words for ``--check``'s line.
    Raises DataError / ConfigError as the recipe's start would."""
    from spmdrl.rewards.registry import check_data_sources, load_reward_fn

    load_reward_fn(reward_fn)  # as the recipe resolves it (a user's function: where workers import it)
    sources: set[str] = set()
    for key, name in data_files(data):
        table = read_data_columns(name, ["reward_model"], ["data_source"], _options(data, key))
        _check_ground_truth(table.column("reward_model"), name)
        found = _data_sources(table)
        try:
            check_data_sources(reward_fn, found)
        except ConfigError as e:
            column = "" if "data_source" in table.column_names else " (it has no data_source column)"
            raise type(e)(f"{key}={name}{column}: {e}") from None
        sources |= found
    names = [*data.train_files, *data.val_files]
    # A reasoning-gym task's rows are generated (the task and its settings: spmdrl.preflight's data check).
    generated = {reasoning_gym_task.data_source(n) for n in names if reasoning_gym_task.is_entry(n)}
    if generated:
        check_data_sources(reward_fn, generated)
        sources |= generated
    if any(name.startswith("tiny:") for name in names):
        sources.add(tiny_task.DATA_SOURCE)
    if any(name.startswith(tools_task.PREFIX) for name in names):
        sources.add(tools_task.DATA_SOURCE)
    if any(name.startswith(tiny_shapes_task.PREFIX) for name in names):
        sources.add(SHAPES_DATA_SOURCE)
    return f"reward.fn={reward_fn} on data_source {', '.join(map(repr, sorted(sources)))}"


def check_env_or_reward_data(env: EnvConfig, data: DataConfig, reward_fn: str) -> str:
    """env.source: the environment loads and gives rows its rubric can score (spmdrl.envs.setup); else
    the data files and reward.fn (check_reward_data)."""
    if env.enabled:
        from spmdrl.envs.setup import check_env

        return check_env(env, reward_fn)
    return check_reward_data(data, reward_fn)


def _check_ground_truth(column: pa.ChunkedArray, name: str) -> None:
    """Every row's reward_model has a ground_truth, without turning the column into Python objects: the
    first row that lacks one gets the start's message (spmdrl.data.parquet.to_ground_truth)."""
    if pa.types.is_struct(column.type) and column.type.get_field_index("ground_truth") >= 0:
        missing = pc.or_kleene(pc.is_null(column), pc.is_null(pc.struct_field(column, "ground_truth")))
        missing = pc.fill_null(missing, True)
        if not pc.any(missing).as_py():
            return
        row = pc.index(missing, True).as_py()
    else:
        row = 0
    to_ground_truth(column[row].as_py(), where=f"{name} row {row}")  # raises: the start's message


def _data_sources(table: pa.Table) -> set[str]:
    if "data_source" not in table.column_names:
        return {""}  # what spmdrl.data.prompts gives a row without one
    values = pc.unique(table.column("data_source")).to_pylist()
    return {"" if v is None else str(v) for v in values}


def check_engine_version() -> str:
    """The installed vLLM is a release the engine runs (spmdrl.rollout.vllm_version, from its package
    metadata, without importing it); returns which, or raises ConfigError naming the fix."""
    from spmdrl.rollout.vllm_version import installed_vllm, require_supported_vllm

    try:
        require_supported_vllm()
    except RuntimeError as e:
        raise ConfigError(f"rollout.engine=vllm: {e}") from None
    dist, version = installed_vllm() or ("vllm", "?")
    return f"engine {dist} {version}"


def launched_world_size(explicit: int | None) -> tuple[int, str] | None:
    """The world size the job will run on and where it came from: ``--world-size N``, else WORLD_SIZE
    (a launched rank's, or a script's); None where neither says."""
    if explicit is not None:
        return explicit, "--world-size"
    value = os.environ.get(WORLD_SIZE_VARIABLE, "")
    return (int(value), WORLD_SIZE_VARIABLE) if value.isdigit() and int(value) > 0 else None


def check_plan(cfg: Config, roles: Roles, world: tuple[int, str] | None) -> str:
    """The job's placement and batch arithmetic on the world size it runs on (spmdrl.rl.plan.plan_job, as
    build_job plans it), or a note that it was not checked and how to check it."""
    if world is None:
        return "plan not checked: the world size is unknown (add --world-size N)"
    from spmdrl.models.tiny import default_cache_dir
    from spmdrl.rl.plan import plan_job, train_rows

    world_size, source = world
    try:
        plan = plan_job(cfg, world_size, train_rows(cfg, default_cache_dir(cfg.model.cache_dir)), roles)
    except ConfigError as e:
        raise ConfigError(f"on {world_size} ranks ({source}): {e}") from None
    return f"plan on {world_size} ranks ({source}): {plan.derived.total_steps} steps"


def check_sft_columns(data: DataConfig, why: str = "") -> list[str]:
    """The SFT stage's response column (data.response_key) in every data file; ``why``: what trains on it,
    added to the error (an RL recipe's warm-start)."""
    column = data.response_key
    for key, name in data_files(data):
        try:
            check_sources([name], [column], {column: "data.response_key"}, _options(data, key))
        except DataError as e:
            raise DataError(f"{e}{why}") from None
    return [f"data.response_key={column}"] if data_files(data) else []


def check_model_shape(model: ModelConfig, rollout: RolloutConfig, max_model_len: int) -> None:
    """Prompt + response within the model's positions, and rollout.tp splitting its attention heads, from
    the config.json of a local or cached model (spmdrl.rl.job.check_model_fits, as the start checks it
    before the engine; a hub id not cached yet is checked there, after the download)."""
    from huggingface_hub import try_to_load_from_cache

    path = model.path
    local = Path(path).expanduser()
    if path in BUILT_IN_MODELS:
        return  # built at start, from the config's lengths
    from spmdrl.models import packaged

    if packaged.is_packaged(path):
        from spmdrl.models.tiny import default_cache_dir

        local = packaged.converted_dir(path, default_cache_dir(model.cache_dir))  # checked at start if absent
    if not (local / "config.json").is_file():
        cached = try_to_load_from_cache(path, "config.json") if path.count("/") == 1 else None
        if not isinstance(cached, str):
            return
        local = Path(cached).parent
    from spmdrl.rl.job import check_model_fits

    check_model_fits(local, max_model_len, rollout.tp, model.trust_remote_code)


def check_rl_start(cfg: Config, roles: Roles | None, world: tuple[int, str] | None) -> list[str]:
    """What a recipe's start checks (the module docstring): an RL recipe's (``roles``: its module's
    ROLES), and the SFT stage's columns (the sft entry's, an RL warm-start's)."""
    if roles is None:
        return check_sft_columns(cfg.data) if cfg.entry == "sft" else []
    env = cfg.section(EnvConfig)
    checked = [check_env_or_reward_data(env, cfg.data, cfg.reward.fn)]
    if env.enabled:  # a multi-turn environment's turns, within rollout.multi_turn's limits
        from spmdrl.rollout.vf_turns import check_env_turns

        checked.append(check_env_turns(env, cfg.rollout.multi_turn, cfg.trainer.collective_timeout_min))
    if cfg.warmstart.enabled and cfg.warmstart.entry == "sft":  # SFT on the same files before RL starts
        why = " (the warm-start, warmstart.enabled=true, trains on it; or set warmstart.enabled=false)"
        checked += check_sft_columns(cfg.data, why)
    checked.append(check_engine_version())
    check_model_shape(cfg.model, cfg.rollout, max_sequence_length(cfg))
    return [*checked, check_plan(cfg, roles, world)]
