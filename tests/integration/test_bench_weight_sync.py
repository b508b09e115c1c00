"""benchmarks/weight_sync.py's floor: the baseline every row is divided by is the cost of moving the same
bytes once. On one rank that is one device copy (the one-rank all-gather moves nothing); on several, one
all-gather. The gathers only (``--no-engine``), on gloo ranks, so it runs in seconds."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from spmdrl.testing.spawn import free_port

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    ("nproc", "floor_row", "floor_name"),
    [
        (1, "one_device_copy_whole_model", "one device copy of the whole model's bytes"),
        (2, "one_all_gather_whole_model", "one all_gather of the whole model's bytes"),
    ],
)
def test_rows_are_measured_against_the_floor_of_moving_the_bytes(
    tmp_path: Path, nproc: int, floor_row: str, floor_name: str
) -> None:
    out = tmp_path / "sync.json"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc_per_node={nproc}",
        f"--master_port={free_port()}",
        str(REPO / "benchmarks" / "weight_sync.py"),
        "--no-engine",
        "--layers=2",
        "--hidden=64",
        "--intermediate=128",
        "--vocab=512",
        "--repeats=1",
        f"--json={out}",
    ]
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    figs = {f["name"].removeprefix("weight_sync/"): f for f in doc["figures"]}
    assert doc["baseline"] == floor_name
    floor = figs[floor_row]["value"]
    assert floor > 0
    for f in figs.values():
        assert f["baseline"] == floor and f["ratio"] == pytest.approx(f["value"] / floor)
    assert figs[floor_row]["ratio"] == pytest.approx(1.0)
