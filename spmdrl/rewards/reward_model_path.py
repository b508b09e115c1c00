"""reward_model.path checked before a run starts (no torch import: spmdrl.preflight and --check call it)."""

from __future__ import annotations

import json
from pathlib import Path

from spmdrl.errors import ConfigError


def check_reward_model_dir(path: str, key: str = "reward_model.path") -> Path:
    """The local directory ``path``, checked to hold a sequence-classification model with one label and
    safetensors (no torch import: called before anything expensive starts). Raises ConfigError."""
    local = Path(path).expanduser()
    config_file = local / "config.json"
    if not config_file.is_file():
        raise ConfigError(
            f"{key}={path}: no config.json there; point it at an HF sequence-classification model directory "
            "(a recipe=rm_tiny run writes one as <output_dir>/hf_model)"
        )
    config = json.loads(config_file.read_text())
    archs = config.get("architectures") or []
    if not archs or not str(archs[0]).endswith("ForSequenceClassification"):
        raise ConfigError(
            f"{key}={path}: {config_file} is a {archs[0] if archs else 'model without architectures'}, not a "
            "*ForSequenceClassification reward model (train one with recipe=rm_tiny, or export yours with "
            "AutoModelForSequenceClassification(num_labels=1).save_pretrained)"
        )
    labels = len(config.get("id2label") or {}) or config.get("num_labels", 1)
    if labels != 1:
        raise ConfigError(
            f"{key}={path}: the model has {labels} labels; a reward model has one (num_labels=1)"
        )
    if not any(local.glob("*.safetensors")):
        raise ConfigError(f"{key}={path}: no *.safetensors in {local}; spmdrl loads safetensors only")
    return local
