"""Experiment trackers as metric backends: Weights & Biases and MLflow (optional extras, imported only
when ``logging.backends`` names them). Rank 0 only, like every metric output.

Each opens one run per logger (the RL run; an SFT warm-start's stage is a run of its own, named with
its stage), records the run's parameters (:class:`~spmdrl.logging.backends.RunParams`) once, and logs
the step's scalars under spmdrl's own keys (docs/metrics.md maps them to verl's names), and the logged
samples as tables (key "<split>/samples": wandb a wandb.Table at the step, MLflow a JSON artifact
"<split>/samples/step-<N>.json" in its table layout, {"columns": [...], "data": [[...], ...]}). A resumed run
continues the same tracker run: wandb by an id derived from the output directory, MLflow by the run id
saved in it; the steps after the checkpoint are logged again.
"""

from __future__ import annotations

import hashlib
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

from spmdrl.logging.backends import RunParams


@dataclass(frozen=True)
class Tracking:
    """What the trackers need besides the metrics: where the run goes and what it records."""

    project: str  # wandb project, MLflow experiment (logging.project)
    name: str  # the run's name (logging.experiment, else <recipe>-<output dir name>[-<stage>])
    params: RunParams
    mlflow_tracking_uri: str = ""


# MLflow refuses parameter values longer than this (its MAX_PARAM_VAL_LENGTH).
_MLFLOW_MAX_PARAM_CHARS = 6000
# Characters MLflow accepts in metric and parameter names; others become "_".
_MLFLOW_NAME_RE = re.compile(r"[^A-Za-z0-9_\-. /]")


class WandbTracker:
    """A wandb run in ``output_dir/wandb/`` (WANDB_MODE=offline: nothing leaves the machine)."""

    def __init__(self, output_dir: Path, *, project: str, name: str, params: RunParams) -> None:
        import wandb

        # Same output directory, same run: a resumed job continues its wandb run.
        run_id = hashlib.sha1(str(output_dir.resolve()).encode()).hexdigest()[:16]
        self._run = wandb.init(
            project=project,
            name=name,
            id=run_id,
            resume="allow",
            dir=str(output_dir),
            config={"config": params.config, "derived": params.derived, "git_revision": params.git_revision},
        )

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self._run.log(metrics, step=step)

    def log_table(self, step: int, key: str, columns: list[str], rows: list[list[object]]) -> None:
        import wandb

        self._run.log({key: wandb.Table(columns=columns, data=rows)}, step=step)

    def close(self) -> None:
        import wandb

        self._run.finish()
        # finish() returns before wandb's service process has written the run's last records; teardown
        # waits for it, so the run directory is complete when the logger is closed.
        wandb.teardown()


class MlflowTracker:
    """An MLflow run: at ``tracking_uri``, else MLFLOW_TRACKING_URI, else a file store in output_dir/mlruns."""

    def __init__(
        self, output_dir: Path, *, project: str, name: str, params: RunParams, tracking_uri: str
    ) -> None:
        uri = tracking_uri or os.environ.get("MLFLOW_TRACKING_URI", "") or (output_dir / "mlruns").as_uri()
        if uri.startswith("file:"):
            # MLflow 3 refuses file stores unless asked; its database store needs the full mlflow package,
            # a file store works with mlflow-skinny (the `mlflow` extra).
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        from mlflow.tracking import MlflowClient

        self._client = MlflowClient(tracking_uri=uri)
        # A file store keeps a metric as a file named by its key, so "val/accuracy" and "val/accuracy/<source>"
        # (a file and a directory of the same path) cannot both be stored: see _file_store_names.
        self._file_store = urlparse(uri).scheme in ("", "file") and uri != "databricks"
        self._renamed: set[str] = set()
        id_file = output_dir / "mlflow_run_id"
        if id_file.is_file():
            self._run_id = id_file.read_text().strip()
            return
        experiment = self._client.get_experiment_by_name(project)
        experiment_id = experiment.experiment_id if experiment else self._client.create_experiment(project)
        self._run_id = self._client.create_run(experiment_id, run_name=name).info.run_id
        id_file.write_text(self._run_id + "\n")
        from mlflow.entities import Param

        flat = params.flat()
        self._client.log_batch(
            self._run_id,
            params=[Param(_mlflow_name(k), v[:_MLFLOW_MAX_PARAM_CHARS]) for k, v in flat.items()],
        )
        self._client.set_tag(self._run_id, "git_revision", params.git_revision)
        for file in params.files:
            self._client.log_artifact(self._run_id, str(file))

    def log(self, step: int, metrics: dict[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        names = {k: _mlflow_name(k) for k in metrics}
        if self._file_store:
            names = _file_store_names(names, self._renamed)
        self._client.log_batch(
            self._run_id, metrics=[Metric(names[k], v, now, step) for k, v in metrics.items()]
        )

    def log_table(self, step: int, key: str, columns: list[str], rows: list[list[object]]) -> None:
        # mlflow.log_table's own layout, written with log_dict: log_table needs pandas, which
        # mlflow-skinny (the `mlflow` extra) does not install. One file per step: a resumed run rewrites it.
        table = {"columns": columns, "data": rows}
        self._client.log_dict(self._run_id, table, f"{_mlflow_name(key)}/step-{step:06d}.json")

    def close(self) -> None:
        self._client.set_terminated(self._run_id)


def _mlflow_name(key: str) -> str:
    return _MLFLOW_NAME_RE.sub("_", key)


# Where a key has keys under it, its own value in an MLflow file store (val/accuracy -> val/accuracy/all).
FILE_STORE_LEAF = "all"


def _file_store_names(names: dict[str, str], renamed: set[str]) -> dict[str, str]:
    """An MLflow file store's metric names: a name that other names of the row sit under (val/accuracy,
    beside val/accuracy/<source>) becomes <name>/all, and stays so for the rest of the run (``renamed``,
    updated); every other name is unchanged. A server's store takes the names as they are."""
    parents = {n.rsplit("/", i)[0] for n in names.values() for i in range(1, n.count("/") + 1)}
    renamed.update(n for n in names.values() if n in parents)
    return {k: f"{n}/{FILE_STORE_LEAF}" if n in renamed else n for k, n in names.items()}


def open_tracker(backend: str, output_dir: Path, tracking: Tracking) -> WandbTracker | MlflowTracker:
    """The tracker for ``backend`` ("wandb" or "mlflow"), opening its run."""
    t = tracking
    if backend == "wandb":
        return WandbTracker(output_dir, project=t.project, name=t.name, params=t.params)
    if backend == "mlflow":
        return MlflowTracker(
            output_dir, project=t.project, name=t.name, params=t.params, tracking_uri=t.mlflow_tracking_uri
        )
    raise ValueError(f"no tracker named {backend!r}")
