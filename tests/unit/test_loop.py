"""The loop skeleton (spmdrl/loop.py): when something is due, and a start without a checkpoint. Resuming
from one is tested multi-process with each loop (tests/integration/test_sft_resume.py, test_rm_resume.py,
test_resume.py)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pytest

from spmdrl import loop
from spmdrl.data.sampler import DistributedSampler
from spmdrl.logging.metrics import NullLogger


@pytest.mark.parametrize(
    ("every", "steps"),
    [(0, [6]), (1, [1, 2, 3, 4, 5, 6]), (4, [4, 6]), (3, [3, 6]), (10, [6])],
)
def test_due_every_n_steps_and_at_the_last(every: int, steps: list[int]) -> None:
    assert [s for s in range(1, 7) if loop.due(s, every, 6)] == steps


def test_validation_every_n_steps_at_the_last_and_at_the_start_unless_off() -> None:
    assert [s for s in range(7) if loop.validation_due(s, 4, 6)] == [0, 4, 6]
    assert not any(loop.validation_due(s, 0, 6) for s in range(7))  # 0: off, the last step too
    # trainer.val_before_train=false: step 0 alone is skipped
    assert [s for s in range(7) if loop.validation_due(s, 4, 6, at_start=False)] == [4, 6]


@dataclass
class _Env:
    is_main: bool = True


@dataclass
class _Run:
    output_dir: Path
    env: _Env

    def metric_logger(self, total_steps: int, subdir: str = "", resume_step: int = 0) -> NullLogger:
        assert (total_steps, resume_step) == (6, 0)
        return NullLogger()


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.parametrize("restarted", [False, True])
def test_no_checkpoint_starts_at_0_and_a_restart_starts_its_logs_over(
    tmp_path: Path, restarted: bool
) -> None:
    (tmp_path / "sft").mkdir()
    (tmp_path / "sft" / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2}\n')
    sampler = DistributedSampler(12, rank=0, world_size=1, batch_size_per_rank=2, seed=0, shuffle=True)
    plan = loop.StartPlan(None, restarted=restarted)
    run = _Run(tmp_path, _Env())
    start = loop.resume_or_start(run, plan, [], sampler, 6, stage="sft")  # type: ignore[arg-type]
    assert (start.step, start.state) == (0, {})
    assert len(_rows(tmp_path / "sft" / "metrics.jsonl")) == (0 if restarted else 2)
