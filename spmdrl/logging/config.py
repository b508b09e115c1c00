"""The ``logging`` section: where metrics, samples and profiles go."""

from __future__ import annotations

from dataclasses import dataclass, field

from spmdrl.logging.backends import check_backends  # light: no torch, no tracker import


@dataclass
class LoggingConfig:
    # Where the metrics go besides metrics.jsonl (always written): "tensorboard" (output_dir/tensorboard),
    # "console" (a table in the log every console_every steps), "wandb", "mlflow" (extras of their own;
    # docs/metrics.md). A backend whose package is missing fails at config load, naming its extra.
    backends: list[str] = field(default_factory=lambda: ["tensorboard"])
    # wandb's project and MLflow's experiment (verl's trainer.project_name).
    project: str = "spmdrl"
    # The run's name in wandb and MLflow (verl's trainer.experiment_name); "": <recipe>-<output dir name>.
    experiment: str = ""
    # "": MLFLOW_TRACKING_URI if set, else a file store in output_dir/mlruns (mlflow-skinny is enough).
    mlflow_tracking_uri: str = ""
    progress_bar: bool = True
    console_every: int = 10
    # RL recipes: every this many steps, rank 0 appends samples_per_log completions with their
    # rewards to samples.jsonl (0 turns it off).
    samples_every: int = 10
    samples_per_log: int = 4
    # These training steps (counted from 1, as logged; in an RL job the RL steps, not the warm-start's)
    # run under torch.profiler on every rank, each writing a Chrome trace and a table of the step's phases
    # (host and device time) and of the ops with the most self time to output_dir/profile/step-<N>/
    # (spmdrl/logging/profiler.py; docs/performance.md).
    # Empty: off.
    profile_steps: list[int] = field(default_factory=list)

    def check(self) -> None:
        check_backends(list(self.backends))
