"""The built-in tiny task: small-integer addition and subtraction word problems, in verl's schema.

It exists so that every recipe runs end to end with no download: the tiny model
(:mod:`spmdrl.models.tiny`) can learn it in minutes on a CPU, and its answers are checked by the
same ``#### <answer>`` rule as GSM8K. Each row looks like a row of verl's GSM8K preprocessing output::

    prompt        [{"role": "user", "content": "<question> Give the answer after ####."}]
    data_source   "spmdrl/tiny_arith"
    ability       "math"
    reward_model  {"style": "rule", "ground_truth": "19"}
    extra_info    {"split": "train", "index": 0, "question": "<question>"}
    response      "12 + 7 = 19\\n#### 19"          (the SFT demonstration)

Test problems use operand/operator combinations that never occur in train, so a score on the test
split measures arithmetic, not recall of seen questions. A ``correct_fraction`` below 1 puts a
plausible wrong answer into that share of the train demonstrations (for experiments where SFT learns
from noisy data and RL has to fix it); the ground truth is always the true answer.

CLI: ``python -m spmdrl.data.tiny_task --out DIR`` writes ``DIR/train.parquet`` and ``DIR/test.parquet``.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import random
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa

from spmdrl.config_section import choice, register_config_section

# reasoning_gym_task's import registers its section (reasoning_gym) wherever this module is imported, as
# config_loader does for every config; it is light (reasoning-gym itself is imported only for a task).
from spmdrl.data import reasoning_gym_task, tiny_shapes_task, tools_task
from spmdrl.data.parquet import write_parquet_atomic
from spmdrl.data.reasoning_gym_task import ReasoningGymConfig
from spmdrl.data.tools_task import ToolsTaskConfig
from spmdrl.errors import ConfigError

DATA_SOURCE = "spmdrl/tiny_arith"
INSTRUCTION = "Give the answer after ####."
# Part of the cache key: bump it when the generated rows change for an unchanged config, so caches
# written by an older version are not reused.
FORMAT_VERSION = 1
SPLITS = ("train", "test")


@register_config_section("tiny_task")
@dataclass
class TinyTaskConfig:
    """The arithmetic task's settings, the config section ``tiny_task`` (``tiny_task.num_train=64``)."""

    num_train: int = 2000
    num_test: int = 200
    max_operand: int = 20
    # Fraction of SFT demonstrations whose answer is right; the rest carry a wrong answer.
    correct_fraction: float = 1.0
    # How wrong demonstrations are wrong: 0 is a random slip of -3..+3; any other value is a
    # systematic bias (every wrong answer is off by exactly this much), which SFT learns as the mode.
    wrong_offset: int = 0
    # What the test split holds out: "problems" (operand/operation combinations never seen in train)
    # or "questions" (unseen wordings; the arithmetic facts may appear in train).
    held_out: str = choice("problems", ("problems", "questions"))
    seed: int = 1234

    def __post_init__(self) -> None:
        if not 0.0 <= self.correct_fraction <= 1.0:
            raise ConfigError(f"tiny_task.correct_fraction must be in [0, 1], got {self.correct_fraction}")


NAMES = ("Tom", "Anna", "Ben", "Mia", "Sam", "Lily", "Max", "Emma")
# (singular, plural)
OBJECTS = (
    ("apple", "apples"),
    ("book", "books"),
    ("coin", "coins"),
    ("pen", "pens"),
    ("ball", "balls"),
    ("card", "cards"),
    ("egg", "eggs"),
    ("shell", "shells"),
)
# {name}, {a} (a counted noun: "1 apple", "12 apples"), {b} (a number), {objs} (the plural noun).
TEMPLATES: dict[str, tuple[str, ...]] = {
    "+": (
        "{name} has {a} and gets {b} more. How many {objs} does {name} have?",
        "{name} buys {a}, then buys {b} more. How many {objs} does {name} have now?",
        "A box holds {a}. {name} puts in {b} more. How many {objs} are in the box now?",
    ),
    "-": (
        "{name} has {a} and gives away {b}. How many {objs} does {name} have left?",
        "{name} had {a} and lost {b}. How many {objs} does {name} have now?",
        "A box holds {a}. {name} takes out {b}. How many {objs} are in the box now?",
    ),
}
TEMPLATES_PER_OP = len(TEMPLATES["+"])
assert all(len(t) == TEMPLATES_PER_OP for t in TEMPLATES.values()), "each operator needs as many templates"

# The pyarrow schema of both splits: nested columns as verl's preprocessing (HF datasets) writes them.
SCHEMA = pa.schema(
    [
        ("data_source", pa.string()),
        ("prompt", pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))),
        ("ability", pa.string()),
        ("reward_model", pa.struct([("style", pa.string()), ("ground_truth", pa.string())])),
        ("extra_info", pa.struct([("split", pa.string()), ("index", pa.int64()), ("question", pa.string())])),
        ("response", pa.string()),
    ]
)

# A problem before phrasing: (operator, a, b).
Combo = tuple[str, int, int]
# A phrased problem: (combo, template index, name index, object index).
Phrasing = tuple[Combo, int, int, int]


def _counted(n: int, obj: tuple[str, str]) -> str:
    return f"{n} {obj[0] if n == 1 else obj[1]}"


def phrase(p: Phrasing) -> str:
    """The question text of a phrased problem."""
    (op, a, b), t, n, o = p
    obj = OBJECTS[o]
    return TEMPLATES[op][t].format(name=NAMES[n], a=_counted(a, obj), b=b, objs=obj[1])


def _answer(combo: Combo) -> int:
    op, a, b = combo
    return a + b if op == "+" else a - b


def demonstration(combo: Combo, answer: int) -> str:
    """The SFT response for ``combo`` claiming ``answer``: ``"12 + 7 = 19\\n#### 19"``."""
    op, a, b = combo
    return f"{a} {op} {b} = {answer}\n#### {answer}"


def _wrong_answer(true: int, rng: random.Random, offset: int = 0) -> int:
    # Off by 1-3, the kind of slip a model makes (or by a fixed ``offset``: a systematic bias);
    # never negative (the task has no negative answers).
    delta = offset if offset else rng.choice((-3, -2, -1, 1, 2, 3))
    return true + delta if true + delta >= 0 else true - delta


def _check(cfg: TinyTaskConfig) -> None:
    if cfg.max_operand < 1:
        raise ValueError(f"tiny_task.max_operand must be >= 1, got {cfg.max_operand}")
    if cfg.num_train < 0 or cfg.num_test < 0:
        raise ValueError(f"tiny_task.num_train / num_test must be >= 0, got {cfg.num_train} / {cfg.num_test}")
    # correct_fraction: TinyTaskConfig.__post_init__.


def _sample_unique(
    combos: list[Combo], count: int, rng: random.Random, split: str, exclude: frozenset | set = frozenset()
) -> list[Phrasing]:
    """``count`` distinct phrasings of ``combos`` (none in ``exclude``), spread about evenly over the combos."""
    shapes = [
        (t, n, o) for t in range(TEMPLATES_PER_OP) for n in range(len(NAMES)) for o in range(len(OBJECTS))
    ]
    space = len(combos) * len(shapes) - len(exclude)
    if count > space:
        raise ValueError(
            f"tiny_task: the {split} split needs {count} distinct questions but only {space} exist for "
            f"max_operand and num_test as configured; raise tiny_task.max_operand or lower tiny_task.num_{split}"
        )
    if count > space // 2:
        # Dense: enumerate everything and sample, rejection would stall near the end.
        return rng.sample([p for c in combos for s in shapes if (p := (c, *s)) not in exclude], count)
    order = combos[:]
    rng.shuffle(order)
    out: list[Phrasing] = []
    seen: set[Phrasing] = set()
    i = 0
    while len(out) < count:
        # Cycle through the combos so each appears about equally often, with a random phrasing each time.
        p = (order[i % len(order)], *rng.choice(shapes))
        i += 1
        if p not in seen and p not in exclude:
            seen.add(p)
            out.append(p)
    return out


def _row(p: Phrasing, split: str, index: int, claimed: int) -> dict:
    combo = p[0]
    question = phrase(p)
    return {
        "data_source": DATA_SOURCE,
        "prompt": [{"role": "user", "content": f"{question} {INSTRUCTION}"}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": str(_answer(combo))},
        "extra_info": {"split": split, "index": index, "question": question},
        "response": demonstration(combo, claimed),
    }


def generate(cfg: TinyTaskConfig) -> tuple[list[dict], list[dict]]:
    """The (train, test) rows for ``cfg``; the same config always gives the same rows.

    Test problems are operand/operator combinations held out from train, so no question (and no
    phrasing of a test problem) appears in both splits.
    """
    _check(cfg)
    m = cfg.max_operand
    combos: list[Combo] = [
        (op, a, b) for op in "+-" for a in range(m + 1) for b in range(m + 1) if op == "+" or a >= b
    ]
    # Separate random streams per purpose (string seeds hash deterministically) so the test split does
    # not change when only num_train does.
    random.Random(f"tiny_arith/{cfg.seed}/split").shuffle(combos)
    if cfg.held_out == "problems":
        num_test_combos = min(cfg.num_test, len(combos) // 2)
        test_combos, train_combos = combos[:num_test_combos], combos[num_test_combos:]
    elif cfg.held_out == "questions":
        test_combos, train_combos = combos, combos
    else:
        raise ValueError(f"tiny_task.held_out must be 'problems' or 'questions', got {cfg.held_out!r}")

    test_rng = random.Random(f"tiny_arith/{cfg.seed}/test")
    test_phrasings = _sample_unique(test_combos, cfg.num_test, test_rng, "test")
    test = [_row(p, "test", i, _answer(p[0])) for i, p in enumerate(test_phrasings)]

    train_rng = random.Random(f"tiny_arith/{cfg.seed}/train")
    # With held_out="questions" the splits share combinations, never a question.
    test_questions = set(test_phrasings) if cfg.held_out == "questions" else set()
    phrasings = _sample_unique(train_combos, cfg.num_train, train_rng, "train", exclude=test_questions)
    # An exact count of wrong demonstrations (not a coin per row) so the fraction holds for small sets too.
    num_wrong = round((1.0 - cfg.correct_fraction) * cfg.num_train)
    wrong = set(train_rng.sample(range(cfg.num_train), num_wrong))
    train = []
    for i, p in enumerate(phrasings):
        true = _answer(p[0])
        claimed = _wrong_answer(true, train_rng, cfg.wrong_offset) if i in wrong else true
        train.append(_row(p, "train", i, claimed))
    return train, test


def config_hash(cfg: TinyTaskConfig) -> str:
    """A short hash of everything that determines the generated files."""
    key = json.dumps({"format": FORMAT_VERSION, **dataclasses.asdict(cfg)}, sort_keys=True)
    return hashlib.sha256(key.encode()).hexdigest()[:12]


def _write_atomic(rows: list[dict], path: Path) -> None:
    write_parquet_atomic(rows, path, SCHEMA)


def write_split_files(out_dir: Path, cfg: TinyTaskConfig) -> dict[str, Path]:
    """Generates and writes ``out_dir/train.parquet`` and ``out_dir/test.parquet`` (always rewrites)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {split: out_dir / f"{split}.parquet" for split in SPLITS}
    train, test = generate(cfg)
    _write_atomic(train, paths["train"])
    _write_atomic(test, paths["test"])
    return paths


def write_splits(out_dir: Path, cfg: TinyTaskConfig) -> dict[str, Path]:
    """The split files for ``cfg`` under ``out_dir/tiny_arith-<config hash>/``, written if missing.

    Safe to call from every rank at once: each file appears whole or not at all.
    """
    split_dir = Path(out_dir).expanduser() / f"tiny_arith-{config_hash(cfg)}"
    paths = {split: split_dir / f"{split}.parquet" for split in SPLITS}
    if all(p.is_file() for p in paths.values()):
        return paths
    return write_split_files(split_dir, cfg)


def resolve_data_files(
    files: list[str],
    cache_dir: Path,
    cfg: TinyTaskConfig,
    tools_cfg: ToolsTaskConfig | None = None,
    rgym_cfg: ReasoningGymConfig | None = None,
    shapes_cfg: tiny_shapes_task.TinyShapesConfig | None = None,
) -> list[Path]:
    """Maps ``"tiny:train"`` / ``"tiny:test"`` (and the tool task's ``"tiny_tools:train"`` /
    ``"tiny_tools:test"``, generated with ``tools_cfg``, default ``ToolsTaskConfig()``; a reasoning-gym
    task's ``"reasoning_gym:<task>:<split>"``, with ``rgym_cfg``; the visual task's ``"tiny_shapes:<split>"``,
    with ``shapes_cfg``) to generated files under ``cache_dir``;
    other paths pass through."""
    out: list[Path] = []
    for f in files:
        if f.startswith(tiny_shapes_task.PREFIX):
            out.append(
                tiny_shapes_task.resolve(f, cache_dir, shapes_cfg or tiny_shapes_task.TinyShapesConfig())
            )
        elif reasoning_gym_task.is_entry(f):
            out.append(reasoning_gym_task.resolve(f, cache_dir, rgym_cfg or ReasoningGymConfig()))
        elif f.startswith(tools_task.PREFIX):
            out.append(tools_task.resolve(f, cache_dir, tools_cfg or ToolsTaskConfig()))
        elif f.startswith("tiny:"):
            split = f.removeprefix("tiny:")
            if split not in SPLITS:
                raise ValueError(
                    f"data file {f!r}: the built-in tiny task has no split {split!r}; "
                    f"use one of {', '.join('tiny:' + s for s in SPLITS)} in data.train_files / data.val_files"
                )
            out.append(write_splits(cache_dir, cfg)[split])
        else:
            out.append(Path(f).expanduser())
    return out


def main(argv: list[str] | None = None) -> None:
    d = TinyTaskConfig()
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--out", type=Path, required=True, help="directory for train.parquet and test.parquet"
    )
    parser.add_argument("--num-train", type=int, default=d.num_train)
    parser.add_argument("--num-test", type=int, default=d.num_test)
    parser.add_argument("--max-operand", type=int, default=d.max_operand)
    parser.add_argument("--correct-fraction", type=float, default=d.correct_fraction)
    parser.add_argument("--seed", type=int, default=d.seed)
    args = parser.parse_args(argv)
    cfg = TinyTaskConfig(
        num_train=args.num_train,
        num_test=args.num_test,
        max_operand=args.max_operand,
        correct_fraction=args.correct_fraction,
        seed=args.seed,
    )
    for split, path in write_split_files(args.out.expanduser(), cfg).items():
        print(f"{split}: {path}")


if __name__ == "__main__":
    main()
