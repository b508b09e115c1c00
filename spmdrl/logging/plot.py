"""Learning-curve PNGs from metrics.jsonl (matplotlib, headless).

matplotlib is optional (the ``plot`` extra): without it no PNG is drawn, and the first call says so in
one line, with how to install it; the metrics themselves (metrics.jsonl, the backends) do not need it.
"""

from __future__ import annotations

import logging
from pathlib import Path

from spmdrl.logging.metrics import read_metrics

log = logging.getLogger(__name__)


# Whether the missing-matplotlib note was logged: once per process, not at every validation.
_noted_missing = False


def plot_curves(metrics_path: Path, out_png: Path, keys: list[str], title: str = "") -> bool:
    """One line per key (those present) against step, on one axis; values such as reward and accuracy share
    [0, 1]. Best effort: a plot is a convenience, so any failure is logged and training goes on.
    Returns whether the PNG was written."""
    global _noted_missing
    try:
        import matplotlib  # noqa: F401 - the optional dependency, imported where it is used
    except ImportError:
        if not _noted_missing:
            _noted_missing = True
            log.info(
                "no %s: matplotlib is not installed (pip install 'spmdrl[plot]', or pip install matplotlib); "
                "the metrics are in %s",
                out_png.name,
                metrics_path,
            )
        return False
    try:
        _plot(metrics_path, out_png, keys, title)
        return True
    except Exception as e:  # noqa: BLE001 - a missing font, a full disk, a broken matplotlib: never fatal
        log.warning("could not plot %s: %s: %s", out_png, type(e).__name__, e)
        return False


def _plot(metrics_path: Path, out_png: Path, keys: list[str], title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")  # no display on training nodes
    import matplotlib.pyplot as plt

    rows = read_metrics(metrics_path)
    fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
    for key in keys:
        pts = [(r["step"], r[key]) for r in rows if isinstance(r.get(key), int | float)]
        if pts:
            xs, ys = zip(*pts, strict=True)
            ax.plot(xs, ys, marker="o" if len(pts) < 30 else None, markersize=3, label=key)
    ax.set_xlabel("step")
    ax.grid(alpha=0.3)
    ax.legend(loc="best")
    if title:
        ax.set_title(title)
    fig.tight_layout()
    tmp = out_png.with_name(out_png.name + ".tmp.png")
    fig.savefig(tmp)
    plt.close(fig)
    tmp.replace(out_png)  # a viewer never sees a half-written image
