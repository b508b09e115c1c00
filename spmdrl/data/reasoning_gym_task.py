"""reasoning-gym's procedurally generated tasks as a data source: ``reasoning_gym:<task>:<split>`` entries.

``data.source=reasoning_gym:leg_counting`` (or the entries ``reasoning_gym:leg_counting:train`` in
data.train_files and ``reasoning_gym:leg_counting:test`` in data.val_files) trains on the task
``leg_counting`` of the reasoning-gym package (the ``envs`` extra). Its settings are the config section
``reasoning_gym`` (:class:`ReasoningGymConfig`): each split's size, the seed, the prompt's answer-format
instruction, and each task's own config kwargs. Several entries of different tasks mix them (each gives
its split's size in rows), each scored by its own rule and reported on its own in
``val/accuracy/reasoning_gym/<task>``.

The two splits never share a question. Each is drawn from a seed of its own, derived from
``reasoning_gym.seed``, the task and the split (reasoning-gym seeds item ``i`` of a dataset with
``seed + i``, so consecutive seeds would share all but one item), and then deduplicated: the test split
first, distinct questions, then the train split, distinct questions none of which is a test question. So
the test split does not change when only the train size does. A task whose questions run out (a narrow
config) is an error naming the sizes to lower.

Each row is in verl's schema::

    prompt        [{"role": "system", "content": <reasoning-gym's instruction>}, {"role": "user", "content": <question>}]
    data_source   "reasoning_gym/<task>"
    ability       "reasoning"
    reward_model  {"style": "rule", "ground_truth": <the entry's answer, "" where the task has none>}
    extra_info    {"split", "index", "config": <the task's kwargs, JSON>, "entry": <the generated entry, JSON>}
    response      "<answer>{answer}</answer>"   (an SFT demonstration of the format)

and is scored by the task's own ``score_answer`` (spmdrl.rewards.reasoning_gym_score, ``reward.fn=auto``).
Generation runs once per config: the splits are cached under ``<cache>/reasoning_gym-<task>-<hash>/`` (some
tasks take seconds per item: knight_swap, sokoban, futoshiki), written by one process while the others
(every rank starts at once) wait for it.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import difflib
import fcntl
import hashlib
import io
import json
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa

from spmdrl.config_section import register_config_section
from spmdrl.data.parquet import verl_schema, write_parquet_atomic
from spmdrl.errors import ConfigError
from spmdrl.rewards import reasoning_gym_score
from spmdrl.rewards.reasoning_gym_score import encode_entry, require

log = logging.getLogger(__name__)

PREFIX = "reasoning_gym:"
SPLITS = ("train", "test")
# Part of the cache key: bump it when the generated rows change for an unchanged config.
FORMAT_VERSION = 1
# Draws per wanted row before a split is declared exhausted (duplicates and test questions are skipped).
_DRAWS_PER_ROW = 4
_MIN_EXTRA_DRAWS = 100


@register_config_section("reasoning_gym")
@dataclass
class ReasoningGymConfig:
    """The reasoning-gym source's settings, the config section ``reasoning_gym`` (``reasoning_gym.train_size=500``)."""

    # Rows of each task's train and test split (each entry gives its split's size).
    train_size: int = 1000
    test_size: int = 100
    # The splits' seeds derive from it, the task and the split.
    seed: int = 0
    # The answer-format instruction, as the system message: a name of reasoning_gym.utils.SYSTEM_PROMPTS
    # (default, DeepSeekZero, simple, direct, chain_of_draft), or "" for none (then the question alone,
    # and the scorer finds no <answer> tag unless the model writes one).
    system_prompt: str = "default"
    # Each task's config kwargs, by task: {leg_counting: {min_animals: 1, max_animals: 3}}. A task not
    # named takes reasoning-gym's defaults.
    config: dict[str, dict[str, Any]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.train_size < 0 or self.test_size < 0:
            raise ConfigError(
                f"reasoning_gym.train_size and test_size must be >= 0, got {self.train_size} and {self.test_size}"
            )


# The pyarrow schema of both splits; extra_info's entry and config are JSON text (their fields differ per task).
SCHEMA = verl_schema(
    [("split", pa.string()), ("index", pa.int64()), ("config", pa.string()), ("entry", pa.string())],
    trailing=[("response", pa.string())],
)


@dataclass(frozen=True)
class TaskEntry:
    """A parsed ``reasoning_gym:<task>:<split>`` entry."""

    task: str
    split: str


def is_entry(name: str) -> bool:
    return name.startswith(PREFIX)


def parse_entry(name: str, key: str = "data.train_files / data.val_files") -> TaskEntry:
    """``reasoning_gym:<task>:<split>``; a missing or unknown split is a ConfigError naming the fix."""
    task, _, split = name.removeprefix(PREFIX).partition(":")
    if not task:
        raise ConfigError(f"{key}: {name!r} names no task; write reasoning_gym:<task>:train (or :test)")
    if split not in SPLITS:
        what = f"has no split {split!r}" if split else "names no split"
        raise ConfigError(
            f"{key}: {name!r} {what}; use {PREFIX}{task}:train or {PREFIX}{task}:test (or data.source="
            f"{PREFIX}{task}, which sets both)"
        )
    return TaskEntry(task, split)


def data_source(name: str) -> str:
    """The data source of a ``reasoning_gym:<task>:<split>`` entry's rows: ``reasoning_gym/<task>``."""
    return reasoning_gym_score.PREFIX + parse_entry(name).task


def source_files(source: str) -> tuple[list[str], list[str]]:
    """data.source's (train_files, val_files): ``reasoning_gym:<task>`` -> its train and test splits."""
    if not is_entry(source) or not source.removeprefix(PREFIX) or ":" in source.removeprefix(PREFIX):
        raise ConfigError(
            f"data.source={source!r}: a data source is reasoning_gym:<task> (a reasoning-gym task, e.g. "
            "reasoning_gym:leg_counting); or leave data.source empty and list files in data.train_files / "
            "data.val_files"
        )
    return [f"{source}:train"], [f"{source}:test"]


# ------------------------------------------------------------------------------------------ checks


def check_task(task: str, cfg: ReasoningGymConfig, key: str = "data.train_files") -> None:
    """The task exists, its config kwargs are fields of its config and pass its own validation, and the
    system prompt has a name reasoning-gym knows. ConfigError (ReasoningGymMissingError without the
    package) naming what to fix; nothing is generated."""
    rg = require(f"{key}: the reasoning-gym task {task!r}")
    from reasoning_gym.factory import DATASETS
    from reasoning_gym.utils import SYSTEM_PROMPTS

    if task == "composite":
        raise ConfigError(
            f"{key}: reasoning-gym's composite mixes tasks; list one entry per task instead "
            "(data.train_files=[reasoning_gym:<a>:train,reasoning_gym:<b>:train], each its own data source)"
        )
    if task not in DATASETS:
        names = task_names()
        close = difflib.get_close_matches(task, names, n=5, cutoff=0.5)
        hint = f" Close names: {', '.join(close)}." if close else ""
        raise ConfigError(
            f"{key}: reasoning-gym has no task {task!r}.{hint} Its {len(names)} tasks: "
            "python -m spmdrl.data.reasoning_gym_task --list"
        )
    if cfg.system_prompt and cfg.system_prompt not in SYSTEM_PROMPTS:
        raise ConfigError(
            f"reasoning_gym.system_prompt={cfg.system_prompt!r} is no prompt of reasoning-gym; use one of "
            f"{', '.join(SYSTEM_PROMPTS)}, or '' for none"
        )
    _, config_cls = DATASETS[task]
    kwargs = dict(cfg.config.get(task, {}))
    fields = [f.name for f in dataclasses.fields(config_cls) if f.name not in ("seed", "size")]
    unknown = sorted(set(kwargs) - set(fields))
    if unknown:
        close = {u: difflib.get_close_matches(u, fields, n=1) for u in unknown}
        hints = [f"{u} (did you mean {c[0]}?)" if c else u for u, c in close.items()]
        raise ConfigError(
            f"reasoning_gym.config.{task}: {', '.join(hints)} {'is' if len(unknown) == 1 else 'are'} not "
            f"{'a setting' if len(unknown) == 1 else 'settings'} of the task {task!r}; its settings: "
            f"{', '.join(fields)}"
        )
    try:
        with _quiet():
            rg.create_dataset(task, size=1, seed=0, **kwargs)
    except Exception as e:  # the task's own validation (asserts, ValueError): its message names the setting
        raise ConfigError(
            f"reasoning_gym.config.{task}={kwargs}: the task refuses these settings ({type(e).__name__}: "
            f"{e or 'an assertion failed'}); fix them (its settings: {', '.join(fields)})"
        ) from None


def check_config_tasks(cfg: ReasoningGymConfig, tasks: set[str]) -> None:
    """reasoning_gym.config names only tasks the data has (a misspelled task's kwargs would be ignored)."""
    stray = sorted(set(cfg.config) - tasks)
    if stray:
        raise ConfigError(
            f"reasoning_gym.config has settings for {', '.join(map(repr, stray))}, which no data entry names "
            f"(the data's reasoning-gym tasks: {', '.join(sorted(tasks)) or 'none'}); fix the task's name"
        )


def check_entries(files: dict[str, list[str]], cfg: ReasoningGymConfig) -> set[str]:
    """Every ``reasoning_gym:`` entry of ``files`` (config key -> its entries) parses and names a task
    that exists with valid settings (:func:`check_task`, each task once), and reasoning_gym.config names
    only tasks of the data; returns their data sources. The start's and ``--check``'s check: nothing is
    generated."""
    tasks: dict[str, str] = {}
    for key, names in files.items():
        for i, name in enumerate(names):
            if is_entry(name):
                tasks.setdefault(parse_entry(name, f"{key}[{i}]").task, f"{key}[{i}]")
    for task, key in tasks.items():
        check_task(task, cfg, key)
    if tasks or cfg.config:
        check_config_tasks(cfg, set(tasks))
    return {reasoning_gym_score.PREFIX + t for t in tasks}


# ------------------------------------------------------------------------------------------ generation


def split_seed(seed: int, task: str, split: str) -> int:
    """A split's seed: far from the other split's (reasoning-gym's item i uses seed + i)."""
    digest = hashlib.sha256(f"reasoning_gym/{seed}/{task}/{split}".encode()).digest()
    return int.from_bytes(digest[:4], "big") & 0x7FFFFFFF


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """Some generators print progress to stdout (a rank's log is no place for it)."""
    with contextlib.redirect_stdout(io.StringIO()):
        yield


def _draw(
    task: str, kwargs: dict[str, Any], seed: int, count: int, exclude: set[str], split: str
) -> list[dict]:
    """``count`` entries with distinct questions, none in ``exclude``, from the task seeded ``seed``."""
    if count == 0:
        return []
    rg = require(f"the reasoning-gym task {task!r}")
    max_draws = count * _DRAWS_PER_ROW + _MIN_EXTRA_DRAWS
    with _quiet():
        dataset = rg.create_dataset(task, size=max_draws, seed=seed, **kwargs)
    out: list[dict] = []
    seen: set[str] = set()
    for i in range(max_draws):
        with _quiet():
            entry = dataset[i]
        question = entry["question"]
        if question in seen or question in exclude:
            continue
        seen.add(question)
        out.append(entry)
        if len(out) == count:
            return out
    raise ConfigError(
        f"reasoning-gym task {task!r}: the {split} split needs {count} distinct questions (none of them a test "
        f"question) but {max_draws} draws gave {len(out)}; lower reasoning_gym.{split}_size or widen the task's "
        f"settings (reasoning_gym.config.{task})"
    )


def _row(task: str, entry: dict, split: str, index: int, config_json: str, instruction: str) -> dict:
    answer = entry.get("answer")
    truth = "" if answer is None else str(answer)
    messages = [{"role": "system", "content": instruction}] if instruction else []
    return {
        "data_source": reasoning_gym_score.PREFIX + task,
        "prompt": [*messages, {"role": "user", "content": entry["question"]}],
        "ability": "reasoning",
        "reward_model": {"style": "rule", "ground_truth": truth},
        "extra_info": {"split": split, "index": index, "config": config_json, "entry": encode_entry(entry)},
        "response": f"<answer>{truth}</answer>",
    }


def generate(task: str, cfg: ReasoningGymConfig) -> dict[str, list[dict]]:
    """The rows of both splits of ``task``; the same config always gives the same rows."""
    check_task(task, cfg)
    from reasoning_gym.utils import SYSTEM_PROMPTS

    kwargs = dict(cfg.config.get(task, {}))
    config_json = json.dumps(kwargs, sort_keys=True)
    instruction = SYSTEM_PROMPTS[cfg.system_prompt] if cfg.system_prompt else ""
    test = _draw(task, kwargs, split_seed(cfg.seed, task, "test"), cfg.test_size, set(), "test")
    test_questions = {e["question"] for e in test}
    train = _draw(task, kwargs, split_seed(cfg.seed, task, "train"), cfg.train_size, test_questions, "train")
    return {
        split: [_row(task, e, split, i, config_json, instruction) for i, e in enumerate(entries)]
        for split, entries in (("train", train), ("test", test))
    }


def config_hash(task: str, cfg: ReasoningGymConfig) -> str:
    """A short hash of everything that determines the task's generated files (reasoning-gym's version too:
    a release may generate other questions from the same seed)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        rg_version = version("reasoning-gym")
    except PackageNotFoundError:
        rg_version = "?"
    key = {
        "format": FORMAT_VERSION,
        "reasoning_gym": rg_version,
        "task": task,
        "train_size": cfg.train_size,
        "test_size": cfg.test_size,
        "seed": cfg.seed,
        "system_prompt": cfg.system_prompt,
        "config": cfg.config.get(task, {}),
    }
    return hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:12]


def write_splits(cache_dir: Path, task: str, cfg: ReasoningGymConfig) -> dict[str, Path]:
    """The split files of ``task`` under ``cache_dir/reasoning_gym-<task>-<hash>/``, generated if missing.
    Every rank may call it at once: one generates (a file lock), the others wait and read its files."""
    split_dir = Path(cache_dir).expanduser() / f"reasoning_gym-{task}-{config_hash(task, cfg)}"
    paths = {split: split_dir / f"{split}.parquet" for split in SPLITS}
    if all(p.is_file() for p in paths.values()):
        return paths
    split_dir.mkdir(parents=True, exist_ok=True)
    with open(split_dir / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not all(p.is_file() for p in paths.values()):
            start = time.monotonic()
            rows = generate(task, cfg)
            for split, path in paths.items():
                write_parquet_atomic(rows[split], path, SCHEMA)
            log.info(
                "reasoning-gym task %s: %d train and %d test rows generated in %.1f s into %s",
                task,
                len(rows["train"]),
                len(rows["test"]),
                time.monotonic() - start,
                split_dir,
            )
    return paths


def resolve(name: str, cache_dir: Path, cfg: ReasoningGymConfig) -> Path:
    """The generated file of a ``reasoning_gym:<task>:<split>`` entry."""
    entry = parse_entry(name)
    return write_splits(cache_dir, entry.task, cfg)[entry.split]


def task_names() -> list[str]:
    require("listing reasoning-gym's tasks")
    from reasoning_gym.factory import DATASETS

    return sorted(n for n in DATASETS if n != "composite")


def main(argv: list[str] | None = None) -> None:
    d = ReasoningGymConfig()
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--list", action="store_true", help="print reasoning-gym's task names and exit")
    parser.add_argument("--task", help="the task to generate")
    parser.add_argument("--out", type=Path, help="directory for train.parquet and test.parquet")
    parser.add_argument("--train-size", type=int, default=d.train_size)
    parser.add_argument("--test-size", type=int, default=d.test_size)
    parser.add_argument("--seed", type=int, default=d.seed)
    parser.add_argument("--system-prompt", default=d.system_prompt)
    parser.add_argument("--config", default="{}", help="the task's settings as JSON: '{\"max_animals\": 3}'")
    args = parser.parse_args(argv)
    if args.list:
        print("\n".join(task_names()))
        return
    if not args.task or args.out is None:
        parser.error("--task and --out are required (or --list)")
    cfg = ReasoningGymConfig(
        train_size=args.train_size,
        test_size=args.test_size,
        seed=args.seed,
        system_prompt=args.system_prompt,
        config={args.task: json.loads(args.config)},
    )
    rows = generate(args.task, cfg)
    args.out.mkdir(parents=True, exist_ok=True)
    for split in SPLITS:
        path = args.out / f"{split}.parquet"
        write_parquet_atomic(rows[split], path, SCHEMA)
        print(f"{split}: {path} ({len(rows[split])} rows)")


if __name__ == "__main__":
    main()
