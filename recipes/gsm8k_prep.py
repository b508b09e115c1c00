"""GSM8K -> ``train.parquet`` and ``test.parquet`` in verl's prompt schema, for ``recipe=grpo_gsm8k``.

    python -m spmdrl.recipes.gsm8k_prep --out ~/data/gsm8k                    # from the Hugging Face hub
    python -m spmdrl.recipes.gsm8k_prep --from-jsonl DIR --out ~/data/gsm8k   # from a local copy

The hub path needs the ``datasets`` library (the ``data`` extra: ``pip install 'spmdrl[data]'``). The
offline path reads ``DIR/train.jsonl`` and ``DIR/test.jsonl``, one
``{"question": ..., "answer": ...}`` object per line: the files of the GSM8K GitHub release.

Each row is what verl's GSM8K preprocessing writes, so runs on these files compare with verl's::

    data_source   "openai/gsm8k"
    prompt        [{"role": "user", "content": "<question> Let's think step by step and output ..."}]
    ability       "math"
    reward_model  {"style": "rule", "ground_truth": "1200"}     (the number after ####, commas removed)
    extra_info    {"split": "train", "index": 0, "answer": "<full solution>", "question": "<question>"}
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from spmdrl.data.parquet import DataError, verl_schema, write_splits
from spmdrl.data.sources import load_hub_dataset

DATA_SOURCE = "openai/gsm8k"
HUB_CONFIG = "main"
SPLITS = ("train", "test")
# Where recipe=grpo_gsm8k looks for the files (configs/recipe/grpo_gsm8k.yaml).
DEFAULT_OUT = "~/data/gsm8k"
# Appended to every question, as verl does: the reward only reads the number after "#### ".
INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'
# verl's extraction: the first "#### " followed by a number-like run (sign, digits, dots, commas).
_FINAL_ANSWER_RE = re.compile(r"#### (-?[0-9.,]+)")

# Written explicitly (not inferred) so that every file has the same column types, whatever its rows.
SCHEMA = verl_schema(
    [("split", pa.string()), ("index", pa.int64()), ("answer", pa.string()), ("question", pa.string())]
)


class GSM8KFormatError(ValueError):
    """A GSM8K row or file is malformed; the message names the file or split, the row and the fix."""


class MissingDependencyError(RuntimeError):
    """The hub download needs a library that is not installed; the message says what to install."""


def final_answer(answer: str) -> str | None:
    """The number after ``#### `` in a GSM8K solution, commas removed (``"1,200"`` -> ``"1200"``)."""
    match = _FINAL_ANSWER_RE.search(answer)
    return match.group(1).replace(",", "") if match else None


def _short(text: str, limit: int = 60) -> str:
    return repr(text if len(text) <= limit else text[: limit - 3] + "...")


def convert(rows: Iterable[dict[str, Any]], split: str, *, source: str = DATA_SOURCE) -> list[dict[str, Any]]:
    """GSM8K ``{"question", "answer"}`` rows -> verl-schema rows (see the module docstring).

    ``source`` names where the rows came from (a file path, or the hub dataset) in error messages.
    Raises :class:`GSM8KFormatError` for a row that is not a dict with string ``question`` and
    ``answer`` fields, or whose answer has no ``#### <number>``.
    """
    out = []
    for index, row in enumerate(rows):
        where = f"{source} ({split} split) row {index}"
        if not isinstance(row, dict):
            raise GSM8KFormatError(
                f"{where}: expected an object with 'question' and 'answer', got {row!r:.80}"
            )
        for key in ("question", "answer"):
            if not isinstance(row.get(key), str):
                have = ", ".join(sorted(map(str, row))) or "none"
                raise GSM8KFormatError(
                    f"{where}: field {key!r} must be a string, got {row.get(key)!r:.60} (fields: {have}); "
                    'GSM8K rows look like {"question": "...", "answer": "... #### 42"}'
                )
        question, answer = row["question"], row["answer"]
        truth = final_answer(answer)
        if truth is None:
            raise GSM8KFormatError(
                f"{where}: the answer has no final '#### <number>' (question {_short(question)}, answer ends "
                f"{_short(answer[-60:])}); GSM8K solutions end with a line like '#### 42': fix or drop this row"
            )
        out.append(
            {
                "data_source": DATA_SOURCE,
                "prompt": [{"role": "user", "content": f"{question} {INSTRUCTION}"}],
                "ability": "math",
                "reward_model": {"style": "rule", "ground_truth": truth},
                "extra_info": {"split": split, "index": index, "answer": answer, "question": question},
            }
        )
    if not out:
        raise GSM8KFormatError(f"{source} ({split} split) has no rows")
    return out


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """One JSON object per line; blank lines are skipped. Errors name the file and line."""
    if not path.is_file():
        raise GSM8KFormatError(
            f"{path} does not exist; --from-jsonl DIR needs DIR/train.jsonl and DIR/test.jsonl "
            "(the files of the GSM8K GitHub release)"
        )
    rows = []
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise GSM8KFormatError(f"{path} line {lineno}: not valid JSON ({e})") from e
    return rows


def load_from_hub() -> dict[str, list[dict[str, Any]]]:
    """The train and test splits of ``openai/gsm8k`` (config ``main``), downloaded with ``datasets``."""
    try:
        # Only this path needs it (an extra, data); tried here so that its error names the local copy.
        import datasets  # noqa: F401
    except ImportError as e:
        raise MissingDependencyError(
            "downloading GSM8K needs the `datasets` library: pip install 'spmdrl[data]'  "
            "(or convert a local copy: --from-jsonl DIR)"
        ) from e
    # An unreachable hub says so at once.
    dd = load_hub_dataset(DATA_SOURCE, HUB_CONFIG, instead="convert a local copy instead (--from-jsonl DIR)")
    return {split: list(dd[split]) for split in SPLITS}


def load_from_jsonl(directory: Path) -> dict[str, list[dict[str, Any]]]:
    return {split: read_jsonl(directory / f"{split}.jsonl") for split in SPLITS}


def prepare(out_dir: Path, from_jsonl: Path | None = None) -> dict[str, Path]:
    """Converts both splits (all rows checked first), then writes ``out_dir/{train,test}.parquet``."""
    if from_jsonl is not None:
        raw, sources = load_from_jsonl(from_jsonl), {s: str(from_jsonl / f"{s}.jsonl") for s in SPLITS}
    else:
        raw, sources = load_from_hub(), {s: DATA_SOURCE for s in SPLITS}
    converted = {split: convert(raw[split], split, source=sources[split]) for split in SPLITS}
    return write_splits(converted, out_dir, SCHEMA)  # each whole or not at all


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--out",
        type=Path,
        default=Path(DEFAULT_OUT),
        help=f"directory for train.parquet and test.parquet (default {DEFAULT_OUT}, where recipe=grpo_gsm8k looks)",
    )
    parser.add_argument(
        "--from-jsonl",
        type=Path,
        metavar="DIR",
        help="convert DIR/train.jsonl and DIR/test.jsonl instead of downloading from the hub",
    )
    args = parser.parse_args(argv)
    from_jsonl = args.from_jsonl.expanduser() if args.from_jsonl is not None else None
    try:
        paths = prepare(args.out.expanduser(), from_jsonl)
    except (GSM8KFormatError, MissingDependencyError, DataError) as e:
        print(f"gsm8k_prep: error: {e}", file=sys.stderr)
        sys.exit(2)
    for split, path in paths.items():
        print(f"{split}: {pq.ParquetFile(path).metadata.num_rows} rows -> {path}")


if __name__ == "__main__":
    main()
