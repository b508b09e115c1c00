"""Command line -> typed :class:`~spmdrl.config.Config`, through Hydra's compose API.

We use compose rather than ``@hydra.main``: Hydra's app mode creates a timestamped run directory
per process (ranks would disagree on it) and reconfigures logging; we only want its config
composition and override grammar. The config tree is validated against the dataclasses in
spmdrl/config.py, so a misspelled key or a wrong type fails at once, naming the valid choices.
"""

from __future__ import annotations

import dataclasses
import difflib
import typing
from typing import Any

from hydra import compose, initialize_config_module
from hydra.core.config_store import ConfigStore
from hydra.errors import HydraException
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from spmdrl.config import Config, ConfigError, validate

_SCHEMA_NAME = "spmdrl_schema"
CONFIG_MODULE = "spmdrl.configs"


def _register_schema() -> None:
    ConfigStore.instance().store(name=_SCHEMA_NAME, node=Config)


def _field_types(cls: type) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def check_key(dotted: str) -> None:
    """Raises ConfigError if ``dotted`` (e.g. ``optim.lr``) is not a field of Config, naming the valid ones."""
    cls: Any = Config
    walked: list[str] = []
    for part in dotted.split("."):
        if not (isinstance(cls, type) and dataclasses.is_dataclass(cls)):
            raise ConfigError(f"unknown config key '{dotted}': '{'.'.join(walked)}' has no sub-keys")
        fields = _field_types(cls)
        if part not in fields:
            where = ".".join(walked) or "the top level"
            close = difflib.get_close_matches(part, fields, n=3)
            hint = (
                f" Did you mean {' or '.join(repr('.'.join([*walked, c])) for c in close)}?" if close else ""
            )
            raise ConfigError(
                f"unknown config key '{dotted}'.{hint} Valid keys at {where}: {', '.join(sorted(fields))}"
            )
        walked.append(part)
        cls = fields[part]


def _override_key(override: str) -> str | None:
    """The config key an override sets; None for group selections (recipe=...) and hydra.* keys."""
    body = override.lstrip("+~")
    key = body.split("=", 1)[0].strip()
    if key in ("recipe",) or key.startswith("hydra."):
        return None
    return key


def available_recipes() -> list[str]:
    from importlib.resources import files

    return sorted(
        p.name[: -len(".yaml")]
        for p in (files(CONFIG_MODULE) / "recipe").iterdir()
        if p.name.endswith(".yaml")
    )


def load_config(overrides: list[str]) -> Config:
    """Composes configs/config.yaml + the selected recipe + command-line overrides into a Config."""
    for ov in overrides:
        if "=" not in ov and not ov.startswith("~"):
            raise ConfigError(
                f"cannot parse argument '{ov}': overrides look like key=value (for example optim.lr=1e-5)"
            )
        key = _override_key(ov)
        if key is not None:
            check_key(key)
    for ov in overrides:
        if ov.split("=", 1)[0] == "recipe":
            name = ov.split("=", 1)[1]
            recipes = available_recipes()
            if name not in recipes:
                close = difflib.get_close_matches(name, recipes, n=3)
                hint = f" Did you mean {' or '.join(close)}?" if close else ""
                raise ConfigError(f"unknown recipe '{name}'.{hint} Available recipes: {', '.join(recipes)}")
    _register_schema()
    try:
        with initialize_config_module(config_module=CONFIG_MODULE, version_base="1.3"):
            composed = compose(config_name="config", overrides=overrides)
        cfg = OmegaConf.to_object(composed)
    except (HydraException, OmegaConfBaseException) as e:
        # OmegaConf's messages carry full_key / value / object_type; keep them, drop the stack.
        msg = str(e.__cause__ or e) if isinstance(e, HydraException) else str(e)
        raise ConfigError(f"invalid configuration: {msg.strip()}") from None
    assert isinstance(cfg, Config)
    validate(cfg)
    return cfg


def to_yaml(cfg: Config) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))
