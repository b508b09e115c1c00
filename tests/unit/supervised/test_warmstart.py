"""warmstart.*: the SFT stage's config, and which stage runs (spmdrl/supervised/warmstart.py)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest

from spmdrl.config import Config
from spmdrl.config_loader import load_config
from spmdrl.loop import StartPlan
from spmdrl.supervised import warmstart


def test_the_stage_trains_with_the_warm_starts_batch_and_optimizer() -> None:
    cfg = load_config(["recipe=grpo_tiny", "warmstart.total_steps=7", "warmstart.optim.lr=0.5"])
    ws = warmstart.warmstart_config(cfg)
    assert ws.trainer.total_steps == 7 and ws.optim == cfg.warmstart.optim and ws.optim.lr == 0.5
    assert ws.trainer.global_batch_size == cfg.warmstart.global_batch_size
    assert ws.trainer.val_every == 0 and ws.trainer.save_hf
    assert ws.data == cfg.data and ws.model.lora.rank == 0


@dataclasses.dataclass
class _Env:
    is_main: bool = True


@dataclasses.dataclass
class _Run:
    cfg: Config
    output_dir: Path
    env: _Env = dataclasses.field(default_factory=_Env)


def _recorder(calls: list[tuple[str, int]], name: str) -> Any:
    def train_sft(run: Any, cfg: Config, stage: str = "") -> Path:
        calls.append((stage, cfg.trainer.total_steps))
        return run.output_dir / stage / name

    return train_sft


def test_the_default_entry_runs_the_librarys_stage(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    calls: list[tuple[str, int]] = []
    monkeypatch.setattr(warmstart, "train_sft", _recorder(calls, "library"))
    run = _Run(load_config(["recipe=grpo_tiny", "warmstart.total_steps=7"]), tmp_path)
    assert run.cfg.warmstart.entry == "sft"
    out = warmstart.warm_start(run, StartPlan(None, restarted=False))  # type: ignore[arg-type]
    assert out == tmp_path / "sft" / "library" and calls == [("sft", 7)]


def test_a_forks_entry_runs_its_own_stage(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    (tmp_path / "my_sft.py").write_text(
        "from pathlib import Path\n\n\ndef main(cfg):\n    pass\n\n\n"
        "def train_sft(run, cfg, stage=''):\n    return Path('mine') / stage\n"
    )
    monkeypatch.setattr(warmstart, "train_sft", _recorder([], "library"))
    cfg = load_config(["recipe=grpo_tiny", f"warmstart.entry={tmp_path / 'my_sft.py'}"])
    run = _Run(cfg, tmp_path)
    out = warmstart.warm_start(run, StartPlan(None, restarted=False))  # type: ignore[arg-type]
    assert out == Path("mine") / "sft"


def test_a_resumed_job_reuses_the_export(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    calls: list[tuple[str, int]] = []
    monkeypatch.setattr(warmstart, "train_sft", _recorder(calls, "library"))
    done = tmp_path / "sft" / "hf_model"
    done.mkdir(parents=True)
    (done / "config.json").write_text("{}")
    plan = StartPlan(tmp_path / "checkpoints" / "step-4", restarted=True)
    run = _Run(load_config(["recipe=grpo_tiny"]), tmp_path)
    assert warmstart.warm_start(run, plan) == done  # type: ignore[arg-type]
    assert calls == []


def test_a_restarted_stage_starts_its_logs_over(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(warmstart, "train_sft", _recorder([], "library"))
    (tmp_path / "sft").mkdir()
    (tmp_path / "sft" / "metrics.jsonl").write_text('{"step": 1}\n')
    run = _Run(load_config(["recipe=grpo_tiny"]), tmp_path)
    warmstart.warm_start(run, StartPlan(None, restarted=True))  # type: ignore[arg-type]
    assert (tmp_path / "sft" / "metrics.jsonl").read_text() == ""
