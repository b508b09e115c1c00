"""verl's schema: its cells checked and converted, with errors that say which file, row and config key.

verl's prompt files have the columns ``prompt`` (a list of ``{"role", "content"}`` messages),
``data_source``, ``reward_model`` (a struct with ``ground_truth``) and ``extra_info``. Files made by
verl's preprocessing scripts load here unchanged. Which files and datasets are read, and how, is
spmdrl.data.sources (parquet, jsonl, json, dataset directories, hub datasets).
"""

from __future__ import annotations

import bisect
import json
import os
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq


class DataError(ValueError):
    """A data file or cell is wrong. The message names the file (and row, column) and how to fix it."""


@dataclass(frozen=True)
class ParquetSource:
    """Rows of several parquet files concatenated, remembering which file and row each came from."""

    table: pa.Table
    # The files (or, for datasets, their labels: spmdrl.data.sources.Entry.label).
    paths: list[Path] | list[str]
    # row_offsets[k] is the first global row of paths[k]; used only to word error messages.
    row_offsets: list[int]

    def where(self, row: int) -> str:
        """``"<file> row <n>"`` for a global row index (n counts from 0 within that file)."""
        k = bisect.bisect_right(self.row_offsets, row) - 1
        return f"{self.paths[k]} row {row - self.row_offsets[k]}"


def missing_column(where: str, column: str, have: Sequence[str], column_keys: Mapping[str, str]) -> DataError:
    """``where`` (``"data file <path>"``, or a dataset's label) lacks ``column``; the fix names the key
    that selects it (``column_keys``), or data.columns."""
    if column in column_keys:
        fix = f"set {column_keys[column]} to the column that holds it"
    elif column == "reward_model":
        fix = (
            "verl's schema needs this column, a struct {ground_truth: ...} (see spmdrl/data/parquet.py); "
            "or set data.columns.ground_truth to a column of plain answers"
        )
    else:
        fix = f"set data.columns.{column} to the column that holds it"
    return DataError(f"{where} has no column {column!r} (it has: {', '.join(have)}); {fix}")


def read_source(
    paths: Sequence[str | os.PathLike[str]],
    columns: Sequence[str],
    *,
    optional_columns: Sequence[str] = (),
    column_keys: Mapping[str, str] | None = None,
) -> ParquetSource:
    """Reads ``columns`` (and any ``optional_columns`` that every file has) from each file, concatenated.

    ``column_keys`` maps a column to the config key that selects it, so that a missing column's error
    says which key to set (e.g. ``{"prompt": "data.prompt_key"}``). Any entry spmdrl.data.sources reads
    (jsonl, json, dataset directories, hub ids) is accepted too: :func:`spmdrl.data.sources.read_sources`.
    """
    from spmdrl.data.sources import read_sources  # it builds on this module

    return read_sources(paths, columns, optional_columns=optional_columns, column_keys=column_keys)


def combine_tables(labels: Sequence[str], tables: Sequence[pa.Table]) -> ParquetSource:
    """The tables concatenated, remembering which entry each row came from (``labels``, for errors)."""
    try:
        # "permissive" unifies harmless differences (a struct that gained a field, an all-null column).
        table = pa.concat_tables(tables, promote_options="permissive")
    except (pa.ArrowException, TypeError) as e:
        raise DataError(f"data files {', '.join(labels)} could not be combined: {e}") from e
    offsets = [0]
    for t in tables[:-1]:
        offsets.append(offsets[-1] + t.num_rows)
    return ParquetSource(table=table, paths=list(labels), row_offsets=offsets)


def _kind(t: pa.DataType) -> str:
    """A coarse type class; files that differ in it cannot be mixed (a list prompt vs a string prompt)."""
    if pa.types.is_string(t) or pa.types.is_large_string(t):
        return "string"
    if pa.types.is_list(t) or pa.types.is_large_list(t):
        return "list"
    if pa.types.is_struct(t):
        return "struct"
    if pa.types.is_null(t):
        return "null"
    if pa.types.is_integer(t) or pa.types.is_floating(t):
        return "number"
    return str(t)


def check_same_schema(paths: Sequence[str | Path], tables: Sequence[pa.Table]) -> None:
    first = tables[0].schema
    for path, table in zip(paths[1:], tables[1:], strict=True):
        for field in table.schema:
            ref = first.field(field.name).type
            a, b = _kind(ref), _kind(field.type)
            if a != b and "null" not in (a, b):
                raise DataError(
                    f"column {field.name!r} is {ref} in {paths[0]} but {field.type} in {path}; "
                    "files read together must have the same column types"
                )


def read_table(paths: Sequence[str | os.PathLike[str]], columns: Sequence[str]) -> pa.Table:
    """The given columns of all files, concatenated (see :func:`read_source` for the checks)."""
    return read_source(paths, columns).table


def to_messages(cell: Any, *, where: str, column: str, key: str) -> list[dict[str, str]]:
    """A prompt cell as chat messages: a list of ``{"role", "content"}`` dicts, or a plain string.

    A plain string becomes one user message. Keys other than role and content are dropped.
    ``where`` is ``"<file> row <n>"``; ``key`` is the config key that selected ``column``, for errors.
    """
    if isinstance(cell, str):
        return [{"role": "user", "content": cell}]
    if not isinstance(cell, list) or not cell:
        raise DataError(
            f"{where}: column {column!r} must be a non-empty list of {{'role', 'content'}} messages or a "
            f"string, got {_describe(cell)}; point {key} at the right column or fix the data"
        )
    messages = []
    for j, m in enumerate(cell):
        if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
            raise DataError(
                f"{where}: column {column!r}, message {j} must be a dict with string 'role' and "
                f"'content', got {_describe(m)}"
            )
        messages.append({"role": m["role"], "content": m["content"]})
    return messages


def to_ground_truth(cell: Any, *, where: str) -> str:
    """``reward_model.ground_truth`` as a string: numbers via ``str``, lists and dicts as JSON."""
    if not isinstance(cell, dict) or cell.get("ground_truth") is None:
        raise DataError(
            f"{where}: column reward_model must be a struct with a 'ground_truth' field (verl's schema: "
            f"{{'ground_truth': ..., 'style': 'rule'}}), got {_describe(cell)}"
        )
    truth = cell["ground_truth"]
    if isinstance(truth, str):
        return truth
    if isinstance(truth, int | float | bool):
        return str(truth)
    # A reward function that expects a list (several accepted answers) can json.loads it back.
    return json.dumps(truth)


def to_extra_info(cell: Any, *, where: str) -> dict[str, Any]:
    if cell is None:
        return {}
    if not isinstance(cell, dict):
        raise DataError(f"{where}: column extra_info must be a struct (dict) or null, got {_describe(cell)}")
    return cell


def _describe(value: Any) -> str:
    text = repr(value)
    if len(text) > 80:
        text = text[:77] + "..."
    return f"{type(value).__name__} {text}"


# verl's row layout, the one every data writer here produces: chat messages, images as bytes or paths.
MESSAGES = pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))
IMAGES = pa.list_(pa.struct([("bytes", pa.binary()), ("path", pa.string())]))


def verl_schema(
    extra_info: Sequence[tuple[str, pa.DataType]],
    *,
    before_prompt: Sequence[tuple[str, pa.DataType]] = (),
    after_prompt: Sequence[tuple[str, pa.DataType]] = (),
    trailing: Sequence[tuple[str, pa.DataType]] = (),
) -> pa.Schema:
    """verl's parquet schema (data_source, prompt, ability, reward_model, extra_info) with a writer's own
    ``extra_info`` fields and extra columns where it puts them. Written explicitly, not inferred, so that
    every file has the same column types whatever its rows."""
    return pa.schema(
        [
            ("data_source", pa.string()),
            *before_prompt,
            ("prompt", MESSAGES),
            *after_prompt,
            ("ability", pa.string()),
            ("reward_model", pa.struct([("style", pa.string()), ("ground_truth", pa.string())])),
            ("extra_info", pa.struct(list(extra_info))),
            *trailing,
        ]
    )


def write_parquet_atomic(rows: list[dict], path: Path, schema: pa.Schema) -> None:
    """Writes ``rows`` to ``path`` whole or not at all: a temp file in the same directory, then a rename.

    Concurrent writers (one per rank) each replace the file whole, and a reader never sees a
    half-written one.
    """
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        pq.write_table(pa.Table.from_pylist(rows, schema=schema), tmp)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_splits(splits: Mapping[str, list[dict]], out_dir: Path, schema: pa.Schema) -> dict[str, Path]:
    """Each split's rows to ``out_dir/<split>.parquet`` (atomically, :func:`write_parquet_atomic`); the paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {split: out_dir / f"{split}.parquet" for split in splits}
    for split, rows in splits.items():
        write_parquet_atomic(rows, paths[split], schema)
    return paths
