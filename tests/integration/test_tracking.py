"""logging.backends=[tensorboard,wandb,mlflow] in a real 2-process run (recipe=sft_tiny; RL recipes open
their logger the same way, spmdrl.runtime.Run.metric_logger): wandb offline and MLflow's local file store
each hold the run's metrics and parameters (config, git revision, derived values), and the validation's
samples as a table."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from spmdrl.logging.metrics import read_metrics
from spmdrl.logging.samples import COLUMNS
from spmdrl.testing.launch import offline_trackers_env, torchrun

pytestmark = pytest.mark.slow


def test_sft_tiny_logs_to_tensorboard_wandb_and_mlflow(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("wandb", reason='wandb is not installed: pip install -e ".[wandb]"')
    pytest.importorskip("mlflow", reason='mlflow is not installed: pip install -e ".[mlflow]"')
    from mlflow.tracking import MlflowClient

    out = tmp_path / "run"
    res = torchrun(
        [
            "-m",
            "spmdrl.train",
            "recipe=sft_tiny",
            f"trainer.output_dir={out}",
            "trainer.total_steps=3",
            "tiny_task.num_train=64",
            "tiny_task.num_test=16",
            "trainer.global_batch_size=16",
            "trainer.micro_batch_size=8",
            "trainer.save_hf=false",
            "logging.backends=[tensorboard,wandb,mlflow]",
            "logging.experiment=tracked",
        ],
        nproc=2,
        cwd=tmp_path,
        timeout_s=600,
        env=offline_trackers_env(),
    )
    assert res.returncode == 0, res.output[-4000:]
    steps = [r["step"] for r in read_metrics(out / "metrics.jsonl")]
    assert steps == [1, 2, 3]

    assert list((out / "tensorboard").glob("events.out.tfevents.*"))

    (wandb_run,) = (out / "wandb").glob("offline-run-*")
    (records,) = wandb_run.glob("run-*.wandb")
    data = records.read_bytes()
    for text in ("train/loss", "timing/step_s", "git_revision", "grad_accum_steps", "tracked", "val/samples"):
        assert text.encode() in data, text

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 reads file stores only when asked
    client = MlflowClient(tracking_uri=(out / "mlruns").as_uri())
    run = client.get_run((out / "mlflow_run_id").read_text().strip())
    assert run.info.run_name == "tracked" and run.info.status == "FINISHED"
    assert [m.step for m in client.get_metric_history(run.info.run_id, "train/loss")] == steps
    params = run.data.params
    assert params["config.trainer.total_steps"] == "3"
    assert params["derived.world_size"] == "2"
    assert params["git_revision"] != ""
    assert {a.path for a in client.list_artifacts(run.info.run_id)} == {"config.yaml", "derived.json", "val"}
    # The validation's samples (at the last step) as a table, as in samples.jsonl.
    local = client.download_artifacts(run.info.run_id, "val/samples/step-000003.json", str(tmp_path / "dl"))
    table = json.loads(Path(local).read_text())
    jsonl = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert table["columns"] == list(COLUMNS) and len(table["data"]) == len(jsonl) > 0
    assert [dict(zip(table["columns"], r, strict=True)) for r in table["data"]] == jsonl
