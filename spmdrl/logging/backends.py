"""Where metrics go (``logging.backends``), what each needs installed, and what a run records as its
parameters (the resolved config, the git revision, derived.json).

Checked when the config loads (:func:`check_backends`, through spmdrl.logging.config.LoggingConfig.check):
an unknown name, or a backend whose package is missing, fails there, before any process group or model,
naming the extra to install. Light on purpose (no torch, no tracker import): the config check imports it.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from spmdrl.errors import ConfigError


@dataclass(frozen=True)
class Backend:
    """A metrics backend: the module it imports, and the extra of spmdrl that installs it ("" : always there)."""

    module: str
    extra: str = ""


BACKENDS: dict[str, Backend] = {
    # torch's SummaryWriter (tensorboard is a dependency): output_dir/tensorboard/.
    "tensorboard": Backend("torch.utils.tensorboard"),
    # A table of the step's metrics in the log every logging.console_every steps.
    "console": Backend("logging"),
    # Weights & Biases; WANDB_MODE=offline writes the run under output_dir/wandb/ for a later `wandb sync`.
    "wandb": Backend("wandb", extra="wandb"),
    # MLflow (the light mlflow-skinny client is enough); by default a file store in output_dir/mlruns.
    "mlflow": Backend("mlflow", extra="mlflow"),
}


def check_backends(backends: list[str]) -> None:
    """Raises ConfigError for an unknown or repeated ``logging.backends`` entry, or one whose package is not
    installed (naming the extra that installs it)."""
    for name in backends:
        if name not in BACKENDS:
            raise ConfigError(
                f"logging.backends: unknown backend {name!r}; choose from {', '.join(BACKENDS)} "
                "(e.g. logging.backends=[tensorboard,wandb])"
            )
    if len(set(backends)) != len(backends):
        raise ConfigError(f"logging.backends lists a backend twice: {backends}")
    missing = [n for n in backends if BACKENDS[n].extra and not _importable(BACKENDS[n].module)]
    if missing:
        extras = ",".join(BACKENDS[n].extra for n in missing)
        raise ConfigError(
            f"logging.backends names {', '.join(missing)}, whose package is not installed; install the extra: "
            f'pip install "spmdrl[{extras}]"  (or drop it from logging.backends)'
        )


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ImportError:  # an import hook that refuses it, or a broken install: not usable either way
        return False


@dataclass(frozen=True)
class RunParams:
    """What a tracker records about a run besides its metrics."""

    config: dict[str, Any]  # the resolved config (config.yaml), recipe sections included
    derived: dict[str, Any]  # derived.json: the values computed from the config at start
    git_revision: (
        str  # the spmdrl checkout's commit, "+dirty" with uncommitted changes; "unknown" outside git
    )
    files: tuple[Path, ...] = ()  # config.yaml and derived.json, kept as artifacts where a tracker has them

    def flat(self) -> dict[str, str]:
        """One string per leaf, dotted keys (``config.trainer.total_steps``): for trackers whose
        parameters are flat (mlflow)."""
        out: dict[str, str] = {"git_revision": self.git_revision}
        _flatten("config", self.config, out)
        _flatten("derived", self.derived, out)
        return out


def _flatten(prefix: str, value: Any, out: dict[str, str]) -> None:
    if isinstance(value, dict) and value:
        for k, v in value.items():
            _flatten(f"{prefix}.{k}", v, out)
    else:
        out[prefix] = json.dumps(value) if isinstance(value, list | dict) else str(value)


def git_revision(where: Path | None = None) -> str:
    """The commit of the git checkout holding ``where`` (default: this package's source), with "+dirty"
    when tracked files have uncommitted changes; "unknown" for an installed package or without git."""
    where = where or Path(__file__).resolve().parent
    try:
        rev = subprocess.run(
            ["git", "-C", str(where), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10
        )
        if rev.returncode != 0:
            return "unknown"
        dirty = subprocess.run(
            ["git", "-C", str(where), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    return rev.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")


def read_run_params(config_yaml: Path, derived_json: Path) -> RunParams:
    """The run's parameters from the files it wrote at start (either may be missing: an empty dict)."""
    import yaml

    config = yaml.safe_load(config_yaml.read_text()) if config_yaml.is_file() else {}
    derived = json.loads(derived_json.read_text()) if derived_json.is_file() else {}
    files = tuple(p for p in (config_yaml, derived_json) if p.is_file())
    return RunParams(config=config or {}, derived=derived, git_revision=git_revision(), files=files)
