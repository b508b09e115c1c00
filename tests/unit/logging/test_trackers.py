"""Metrics backends (spmdrl/logging/backends.py, trackers.py, console.py): the config check, the console
table, and wandb (WANDB_MODE=offline) and MLflow (a local file store) written for real and read back,
metrics and the samples' tables."""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

import pytest

from spmdrl.config_loader import load_config
from spmdrl.errors import ConfigError
from spmdrl.logging.backends import RunParams, git_revision, read_run_params
from spmdrl.logging.console import format_table
from spmdrl.logging.metrics import MetricLogger, read_metrics
from spmdrl.logging.samples import COLUMNS, Sample
from spmdrl.logging.trackers import Tracking
from spmdrl.testing.spawn import run_distributed

STEPS = [
    {"train/loss": 2.0, "val/accuracy/lighteval/MATH": 0.25, "timing/step_s": 0.5},
    {"train/loss": 1.5, "timing/step_s": 0.4},
]


def test_config_check_names_the_choices_and_repeats() -> None:
    with pytest.raises(ConfigError, match=r"unknown backend 'neptune'.*tensorboard, console, wandb, mlflow"):
        load_config(["logging.backends=[tensorboard,neptune]"])
    with pytest.raises(ConfigError, match="twice"):
        load_config(["logging.backends=[console,console]"])
    assert load_config(["logging.backends=[]"]).logging.backends == []


def _load_without(rank: int, world: int, hidden: tuple[str, ...]) -> tuple[str, str]:
    """In a fresh process: load the config with ``hidden`` packages absent; (exception type, message)."""
    # A fake for "not installed" that behaves like the real absence for every caller: a None in
    # sys.modules makes importlib.util.find_spec return None and ``import`` raise ModuleNotFoundError,
    # as for a package that is not there. (An import hook that raises from find_spec does not:
    # accelerate's availability probe, imported through transformers when TRL is installed beside
    # spmdrl, calls find_spec("wandb") and would crash on it.)
    sys.modules.update(dict.fromkeys(hidden))
    load_config(["logging.backends=[tensorboard,console]"])
    try:
        load_config(["recipe=sft_tiny", "logging.backends=[tensorboard,wandb,mlflow]"])
    except Exception as e:  # noqa: BLE001 - reported to the test
        return type(e).__name__, str(e)
    return "", ""


def test_missing_package_fails_at_config_load_naming_the_extra() -> None:
    """The packages may be installed here, so a process of its own hides them and loads the config as a
    run does first (forked from the tests' fork server: spmdrl.testing.spawn)."""
    [(kind, message)] = run_distributed(_load_without, 1, ("wandb", "mlflow"), timeout_s=120)
    assert kind == "ConfigError", message
    assert "wandb, mlflow" in message and 'pip install "spmdrl[wandb,mlflow]"' in message


def test_console_table(caplog: pytest.LogCaptureFixture, tmp_path: Path) -> None:
    table = format_table(3, {"train/loss": 0.123456789, "actor/entropy": 1.0, "actor/pg_loss": float("nan")})
    lines = table.splitlines()
    assert lines[0] == "step 3"
    assert lines[1].split() == ["actor/entropy", "1"] and lines[2].split() == ["actor/pg_loss", "nan"]
    assert lines[3] == "" and lines[4].split() == ["train/loss", "0.123457"]
    assert lines[1].index("1") == lines[4].index("0.123457"), "values line up"

    logger = MetricLogger(tmp_path, total_steps=2, backends=("console",), progress_bar=False, console_every=2)
    with caplog.at_level(logging.INFO, logger="spmdrl"):
        for step, metrics in enumerate(STEPS, start=1):
            logger.log(step, metrics)
    logger.close()
    # Without a terminal the header is the progress line (spmdrl/logging/progress.py).
    headers = [r.getMessage().splitlines()[0] for r in caplog.records]
    assert [h.split("  ")[0] for h in headers] == ["step 1/2 (50%)", "step 2/2 (100%)"]
    assert not (tmp_path / "tensorboard").exists()
    assert len(read_metrics(tmp_path / "metrics.jsonl")) == 2  # metrics.jsonl whatever the backends


def test_git_revision() -> None:
    rev = git_revision()
    assert rev == "unknown" or len(rev.removesuffix("+dirty")) == 40
    assert git_revision(Path("/")) == "unknown"


def _params(out: Path) -> RunParams:
    (out / "config.yaml").write_text("name: sft_tiny\ntrainer:\n  total_steps: 2\n  seed: 0\n")
    (out / "derived.json").write_text(json.dumps({"world_size": 2, "grad_accum_steps": 4}))
    return read_run_params(out / "config.yaml", out / "derived.json")


def test_mlflow_file_store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("mlflow", reason='mlflow is not installed: pip install -e ".[mlflow]"')
    from mlflow.tracking import MlflowClient

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 reads file stores only when asked
    params = _params(tmp_path)
    tracking = Tracking(project="spmdrl-test", name="run-a", params=params)
    logger = MetricLogger(
        tmp_path, total_steps=2, backends=("mlflow",), progress_bar=False, tracking=tracking
    )
    for step, metrics in enumerate(STEPS, start=1):
        logger.log(step, metrics)
    logger.close()

    client = MlflowClient(tracking_uri=(tmp_path / "mlruns").as_uri())
    run = client.get_run((tmp_path / "mlflow_run_id").read_text().strip())
    assert run.info.run_name == "run-a" and run.info.status == "FINISHED"
    assert client.get_experiment(run.info.experiment_id).name == "spmdrl-test"
    assert run.data.params["config.trainer.total_steps"] == "2"
    assert run.data.params["derived.grad_accum_steps"] == "4"
    assert run.data.params["git_revision"] == params.git_revision == run.data.tags["git_revision"]
    loss = client.get_metric_history(run.info.run_id, "train/loss")
    assert [(m.step, m.value) for m in loss] == [(1, 2.0), (2, 1.5)]
    assert [m.value for m in client.get_metric_history(run.info.run_id, "val/accuracy/lighteval/MATH")] == [
        0.25
    ]
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert artifacts == {"config.yaml", "derived.json"}

    # A resumed run (same output directory) continues the same MLflow run.
    logger = MetricLogger(
        tmp_path, total_steps=3, backends=("mlflow",), progress_bar=False, tracking=tracking
    )
    logger.log(3, {"train/loss": 1.0})
    logger.close()
    assert [m.step for m in client.get_metric_history(run.info.run_id, "train/loss")] == [1, 2, 3]
    assert len(client.search_runs([run.info.experiment_id])) == 1


def test_wandb_offline_writes_a_run_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("wandb", reason='wandb is not installed: pip install -e ".[wandb]"')
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    tracking = Tracking(project="spmdrl-test", name="run-a", params=_params(tmp_path))
    logger = MetricLogger(tmp_path, total_steps=2, backends=("wandb",), progress_bar=False, tracking=tracking)
    for step, metrics in enumerate(STEPS, start=1):
        logger.log(step, metrics)
    logger.close()

    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 1, list((tmp_path / "wandb").iterdir())
    (log_file,) = runs[0].glob("run-*.wandb")
    # The run's records (protobuf; wandb ships no reader): the metric keys, the parameters and their values.
    data = log_file.read_bytes()
    for text in (
        "train/loss",
        "val/accuracy/lighteval/MATH",
        "git_revision",
        "grad_accum_steps",
        "total_steps",
    ):
        assert text.encode() in data, text


SAMPLES = [
    Sample(2, "val", "1+1=", "2", "2", 1.0, "tiny"),
    Sample(2, "val", "2+2=", "5", "4", 0.0, "tiny"),
    Sample(3, "train", "3+3=", "6", "6", 1.0, "tiny"),
]


def _table_rows(samples: list[Sample]) -> list[list[object]]:
    return [[s.step, s.split, s.prompt, s.response, s.ground_truth, s.reward, s.data_source] for s in samples]


def test_samples_as_mlflow_tables(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each step's samples of a split: a JSON artifact <split>/samples/step-<N>.json in MLflow's table
    layout, read back from the file store; samples.jsonl whatever the backends."""
    pytest.importorskip("mlflow", reason='mlflow is not installed: pip install -e ".[mlflow]"')
    from mlflow.tracking import MlflowClient

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    tracking = Tracking(project="spmdrl-test", name="run-a", params=_params(tmp_path))
    logger = MetricLogger(
        tmp_path, total_steps=3, backends=("mlflow",), progress_bar=False, tracking=tracking
    )
    logger.log_samples(SAMPLES[:2])
    # A key with keys under it (RL's validation): a file store cannot hold both as given.
    logger.log(2, {"val/accuracy": 0.5, "val/accuracy/tiny": 0.25})
    logger.log_samples(SAMPLES[2:])
    logger.log(3, {"val/accuracy": 0.75, "train/loss": 1.0})
    logger.close()

    client = MlflowClient(tracking_uri=(tmp_path / "mlruns").as_uri())
    run_id = (tmp_path / "mlflow_run_id").read_text().strip()
    keys = ("val/accuracy/all", "val/accuracy/tiny", "train/loss")
    history = {k: [(m.step, m.value) for m in client.get_metric_history(run_id, k)] for k in keys}
    assert history == {
        "val/accuracy/all": [(2, 0.5), (3, 0.75)],
        "val/accuracy/tiny": [(2, 0.25)],
        "train/loss": [(3, 1.0)],
    }
    for path, rows in (
        ("val/samples/step-000002.json", SAMPLES[:2]),
        ("train/samples/step-000003.json", SAMPLES[2:]),
    ):
        local = client.download_artifacts(run_id, path, str(tmp_path / "download"))
        table = json.loads(Path(local).read_text())
        assert table == {"columns": list(COLUMNS), "data": _table_rows(rows)}, path
    assert [
        json.loads(line)["response"] for line in (tmp_path / "samples.jsonl").read_text().splitlines()
    ] == ["2", "5", "6"]


def test_samples_as_wandb_tables(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """wandb (offline): a wandb.Table per step and split, key "<split>/samples", in the run's files."""
    pytest.importorskip("wandb", reason='wandb is not installed: pip install -e ".[wandb]"')
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    tracking = Tracking(project="spmdrl-test", name="run-a", params=_params(tmp_path))
    logger = MetricLogger(tmp_path, total_steps=3, backends=("wandb",), progress_bar=False, tracking=tracking)
    logger.log_samples(SAMPLES[:2])
    logger.log(2, {"val/accuracy": 0.5})
    logger.log_samples(SAMPLES[2:])
    logger.close()

    (run,) = (tmp_path / "wandb").glob("offline-run-*")
    # One table file per logged table, under its key (wandb numbers the file by its own history row).
    tables = run / "files" / "media" / "table"
    (val,) = (tables / "val").glob("samples_*.table.json")
    (train,) = (tables / "train").glob("samples_*.table.json")
    assert json.loads(val.read_text()) == {"columns": list(COLUMNS), "data": _table_rows(SAMPLES[:2])}
    assert json.loads(train.read_text()) == {"columns": list(COLUMNS), "data": _table_rows(SAMPLES[2:])}
    # The history rows that hold them (protobuf; wandb ships no reader): the keys and the table files.
    (records,) = run.glob("run-*.wandb")
    data = records.read_bytes()
    for text in ("val/samples", "train/samples", val.name, train.name):
        assert text.encode() in data, text
