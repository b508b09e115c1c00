"""spmdrl/logging/plot.py: the curves PNG with matplotlib, and one note and no PNG without it."""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

import pytest

from spmdrl.logging import plot


def _metrics(tmp_path: Path) -> Path:
    path = tmp_path / "metrics.jsonl"
    rows = [{"step": s, "reward/mean": s / 10, "actor/loss": 1 - s / 10} for s in range(1, 6)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_draws_the_png_with_matplotlib(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib", reason="the plot extra is not installed (pip install 'spmdrl[plot]')")
    out = tmp_path / "curves.png"
    assert plot.plot_curves(_metrics(tmp_path), out, ["reward/mean", "actor/loss"], title="t")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_without_matplotlib_one_note_and_no_png(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """matplotlib is installed here (CI installs the plot extra), so its absence is faked: a None entry in
    sys.modules makes ``import matplotlib`` raise ImportError, as it does where the package is missing."""
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setattr(plot, "_noted_missing", False)
    out = tmp_path / "curves.png"
    metrics = _metrics(tmp_path)
    with caplog.at_level(logging.INFO, logger=plot.__name__):
        assert not plot.plot_curves(metrics, out, ["reward/mean"])
        assert not plot.plot_curves(metrics, out, ["reward/mean"])  # a later validation: no second note
    assert not out.exists()
    notes = [r.getMessage() for r in caplog.records if r.name == plot.__name__]
    assert len(notes) == 1, notes
    assert "matplotlib is not installed" in notes[0] and "spmdrl[plot]" in notes[0]
    assert notes[0].startswith("no curves.png")
