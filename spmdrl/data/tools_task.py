"""The built-in tool task: multiplying multi-digit numbers, solvable with a calculator tool, in verl's schema.

The tiny model (:mod:`spmdrl.models.tiny`) cannot multiply a 3-4 digit number by another (the
default operand sizes): the product has 5-8 digits and most of them depend on all the operand digits. What it *can* learn is to
copy: the operands into a calculator call, the calculator's result into the answer. So held-out
accuracy measures whether the policy uses the tool, and a multi-turn rollout with the ``calculator``
tool is what makes the task solvable. The tool never sees the ground truth: it evaluates the
expression the model wrote and nothing else. Each row::

    prompt        [{"role": "user", "content": "What is 4821 * 193? Use the calculator or answer after ####."}]
    data_source   "tiny_tools"
    agent_name    "tool_agent"
    ability       "math"
    reward_model  {"style": "rule", "ground_truth": "930453"}
    extra_info    {"split": "train", "index": 0, "question": "What is 4821 * 193?", "expression": "4821 * 193",
                   "tools_kwargs": null}
    response      the SFT demonstration, a list of messages (below)

``tools_kwargs`` is null: the calculator takes no per-row arguments (verl's layout would be
``{"calculator": {"create_kwargs": {}}}``, which Parquet cannot store: a struct needs a field).

The SFT demonstration (``response``) is one of two kinds. A *tool* demonstration calls the
calculator, reads its result and copies it::

    [{"role": "assistant", "content": '<tool_call>\\n{"name": "calculator", "arguments": {"expression": "4821 * 193"}}\\n</tool_call>'},
     {"role": "tool", "content": "930453"},
     {"role": "assistant", "content": "#### 930453"}]

A *guess* answers at once with the product rounded to two significant digits (never the product
itself): ``[{"role": "assistant", "content": "#### 930000"}]``. Which kind a row gets depends on its
phrasing, so that a warm-started policy's choice is a function of the prompt (greedy decoding then
calls the tool on some prompts, not on all or none): the first ``tool_phrasings`` of the
:data:`PHRASINGS` get tool demonstrations with probability ``tool_fraction``, the others with
``other_tool_fraction``. A warm-started policy then calls the tool, greedily, on about
``tool_phrasings / len(PHRASINGS)`` of the prompts, and samples a call now and then on the others:
RL has something to reinforce, and held-out accuracy rises as the policy learns to call the tool
everywhere.

Test problems are operand pairs that never occur in train (in either order).

CLI: ``python -m spmdrl.data.tools_task --out DIR`` writes ``DIR/train.parquet`` and ``DIR/test.parquet``.
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

from spmdrl.config_section import register_config_section
from spmdrl.data.parquet import MESSAGES, verl_schema, write_parquet_atomic

DATA_SOURCE = "tiny_tools"
AGENT_NAME = "tool_agent"
TOOL_NAME = "calculator"
INSTRUCTION = "Use the calculator or answer after ####."
# Part of the cache key: bump it when the generated rows change for an unchanged config.
FORMAT_VERSION = 1
SPLITS = ("train", "test")
PREFIX = "tiny_tools:"


@register_config_section("tools_task")
@dataclass
class ToolsTaskConfig:
    """The tool task's settings, the config section ``tools_task`` (``tools_task.num_train=600``)."""

    num_train: int = 4000
    num_test: int = 120
    # Digits of each operand (the count uniform in [min_digits, max_digits], then the value).
    min_digits: int = 3
    max_digits: int = 4
    # SFT demonstrations call the calculator with probability tool_fraction on the first tool_phrasings
    # of the task's 6 phrasings and other_tool_fraction on the rest; the others answer with a wrong guess.
    tool_phrasings: int = 2
    tool_fraction: float = 0.9
    other_tool_fraction: float = 0.2
    seed: int = 1234


# {e} is the expression "a * b"; every phrasing contains it verbatim, so the call copies it as is.
PHRASINGS = (
    "What is {e}?",
    "Compute {e}.",
    "Calculate {e}.",
    "Find {e}.",
    "Work out {e}.",
    "How much is {e}?",
)

SCHEMA = verl_schema(
    [
        ("split", pa.string()),
        ("index", pa.int64()),
        ("question", pa.string()),
        ("expression", pa.string()),
        ("tools_kwargs", pa.null()),
    ],
    before_prompt=[("agent_name", pa.string())],
    trailing=[("response", MESSAGES)],
)

# A problem: (a, b, phrasing index).
Problem = tuple[int, int, int]


def expression(a: int, b: int) -> str:
    return f"{a} * {b}"


def question(p: Problem) -> str:
    a, b, t = p
    return PHRASINGS[t].format(e=expression(a, b))


def tool_call_text(expr: str) -> str:
    """The assistant turn that calls the calculator on ``expr`` (hermes format, as parse() reads it)."""
    call = json.dumps({"name": TOOL_NAME, "arguments": {"expression": expr}})
    return f"<tool_call>\n{call}\n</tool_call>"


def answer_text(value: int) -> str:
    return f"#### {value}"


def guess(product: int) -> int:
    """A wrong direct answer: ``product`` rounded to two significant digits, never ``product`` itself."""
    scale = 10 ** max(len(str(product)) - 2, 0)
    g = round(product / scale) * scale
    return g if g != product else product + scale


def tool_demonstration(a: int, b: int) -> list[dict[str, str]]:
    product = a * b
    return [
        {"role": "assistant", "content": tool_call_text(expression(a, b))},
        {"role": "tool", "content": str(product)},
        {"role": "assistant", "content": answer_text(product)},
    ]


def guess_demonstration(a: int, b: int) -> list[dict[str, str]]:
    return [{"role": "assistant", "content": answer_text(guess(a * b))}]


def _check(cfg: ToolsTaskConfig) -> None:
    if not 1 <= cfg.min_digits <= cfg.max_digits:
        raise ValueError(
            f"tools_task needs 1 <= min_digits <= max_digits, got {cfg.min_digits} and {cfg.max_digits}"
        )
    if cfg.num_train < 0 or cfg.num_test < 0:
        raise ValueError(
            f"tools_task.num_train / num_test must be >= 0, got {cfg.num_train} / {cfg.num_test}"
        )
    for key in ("tool_fraction", "other_tool_fraction"):
        if not 0.0 <= getattr(cfg, key) <= 1.0:
            raise ValueError(f"tools_task.{key} must be in [0, 1], got {getattr(cfg, key)}")
    if not 0 <= cfg.tool_phrasings <= len(PHRASINGS):
        raise ValueError(
            f"tools_task.tool_phrasings must be in [0, {len(PHRASINGS)}], got {cfg.tool_phrasings}"
        )
    per_operand = 10**cfg.max_digits - 10 ** (cfg.min_digits - 1)
    if cfg.num_train + cfg.num_test > per_operand * per_operand // 4:
        raise ValueError(
            f"tools_task: {cfg.num_train + cfg.num_test} distinct problems are too many for operands "
            f"of {cfg.min_digits}-{cfg.max_digits} digits; raise max_digits or lower num_train / num_test"
        )


def _operand(rng: random.Random, cfg: ToolsTaskConfig) -> int:
    # The digit count first, so short and long operands are equally common.
    digits = rng.randint(cfg.min_digits, cfg.max_digits)
    return rng.randint(10 ** (digits - 1) if digits > 1 else 0, 10**digits - 1)


def _pairs(rng: random.Random, cfg: ToolsTaskConfig, count: int, exclude: set[frozenset[int]]) -> list:
    """``count`` operand pairs, no two with the same operands (in either order), none in ``exclude``."""
    out: list[tuple[int, int]] = []
    seen = set(exclude)
    while len(out) < count:
        a, b = _operand(rng, cfg), _operand(rng, cfg)
        key = frozenset((a, b))
        if key not in seen:
            seen.add(key)
            out.append((a, b))
    return out


def _row(p: Problem, split: str, index: int, demo: list[dict[str, str]]) -> dict:
    a, b, _ = p
    q = question(p)
    return {
        "data_source": DATA_SOURCE,
        "agent_name": AGENT_NAME,
        "prompt": [{"role": "user", "content": f"{q} {INSTRUCTION}"}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": str(a * b)},
        "extra_info": {
            "split": split,
            "index": index,
            "question": q,
            "expression": expression(a, b),
            "tools_kwargs": None,
        },
        "response": demo,
    }


def generate(cfg: ToolsTaskConfig) -> tuple[list[dict], list[dict]]:
    """The (train, test) rows for ``cfg``; the same config always gives the same rows, and the test
    split does not depend on ``num_train`` or the demonstration settings."""
    _check(cfg)
    test_rng = random.Random(f"tiny_tools/{cfg.seed}/test")
    test_pairs = _pairs(test_rng, cfg, cfg.num_test, set())
    # Test rows spread evenly over the phrasings, so step-0 accuracy does not hinge on a few draws.
    test = [
        _row((a, b, i % len(PHRASINGS)), "test", i, tool_demonstration(a, b))
        for i, (a, b) in enumerate(test_pairs)
    ]

    train_rng = random.Random(f"tiny_tools/{cfg.seed}/train")
    train_pairs = _pairs(train_rng, cfg, cfg.num_train, {frozenset(p) for p in test_pairs})
    demo_rng = random.Random(f"tiny_tools/{cfg.seed}/demos")
    train = []
    for i, (a, b) in enumerate(train_pairs):
        t = i % len(PHRASINGS)
        share = cfg.tool_fraction if t < cfg.tool_phrasings else cfg.other_tool_fraction
        demo = tool_demonstration(a, b) if demo_rng.random() < share else guess_demonstration(a, b)
        train.append(_row((a, b, t), "train", i, demo))
    return train, test


def config_hash(cfg: ToolsTaskConfig) -> str:
    """A short hash of everything that determines the generated files."""
    key = json.dumps({"format": FORMAT_VERSION, **dataclasses.asdict(cfg)}, sort_keys=True)
    return hashlib.sha256(key.encode()).hexdigest()[:12]


def write_split_files(out_dir: Path, cfg: ToolsTaskConfig) -> dict[str, Path]:
    """Generates and writes ``out_dir/train.parquet`` and ``out_dir/test.parquet`` (always rewrites)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {split: out_dir / f"{split}.parquet" for split in SPLITS}
    train, test = generate(cfg)
    write_parquet_atomic(train, paths["train"], SCHEMA)
    write_parquet_atomic(test, paths["test"], SCHEMA)
    return paths


def write_splits(out_dir: Path, cfg: ToolsTaskConfig) -> dict[str, Path]:
    """The split files for ``cfg`` under ``out_dir/tiny_tools-<config hash>/``, written if missing.
    Safe to call from every rank at once: each file appears whole or not at all."""
    split_dir = Path(out_dir).expanduser() / f"tiny_tools-{config_hash(cfg)}"
    paths = {split: split_dir / f"{split}.parquet" for split in SPLITS}
    if all(p.is_file() for p in paths.values()):
        return paths
    return write_split_files(split_dir, cfg)


def resolve(name: str, cache_dir: Path, cfg: ToolsTaskConfig) -> Path:
    """The generated file of a ``"tiny_tools:<split>"`` name."""
    split = name.removeprefix(PREFIX)
    if split not in SPLITS:
        raise ValueError(
            f"data file {name!r}: the built-in tool task has no split {split!r}; "
            f"use one of {', '.join(PREFIX + s for s in SPLITS)} in data.train_files / data.val_files"
        )
    return write_splits(cache_dir, cfg)[split]


def main(argv: list[str] | None = None) -> None:
    d = ToolsTaskConfig()
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--out", type=Path, required=True, help="directory for train.parquet and test.parquet"
    )
    for f in dataclasses.fields(ToolsTaskConfig):
        default = getattr(d, f.name)
        parser.add_argument(f"--{f.name.replace('_', '-')}", type=type(default), default=default)
    args = parser.parse_args(argv)
    cfg = ToolsTaskConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(ToolsTaskConfig)})
    for split, path in write_split_files(args.out.expanduser(), cfg).items():
        print(f"{split}: {path}")


if __name__ == "__main__":
    main()
