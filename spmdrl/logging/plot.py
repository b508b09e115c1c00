"""Learning-curve PNGs from metrics.jsonl (matplotlib, headless)."""

from __future__ import annotations

from pathlib import Path

from spmdrl.logging.metrics import read_metrics


def plot_curves(metrics_path: Path, out_png: Path, keys: list[str], title: str = "") -> None:
    """One line per key (those present) against step, on one axis; values such as reward and accuracy share [0, 1]."""
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
