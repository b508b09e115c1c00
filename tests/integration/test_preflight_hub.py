"""spmdrl/preflight.py's hub-id cases end to end: ``python -m spmdrl.train --check`` in a fresh interpreter
with the hub's settings in its environment (huggingface_hub reads them at import, so a process forked from
one that imported it would not see them), against a local port where nothing listens, or a local server
answering as the hub does for a repository it does not have. (Moved from the unit
tier: three fresh interpreters importing torch and transformers took 27 s of it; the same checks on real
files, in-process, stay there in tests/unit/test_preflight.py.)"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from spmdrl.testing.fake_hub import fake_hub
from spmdrl.testing.spawn import free_port


def _check_hub_id(tmp_path: Path, **env: str) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if "proxy" not in k.lower() and not k.startswith("HF_")}
    return subprocess.run(
        [sys.executable, "-m", "spmdrl.train", "--check", "recipe=sft_tiny", "model.path=my-org/my-model"],
        env={**clean, "HF_HUB_CACHE": str(tmp_path / "hub"), **env},
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_hub_id_offline_and_not_cached(tmp_path: Path) -> None:
    res = _check_hub_id(tmp_path, HF_HUB_OFFLINE="1")
    assert res.returncode == 2
    assert res.stderr.count("\n") == 1, res.stderr  # one line
    assert "model.path=my-org/my-model is a hub id that is not in the hub cache" in res.stderr
    assert "the hub is set offline (HF_HUB_OFFLINE)" in res.stderr


def test_hub_id_with_the_hub_unreachable(tmp_path: Path) -> None:
    res = _check_hub_id(tmp_path, HF_ENDPOINT=f"http://127.0.0.1:{free_port()}")
    assert res.returncode == 2, res.stderr
    assert res.stderr.count("\n") == 1, res.stderr
    assert "is unreachable (ConnectionRefusedError" in res.stderr


def test_hub_id_in_the_cache_passes_offline(tmp_path: Path) -> None:
    # The hub cache's layout, as huggingface_hub writes it: refs/main names the snapshot.
    repo = tmp_path / "hub" / "models--my-org--my-model"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text("abc123")
    (repo / "snapshots" / "abc123").mkdir(parents=True)
    (repo / "snapshots" / "abc123" / "config.json").write_text("{}")
    res = _check_hub_id(tmp_path, HF_HUB_OFFLINE="1")
    assert res.returncode == 0, res.stderr
    assert "model.path=my-org/my-model (in the hub cache" in res.stdout


def test_a_hub_id_the_hub_does_not_have(tmp_path: Path) -> None:
    # HF_ENDPOINT as a user sets it, read by huggingface_hub at import (the unit tier points its constant
    # at such a server in-process: tests/unit/test_preflight_start.py).
    with fake_hub(404) as (url, _):
        res = _check_hub_id(tmp_path, HF_ENDPOINT=url)
    assert res.returncode == 2, res.stderr
    assert res.stderr.count("\n") == 1, res.stderr
    assert "model.path=my-org/my-model: the hub (http://127.0.0.1:" in res.stderr
    assert "has no model repository 'my-org/my-model'" in res.stderr
