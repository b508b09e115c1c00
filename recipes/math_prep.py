"""MATH (competition mathematics) -> ``train.parquet`` and ``test.parquet`` in verl's prompt schema.

    python -m spmdrl.recipes.math_prep --out ~/data/math                  # from the Hugging Face hub
    python -m spmdrl.recipes.math_prep --from-local DIR --out ~/data/math  # from a local copy

The hub path downloads ``DigitalLearningGmbH/MATH-lighteval`` and needs the ``datasets`` library
(``pip install 'spmdrl[data]'``). The local path reads either ``DIR/train.jsonl``
and ``DIR/test.jsonl`` (one ``{"problem": ..., "solution": ...}`` object per line, ``level`` and
``type`` optional) or the original release's layout, ``DIR/{train,test}/<subject>/<n>.json``.

Each row is what verl's MATH preprocessing writes, so ``reward.fn=auto`` scores it with the math rule
(spmdrl/rewards/math_answers.py; install the ``math`` extra)::

    data_source   "DigitalLearningGmbH/MATH-lighteval"
    prompt        [{"role": "user", "content": "<problem> Let's think step by step and output ... \\boxed{}."}]
    ability       "math"
    reward_model  {"style": "rule", "ground_truth": "\\frac{1}{2}"}   (what the solution's last \\boxed{} holds)
    extra_info    {"split": "train", "index": 0, "level": "Level 3", "type": "Algebra"}
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from spmdrl.data.parquet import DataError, verl_schema, write_splits
from spmdrl.data.sources import load_hub_dataset

DATA_SOURCE = "DigitalLearningGmbH/MATH-lighteval"
HUB_CONFIG = "default"
SPLITS = ("train", "test")
DEFAULT_OUT = "~/data/math"
# Appended to every problem, as verl does: the reward reads the last \boxed{} of the response.
INSTRUCTION = "Let's think step by step and output the final answer within \\boxed{}."
_BOX_COMMANDS = ("\\boxed", "\\fbox")

SCHEMA = verl_schema(
    [("split", pa.string()), ("index", pa.int64()), ("level", pa.string()), ("type", pa.string())]
)


class MathFormatError(ValueError):
    """A MATH row or file is malformed; the message names the file or split, the row and the fix."""


class MissingDependencyError(RuntimeError):
    """The hub download needs a library that is not installed; the message says what to install."""


def last_boxed(solution: str) -> str | None:
    """What the last ``\\boxed{...}`` (or ``\\fbox{...}``) of ``solution`` holds, braces matched, or None.
    ``\\boxed 5`` (no braces, a form some solutions use) gives the token after the space."""
    start = max(solution.rfind(cmd) for cmd in _BOX_COMMANDS)
    if start < 0:
        return None
    rest = solution[start:].split("{", 1)[0]
    cmd = next(c for c in _BOX_COMMANDS if rest.startswith(c))
    after = solution[start + len(cmd) :]
    if after.startswith(" "):
        token = after[1:].split("$", 1)[0].strip()
        return token or None
    if not after.startswith("{"):
        return None
    depth = 0
    for i, ch in enumerate(after):
        depth += {"{": 1, "}": -1}.get(ch, 0)
        if depth == 0:
            return after[1:i]
    return None  # the braces never close


def convert(rows: Iterable[dict[str, Any]], split: str, *, source: str = DATA_SOURCE) -> list[dict[str, Any]]:
    """MATH ``{"problem", "solution"[, "level", "type"]}`` rows -> verl-schema rows (module docstring).

    Raises :class:`MathFormatError` for a row without string ``problem`` and ``solution`` fields, or whose
    solution has no ``\\boxed{...}`` answer.
    """
    out = []
    for index, row in enumerate(rows):
        where = f"{source} ({split} split) row {index}"
        if not isinstance(row, dict) or not all(isinstance(row.get(k), str) for k in ("problem", "solution")):
            have = ", ".join(sorted(map(str, row))) if isinstance(row, dict) else type(row).__name__
            raise MathFormatError(
                f"{where}: expected an object with string 'problem' and 'solution' fields, got {have}; "
                'MATH rows look like {"problem": "...", "solution": "... \\\\boxed{42}."}'
            )
        truth = last_boxed(row["solution"])
        if truth is None:
            raise MathFormatError(
                f"{where}: the solution has no final \\boxed{{...}} answer (it ends {row['solution'][-60:]!r}); "
                "MATH solutions put the answer in \\boxed{}: fix or drop this row"
            )
        out.append(
            {
                "data_source": DATA_SOURCE,
                "prompt": [{"role": "user", "content": f"{row['problem']} {INSTRUCTION}"}],
                "ability": "math",
                "reward_model": {"style": "rule", "ground_truth": truth},
                "extra_info": {
                    "split": split,
                    "index": index,
                    "level": str(row.get("level", "")),
                    "type": str(row.get("type", "")),
                },
            }
        )
    if not out:
        raise MathFormatError(f"{source} ({split} split) has no rows")
    return out


def _read_json(path: Path) -> Any:
    text = path.read_text(encoding="utf-8")
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise MathFormatError(f"{path}: not valid JSON ({e})") from e


def read_split(directory: Path, split: str) -> tuple[list[dict[str, Any]], str]:
    """The rows of one split of a local copy, and where they came from (for messages)."""
    jsonl, tree = directory / f"{split}.jsonl", directory / split
    if jsonl.is_file():
        rows = []
        for lineno, line in enumerate(jsonl.read_text(encoding="utf-8").splitlines(), start=1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise MathFormatError(f"{jsonl} line {lineno}: not valid JSON ({e})") from e
        return rows, str(jsonl)
    if tree.is_dir():
        files = sorted(tree.glob("*/*.json"))
        if files:
            return [_read_json(f) for f in files], str(tree)
    raise MathFormatError(
        f"{directory} has neither {split}.jsonl nor {split}/<subject>/<n>.json; --from-local DIR needs "
        "DIR/train.jsonl and DIR/test.jsonl, or the MATH release's train/ and test/ folders"
    )


def load_from_hub() -> dict[str, list[dict[str, Any]]]:
    """The train and test splits of MATH-lighteval, downloaded with ``datasets``."""
    try:
        # Only this path needs it (an extra, data); tried here so that its error names the local copy.
        import datasets  # noqa: F401
    except ImportError as e:
        raise MissingDependencyError(
            "downloading MATH needs the `datasets` library: pip install 'spmdrl[data]'  "
            "(or convert a local copy: --from-local DIR)"
        ) from e
    # An unreachable hub says so at once.
    dd = load_hub_dataset(DATA_SOURCE, HUB_CONFIG, instead="convert a local copy instead (--from-local DIR)")
    return {split: list(dd[split]) for split in SPLITS}


def prepare(out_dir: Path, from_local: Path | None = None) -> dict[str, Path]:
    """Converts both splits (all rows checked first), then writes ``out_dir/{train,test}.parquet``."""
    if from_local is not None:
        read = {split: read_split(from_local, split) for split in SPLITS}
        raw, sources = {s: r for s, (r, _) in read.items()}, {s: w for s, (_, w) in read.items()}
    else:
        raw, sources = load_from_hub(), {s: DATA_SOURCE for s in SPLITS}
    converted = {split: convert(raw[split], split, source=sources[split]) for split in SPLITS}
    return write_splits(converted, out_dir, SCHEMA)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--out", type=Path, default=Path(DEFAULT_OUT), help=f"output directory (default {DEFAULT_OUT})"
    )
    parser.add_argument(
        "--from-local",
        type=Path,
        metavar="DIR",
        help="convert DIR/{train,test}.jsonl or DIR/{train,test}/<subject>/<n>.json instead of downloading",
    )
    args = parser.parse_args(argv)
    try:
        paths = prepare(args.out.expanduser(), args.from_local.expanduser() if args.from_local else None)
    except (MathFormatError, MissingDependencyError, DataError) as e:
        print(f"math_prep: error: {e}", file=sys.stderr)
        sys.exit(2)
    for split, path in paths.items():
        print(f"{split}: {pq.ParquetFile(path).metadata.num_rows} rows -> {path}")


if __name__ == "__main__":
    main()
