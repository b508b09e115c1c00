"""benchmarks/optimizer_step.py runs as its docstring says and reports each of the job's paths (the shards')
against the DTensor path of the same run: three figures, each with the DTensor path's time as baseline.
No timing is asserted (speed lives in the benchmark's output, not in tests)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from spmdrl.testing.spawn import free_port

REPO = Path(__file__).resolve().parents[2]


def test_reports_the_shards_against_the_dtensor_path(tmp_path: Path) -> None:
    out = tmp_path / "opt.json"
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, str(REPO / "benchmarks" / "optimizer_step.py"), "--steps=1", f"--json={out}"]
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert doc["device"] == "cpu" and doc["tensors"] == 24 * 12 + 2
    figs = {f["name"]: f for f in doc["figures"]}
    assert set(figs) == {f"optimizer_step/{n}" for n in ("adamw_fused", "adamw_foreach", "clip")}
    for f in figs.values():
        assert f["value"] > 0 and f["baseline"] > 0
        assert f["ratio"] == pytest.approx(f["value"] / f["baseline"])
    assert "shards/DTensor" in proc.stdout
