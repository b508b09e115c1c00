"""The ``console`` metrics backend: the step's metrics as a table in the log, grouped by namespace."""

from __future__ import annotations

import math


def format_table(step: int, metrics: dict[str, float], header: str = "") -> str:
    """``header`` (``step N`` by default) then one row per key, sorted, keys aligned; a blank line between
    namespaces (``actor/``, ``rollout/``, ...) so a long step reads in blocks."""
    header = header or f"step {step}"
    if not metrics:
        return f"{header}: no metrics"
    width = max(len(k) for k in metrics)
    lines = [header]
    previous = None
    for key in sorted(metrics):
        namespace = key.split("/", 1)[0]
        if previous is not None and namespace != previous:
            lines.append("")
        previous = namespace
        lines.append(f"  {key:<{width}}  {_fmt(metrics[key])}")
    return "\n".join(lines)


def _fmt(v: float) -> str:
    if not math.isfinite(v):
        return str(v)
    return f"{v:.6g}"
