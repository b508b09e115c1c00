"""Sample completions with their rewards, one JSON object per line (samples.jsonl), rank 0 only."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
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


def write_samples(path: Path, samples: list[Sample]) -> None:
    with open(path, "a") as f:
        for s in samples:
            f.write(json.dumps(asdict(s)) + "\n")
