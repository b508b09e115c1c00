"""spmdrl/logging/profiler.py: logging.profile_steps' checks, and what a profiled step writes (on CPU;
the RL run's traces on 2 ranks: tests/integration/test_grpo_e2e.py's short run)."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest
import torch

from spmdrl.config_loader import load_config
from spmdrl.errors import ConfigError
from spmdrl.logging.profiler import check_profile_steps, profile_dir, profile_step
from spmdrl.logging.timer import PhaseTimer

CPU = torch.device("cpu")


def test_steps_the_run_takes_pass_and_others_name_themselves() -> None:
    check_profile_steps([], 3)
    check_profile_steps([1, 3], 3)
    with pytest.raises(ConfigError, match=r"step\(s\) \[0, 4\] outside this run's steps 1\.\.3"):
        check_profile_steps([4, 0, 2], 3)


def _work() -> None:
    a = torch.randn(64, 64)
    (a @ a).sum()


def test_a_chosen_step_writes_its_trace_and_op_table(tmp_path: Path) -> None:
    for step in (1, 2, 3):
        with profile_step([2], tmp_path, step, rank=1, device=CPU):
            _work()
    assert sorted(p.name for p in (tmp_path / "profile").iterdir()) == ["step-2"]
    out = profile_dir(tmp_path, 2)
    assert sorted(p.name for p in out.iterdir()) == ["rank-1.json.gz", "rank-1.txt"]
    events = json.loads(gzip.decompress((out / "rank-1.json.gz").read_bytes()))["traceEvents"]
    assert any(e.get("name") == "aten::mm" for e in events)
    table = (out / "rank-1.txt").read_text()
    assert "aten::mm" in table and "Self CPU" in table


def test_the_table_starts_with_the_steps_phases(tmp_path: Path) -> None:
    """PhaseTimer's phases are profiler ranges: the trace shows them and the table sums them by name, in
    the order of their host time, each call counted once (a second call of a phase adds to it)."""
    timer = PhaseTimer()
    with profile_step([1], tmp_path, 1, rank=0, device=CPU):
        with timer("update"):
            for _ in range(20):
                _work()
        with timer("rollout"):
            _work()
        with timer("update"):
            _work()
    events = json.loads(gzip.decompress((profile_dir(tmp_path, 1) / "rank-0.json.gz").read_bytes()))
    assert {"phase/update", "phase/rollout"} <= {e.get("name") for e in events["traceEvents"]}
    lines = (profile_dir(tmp_path, 1) / "rank-0.txt").read_text().splitlines()
    assert lines[0].startswith("phases") and lines[1].split() == ["phase", "calls", "host", "ms"]
    rows = [line.split() for line in lines[2:4]]
    assert [(r[0], r[1]) for r in rows] == [("update", "2"), ("rollout", "1")]
    # The table's host time is the ranges' own: within the timer's total for the phase.
    assert float(rows[0][2]) <= timer.seconds["update_s"] * 1e3 + 0.1
    assert "aten::mm" in "\n".join(lines[4:])


def test_a_step_without_phases_says_so(tmp_path: Path) -> None:
    with profile_step([1], tmp_path, 1, rank=0, device=CPU):
        _work()
    assert (profile_dir(tmp_path, 1) / "rank-0.txt").read_text().startswith("phases: none")


def test_a_step_that_fails_leaves_no_trace(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match="boom"), profile_step([1], tmp_path, 1, rank=0, device=CPU):
        _work()
        raise RuntimeError("boom")
    assert not (tmp_path / "profile").exists()


@pytest.mark.parametrize("recipe", ["grpo_tiny", "ppo_tiny", "grpo_async_tiny", "sft_tiny", "rm_tiny"])
def test_every_recipe_takes_it(recipe: str) -> None:
    assert load_config([f"recipe={recipe}", "logging.profile_steps=[2,5]"]).logging.profile_steps == [2, 5]
