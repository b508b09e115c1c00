"""Where rows come from: one entry of data.train_files / data.val_files resolved to a pyarrow Table.

An entry is one of

- a ``.parquet`` file (verl's files), a ``.jsonl`` file (one JSON object per line) or a ``.json`` file (a
  list of objects, or JSON lines): read with pyarrow and json, nothing else needed;
- a local directory: a ``datasets`` ``save_to_disk`` directory (a Dataset, or a DatasetDict whose split
  is taken), or a directory of data files in ``datasets``' folder layout (``train.jsonl``,
  ``data/test-00000.parquet``, ...);
- a Hugging Face hub dataset id (``org/name``), downloaded and cached by ``datasets``.

Directories and hub ids are read with the ``datasets`` library (the ``data`` extra), imported only then.
Their split is data.train_split / data.val_split and their config data.dataset_config, as TRL's
``dataset_train_split`` / ``dataset_test_split`` / ``dataset_config``; an entry may name its own:
``openai/gsm8k:test`` (split) or ``openai/gsm8k:main:test`` (config, split). data.columns renames the
source's columns to spmdrl's (``{prompt: question}``: spmdrl's ``prompt`` is the source's ``question``),
and ``ground_truth`` names a column of plain answers, which becomes verl's ``reward_model`` struct.

Every kind goes through the same checks: the columns a loader needs (errors name the entry, the columns it
has and the key to set), rows present, the same column types across entries. :func:`check_sources` is
the cheap view ``--check`` takes (a parquet file's footer; a hub dataset's metadata).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pyarrow as pa
import pyarrow.parquet as pq

from spmdrl import hub_probe
from spmdrl.data.parquet import DataError, ParquetSource, check_same_schema, combine_tables, missing_column

if TYPE_CHECKING:
    from spmdrl.data.config import DataConfig

FILE_KINDS = {".parquet": "parquet", ".jsonl": "json", ".ndjson": "json", ".json": "json"}
# A hub dataset id: org/name (letters, digits, - _ .), as the hub spells them.
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
INSTALL_HINT = "pip install 'spmdrl[data]'"


@dataclass(frozen=True)
class ReadOptions:
    """How one list of entries is read: its config key (for errors), split, config and column mapping."""

    key: str = "data.train_files / data.val_files"
    split: str = "train"
    config: str = ""
    # spmdrl's column name -> the source's (data.columns).
    columns: Mapping[str, str] = field(default_factory=dict)
    # The command that makes missing files (data.prepare), named in their error.
    prepare: str = ""


def read_options(data: DataConfig, key: str) -> ReadOptions:
    """The options of ``data.train_files`` or ``data.val_files`` (``key``)."""
    split = data.train_split if key == "data.train_files" else data.val_split
    return ReadOptions(
        key=key, split=split, config=data.dataset_config, columns=data.columns.mapping(), prepare=data.prepare
    )


@dataclass(frozen=True)
class Entry:
    """One resolved entry: ``kind`` is parquet, json, disk (save_to_disk), folder (data files) or hub."""

    text: str
    kind: str
    location: str
    config: str = ""
    split: str = ""
    # A hub dataset that cannot be had here: what to do instead ("": give a save_to_disk directory).
    instead: str = ""

    @property
    def label(self) -> str:
        """The entry as errors name it: the path, or the dataset with its config and split."""
        if self.kind in ("parquet", "json"):
            return self.location
        what = "hub dataset" if self.kind == "hub" else "dataset directory"
        about = [f"config {self.config}"] * bool(self.config) + [f"split {self.split}"] * bool(self.split)
        return f"{what} {self.location}" + (f" ({', '.join(about)})" if about else "")

    @property
    def named(self) -> str:
        """The entry as the start of an error: ``data file <path>``, or the dataset's label."""
        return f"data file {self.location}" if self.kind in ("parquet", "json") else self.label


@dataclass(frozen=True)
class SourceView:
    """What ``--check`` learns of an entry without reading its rows where it can: columns (spmdrl's names,
    after data.columns) and the row count."""

    entry: Entry
    columns: list[str]
    num_rows: int
    # A json file's rows, read whole to be viewed (the source's names): not parsed twice.
    table: pa.Table | None = field(default=None, repr=False, compare=False)

    @property
    def label(self) -> str:
        return self.entry.label


def resolve_entry(entry: str | os.PathLike[str], opts: ReadOptions) -> Entry:
    """What ``entry`` names (module docstring); a local path wins over a hub id of the same spelling."""
    text = os.fspath(entry)
    path = Path(text).expanduser()
    if path.exists():
        return _local(text, path, opts.config, opts.split)
    kind = FILE_KINDS.get(path.suffix.lower())
    if kind is not None:  # a data file that is not there
        raise DataError(f"data file {text} does not exist; {_missing_fix(opts)}")
    base, *parts = text.split(":")
    if parts and len(parts) <= 2 and all(parts):
        config, split = (parts[0], parts[1]) if len(parts) == 2 else (opts.config, parts[0])
        base_path = Path(base).expanduser()
        if base_path.exists():
            return _local(text, base_path, config, split)
        if _HUB_ID.match(base):
            return Entry(text, "hub", base, config, split)
    elif _HUB_ID.match(text):
        return Entry(text, "hub", text, opts.config, opts.split)
    raise DataError(
        f"{opts.key}: {text!r} is no local file or directory, nor a hub dataset id (org/name); "
        f"{_missing_fix(opts)}"
    )


def _missing_fix(opts: ReadOptions) -> str:
    if opts.prepare:
        return f"make it with: {opts.prepare}  (or fix {opts.key})"
    return f"check {opts.key}"


def _local(text: str, path: Path, config: str, split: str) -> Entry:
    if path.is_dir():
        saved = (path / "dataset_dict.json").is_file() or (path / "state.json").is_file()
        return Entry(text, "disk" if saved else "folder", str(path), config, split)
    return Entry(text, FILE_KINDS.get(path.suffix.lower(), "parquet"), str(path))


# ------------------------------------------------------------------------------------------ column mapping


def source_column(column: str, columns: Mapping[str, str]) -> str:
    """The source's name of spmdrl's ``column`` under data.columns."""
    if column == "reward_model" and "ground_truth" in columns:
        return columns["ground_truth"]
    return columns.get(column, column)


def _renames(columns: Mapping[str, str]) -> dict[str, str]:
    """The source's column -> the name spmdrl reads it as (ground_truth's is reward_model)."""
    return {theirs: ("reward_model" if ours == "ground_truth" else ours) for ours, theirs in columns.items()}


def mapped_names(have: Sequence[str], columns: Mapping[str, str]) -> list[str]:
    """The source's column names as spmdrl sees them after data.columns: a mapped column takes spmdrl's
    name, and a source column of that name is shadowed."""
    renamed = _renames(columns)
    targets = set(renamed.values())
    return list(dict.fromkeys(renamed.get(n, n) for n in have if n in renamed or n not in targets))


def _check_mapping(where: str, have: Sequence[str], columns: Mapping[str, str]) -> None:
    for ours, theirs in columns.items():
        if theirs not in have:
            raise DataError(
                f"{where} has no column {theirs!r} (it has: {', '.join(have)}); "
                f"set data.columns.{ours} to the column that holds {ours}"
            )


def _apply_mapping(table: pa.Table, columns: Mapping[str, str]) -> pa.Table:
    """``table`` (the source's names) with data.columns applied; ground_truth becomes a reward_model struct."""
    out: dict[str, pa.ChunkedArray] = {}
    renamed = _renames(columns)
    targets = set(renamed.values())
    for name, col in zip(table.column_names, table.columns, strict=True):
        if name not in renamed and name in targets:
            continue  # shadowed by a mapped column (as in mapped_names)
        if name == columns.get("ground_truth"):
            chunks = [pa.StructArray.from_arrays([c], names=["ground_truth"]) for c in col.chunks]
            col = pa.chunked_array(chunks, type=pa.struct([("ground_truth", col.type)]))
        out[renamed.get(name, name)] = col
    return pa.table(out)


# ------------------------------------------------------------------------------------------ reading


def _read_json(path: Path) -> pa.Table:
    """A JSON list of objects, or JSON lines; errors name the line."""
    text = path.read_text(encoding="utf-8")
    rows: list[Any]
    try:
        rows = json.loads(text)
        if isinstance(rows, dict):
            rows = [rows]
    except json.JSONDecodeError:
        rows = []
        for lineno, line in enumerate(text.splitlines(), start=1):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise DataError(
                    f"data file {path} line {lineno} is not valid JSON ({e}); a .jsonl file holds one JSON "
                    "object per line, a .json file a list of objects"
                ) from e
    if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
        raise DataError(f"data file {path} must hold JSON objects (a list of them, or one per line)")
    try:
        return pa.Table.from_pylist(rows)
    except (pa.ArrowException, TypeError, ValueError) as e:
        raise DataError(
            f"data file {path}: its rows do not share column types ({e}); give each key the same type "
            "in every row"
        ) from e


def _open_parquet(path: Path) -> pq.ParquetFile:
    try:
        return pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as e:
        raise DataError(
            f"data file {path} is not a readable parquet file ({e}); use a .parquet, .jsonl or .json file, "
            "a dataset directory or a hub dataset id, or fix the path"
        ) from e


def _datasets(*, quiet: bool = True) -> Any:
    """The datasets library; ``quiet``: without its progress bars (a bar per split and file, in every rank's
    log; a prep script's download keeps them)."""
    try:
        import datasets
    except ImportError as e:
        raise DataError(
            f"reading a dataset directory or a hub dataset id needs the `datasets` library: {INSTALL_HINT}"
        ) from e
    if quiet:
        datasets.disable_progress_bars()
    return datasets


def _load_dataset(entry: Entry) -> Any:
    """The entry's split as a ``datasets.Dataset`` (disk, folder, hub)."""
    datasets = _datasets()
    if entry.kind == "disk":
        try:
            loaded = datasets.load_from_disk(entry.location)
        except (OSError, ValueError) as e:
            raise DataError(f"{entry.label} could not be read ({e}); save it with save_to_disk") from e
        if isinstance(loaded, datasets.DatasetDict):
            return _split(entry, loaded)
        return loaded  # a single Dataset is its own split
    # All splits, then ours: datasets prepares them all anyway, and a missing split's error is ours.
    return _split(entry, _load_splits(entry))


def load_hub_dataset(dataset_id: str, config: str = "", *, instead: str = "") -> Any:
    """Every split of a hub dataset (a ``datasets.DatasetDict``), with a data entry's errors: an unreachable
    or offline hub says so at once, and ``instead`` what to do then. What the prep scripts download with."""
    return _load_splits(Entry(dataset_id, "hub", dataset_id, config, instead=instead), quiet=False)


def _load_splits(entry: Entry, *, quiet: bool = True) -> Any:
    """A folder's or hub dataset's splits (a ``datasets.DatasetDict``)."""
    datasets = _datasets(quiet=quiet)
    if entry.kind == "hub":
        _check_hub_reachable(entry)
    try:
        return datasets.load_dataset(entry.location, entry.config or None)
    except ConnectionError as e:  # offline (datasets reads HF_HUB_OFFLINE) and not cached
        raise DataError(_hub_unreachable(entry, e)) from e
    except Exception as e:  # datasets' own (DatasetNotFoundError, a bad config, ...), named in the message
        raise DataError(f"{entry.label} could not be loaded ({type(e).__name__}: {e})") from e


def _split(entry: Entry, loaded: Mapping[str, Any]) -> Any:
    if entry.split not in loaded:
        raise DataError(
            f"{entry.label}: no split {entry.split!r}; it has {', '.join(loaded)} (set data.train_split / "
            f"data.val_split, or write {entry.location}:<split>)"
        )
    return loaded[entry.split]


def _hub_offline() -> bool:
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)


def _hub_unreachable(entry: Entry, why: str | ConnectionError) -> str:
    """The error for a hub dataset that cannot be had here; ``why`` a reason, or datasets' ConnectionError."""
    if isinstance(why, ConnectionError):
        state = "the hub is set offline (HF_HUB_OFFLINE)" if _hub_offline() else "the hub did not answer"
        why = f"it is not in the datasets cache and {state} ({why})"
    instead = entry.instead or (
        "download it where the hub is reachable "
        f"(python -c \"import datasets; datasets.load_dataset('{entry.location}'"
        f"{', ' + repr(entry.config) if entry.config else ''}).save_to_disk('DIR')\") and give DIR instead "
        f"(no local file or directory is named {entry.location})"
    )
    return f"{entry.label} cannot be loaded: {why}; {instead}, or copy the datasets cache here and set HF_HUB_OFFLINE=1"


def _check_hub_reachable(entry: Entry) -> None:
    """Offline (HF_HUB_OFFLINE) datasets reads its cache, and says when the dataset is not there. Online, a
    hub that does not answer fails here in seconds, not after datasets' retries."""
    if _hub_offline() or hub_probe.behind_proxy():
        return
    from huggingface_hub import constants

    problem = hub_probe.unreachable(constants.ENDPOINT)
    if problem:
        raise DataError(_hub_unreachable(entry, f"the hub ({constants.ENDPOINT}) is unreachable ({problem})"))


def _dataset_table(ds: Any) -> pa.Table:
    return ds.with_format("arrow")[:]


def view_entry(entry: Entry, columns: Mapping[str, str]) -> SourceView:
    """The entry's columns (after data.columns) and rows: a parquet footer, a hub dataset's metadata where it
    lists the split's features and size (otherwise the dataset itself), or the data (json, directories)."""
    if entry.kind == "parquet":
        f = _open_parquet(Path(entry.location))
        have, rows = f.schema_arrow.names, f.metadata.num_rows
    elif entry.kind == "json":
        table = _read_json(Path(entry.location))
        _check_mapping(entry.named, table.column_names, columns)
        return SourceView(entry, mapped_names(table.column_names, columns), table.num_rows, table)
    else:
        have, rows = _hub_view(entry) if entry.kind == "hub" else (None, 0)
        if have is None:
            ds = _load_dataset(entry)
            have, rows = list(ds.column_names), ds.num_rows
    _check_mapping(entry.named, have, columns)
    return SourceView(entry, mapped_names(have, columns), rows)


def _hub_view(entry: Entry) -> tuple[list[str] | None, int]:
    """A hub dataset's features and split size from its metadata (no rows downloaded); (None, 0) where the
    metadata does not list them."""
    datasets = _datasets()
    _check_hub_reachable(entry)
    try:
        info = datasets.load_dataset_builder(entry.location, entry.config or None).info
    except ConnectionError as e:  # offline (datasets reads HF_HUB_OFFLINE) and not cached
        raise DataError(_hub_unreachable(entry, e)) from e
    except Exception as e:  # datasets' own (DatasetNotFoundError, a bad config), named in the message
        raise DataError(f"{entry.label} could not be loaded ({type(e).__name__}: {e})") from e
    splits = info.splits or {}
    if info.features is None or entry.split not in splits:
        return None, 0
    return list(info.features), int(splits[entry.split].num_examples)


def read_entry(view: SourceView, wanted: Sequence[str], columns: Mapping[str, str]) -> pa.Table:
    """The ``wanted`` columns (spmdrl's names) of the viewed entry's rows, data.columns applied."""
    entry = view.entry
    theirs = list(dict.fromkeys(source_column(c, columns) for c in wanted))
    mapping = {ours: t for ours, t in columns.items() if t in theirs}
    try:
        if entry.kind == "parquet":
            table = _open_parquet(Path(entry.location)).read(columns=theirs)
        elif entry.kind == "json":
            json_rows = view.table if view.table is not None else _read_json(Path(entry.location))
            table = json_rows.select(theirs)
        else:
            table = _dataset_table(_load_dataset(entry)).select(theirs)
    except (pa.ArrowException, OSError, KeyError) as e:
        raise DataError(f"{entry.named} could not be read ({e}); the file may be corrupt") from e
    return _apply_mapping(table, mapping)


# ------------------------------------------------------------------------------------------ the checks


def check_sources(
    entries: Sequence[str | os.PathLike[str]],
    columns: Sequence[str],
    column_keys: Mapping[str, str] | None = None,
    options: ReadOptions | None = None,
) -> list[SourceView]:
    """Each entry resolved and checked to exist, hold ``columns`` (spmdrl's names) and have rows, as
    cheaply as its kind allows; what :func:`read_sources` checks first and ``--check`` checks."""
    opts = options or ReadOptions()
    if not entries:
        raise DataError(f"no data files given; set {opts.key} to data files, directories or dataset ids")
    views = []
    for e in entries:
        entry = resolve_entry(e, opts)
        view = view_entry(entry, opts.columns)
        _check_columns(view, columns, column_keys or {})
        views.append(view)
    return views


def _check_columns(view: SourceView, columns: Sequence[str], column_keys: Mapping[str, str]) -> None:
    for column in columns:
        if column not in view.columns:
            raise missing_column(view.entry.named, column, view.columns, column_keys)
    if view.num_rows == 0:
        raise DataError(f"{view.entry.named} has no rows; remove it from the file list")


def read_sources(
    entries: Sequence[str | os.PathLike[str]],
    columns: Sequence[str],
    *,
    optional_columns: Sequence[str] = (),
    column_keys: Mapping[str, str] | None = None,
    options: ReadOptions | None = None,
) -> ParquetSource:
    """Reads ``columns`` (and any ``optional_columns`` that every entry has) of each entry, concatenated.

    ``column_keys`` maps a column to the config key that selects it, so that a missing column's error
    says which key to set (e.g. ``{"prompt": "data.prompt_key"}``).
    """
    opts = options or ReadOptions()
    views = check_sources(entries, columns, column_keys, opts)
    labels = [v.label for v in views]
    wanted = list(dict.fromkeys(columns))
    for column in optional_columns:
        if column in wanted:
            continue
        holders = [column in v.columns for v in views]
        if all(holders):
            wanted.append(column)
        elif any(holders):
            raise DataError(
                f"column {column!r} is in {labels[holders.index(True)]} but not in "
                f"{labels[holders.index(False)]}; give every file the same columns"
            )
    tables = []
    for view in views:
        table = read_entry(view, wanted, opts.columns)
        if table.num_rows == 0:
            raise DataError(f"{view.entry.named} has no rows; remove it from the file list")
        tables.append(table)
    check_same_schema(labels, tables)
    return combine_tables(labels, tables)
