"""Sample completions with their rewards, one JSON object per line (samples.jsonl), rank 0 only; where
logging.backends has wandb or mlflow, also a table per step and split (spmdrl/logging/trackers.py)."""

from __future__ import annotations

import json
from dataclasses import asdict, astuple, dataclass, fields
from pathlib import Path


@dataclass(frozen=True)
class Sample:
    step: int
    split: str  # "train" or "val"
    prompt: str
    response: str
    ground_truth: str
    reward: float
    data_source: str


# A table's columns: Sample's fields, in order.
COLUMNS = tuple(f.name for f in fields(Sample))


def write_samples(path: Path, samples: list[Sample]) -> None:
    with open(path, "a") as f:
        for s in samples:
            f.write(json.dumps(asdict(s)) + "\n")


def sample_tables(samples: list[Sample]) -> dict[tuple[int, str], list[list[object]]]:
    """The samples as table rows (in :data:`COLUMNS` order), by (step, key): key "<split>/samples" (e.g.
    "val/samples"), the name a tracker shows them under."""
    tables: dict[tuple[int, str], list[list[object]]] = {}
    for s in samples:
        tables.setdefault((s.step, f"{s.split}/samples"), []).append(list(astuple(s)))
    return tables
