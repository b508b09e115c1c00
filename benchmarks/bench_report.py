"""What every benchmark here writes with ``--json FILE``: one object per measured figure.

    {"benchmark": "<name>", <context: world size, device, ...>, "figures": [
        {"name": "...", "value": 1.23, "unit": "s", "baseline": 2.46, "ratio": 0.5}, ...]}

``baseline`` is the same figure for the benchmark's reference (the bare engine, TRL, one all-gather of
the same bytes...), measured in the same run on the same machine; ``ratio`` is ``value / baseline``, null
where there is no baseline (or it was skipped). Ratios travel between machines, absolute values do not.

Imported by the scripts next to it (``python benchmarks/x.py`` puts this folder on ``sys.path``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Figure:
    name: str
    value: float
    unit: str
    baseline: float | None = None

    @property
    def ratio(self) -> float | None:
        if self.baseline is None or self.baseline == 0:
            return None
        return self.value / self.baseline

    def as_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "value": self.value,
            "unit": self.unit,
            "baseline": self.baseline,
            "ratio": self.ratio,
        }


def write_json(path: str | Path, benchmark: str, figures: list[Figure], **context: Any) -> None:
    """``{"benchmark", **context, "figures": [...]}`` to ``path``, indented, ending in a newline."""
    doc = {"benchmark": benchmark, **context, "figures": [f.as_dict() for f in figures]}
    Path(path).write_text(json.dumps(doc, indent=2) + "\n")


def fmt_ratio(r: float | None) -> str:
    return "-" if r is None else f"{r:.2f}"
