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


def test_a_step_that_fails_leaves_no_trace(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match="boom"), profile_step([1], tmp_path, 1, rank=0, device=CPU):
        _work()
        raise RuntimeError("boom")
    assert not (tmp_path / "profile").exists()


@pytest.mark.parametrize("recipe", ["grpo_tiny", "ppo_tiny", "grpo_async_tiny", "sft_tiny", "rm_tiny"])
def test_every_recipe_takes_it(recipe: str) -> None:
    assert load_config([f"recipe={recipe}", "logging.profile_steps=[2,5]"]).logging.profile_steps == [2, 5]
