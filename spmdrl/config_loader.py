"""Command line -> typed :class:`~spmdrl.config.Config`, through Hydra's compose API.

We use compose rather than ``@hydra.main``: Hydra's app mode creates a timestamped run directory
per process (ranks would disagree on it) and reconfigures logging; we only want its config
composition and override grammar. The config tree is validated against the dataclasses of the sections
(each in its package's config.py; spmdrl/config.py composes them), so a misspelled key or a wrong type
fails at once, naming the valid choices.

A recipe declares part of the schema itself (its ``@register_config_section`` dataclasses) and may
register the functions the config names (``@register_policy_loss``, ...), so :func:`load_config` works
in three steps:

1. compose the recipe's YAML files alone, untyped, to read ``entry``;
2. import the entry (:func:`import_entry`: a shipped recipe module, or a Python file), which registers its
   sections and functions;
3. compose again against the full schema (spmdrl.config.Config plus the registered sections) with the command
   line, build the typed Config and validate it.

A recipe YAML outside the package (``recipe=/any/dir/my_grpo.yaml``) becomes an option of the ``recipe``
group for the duration of the load (stored in Hydra's ConfigStore), so its defaults list names recipes as a
shipped recipe's does: ``defaults: [grpo_tiny, _self_]`` starts from the shipped grpo_tiny, and a name no
shipped recipe has is a YAML beside it (``my_base`` -> ``my_base.yaml``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import functools
import importlib
import os
import re
import sys
import typing
from collections.abc import Iterator
from importlib.resources import files
from pathlib import Path
from types import ModuleType
from typing import Any

from hydra import compose, initialize_config_module
from hydra.core.config_store import ConfigStore
from hydra.errors import HydraException
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from spmdrl.config import CONFIG_SECTIONS, Config, validate

# The built-in tasks' sections (tiny_task, tools_task) are registered by the modules that own them; imported
# here so that every config (any recipe, import_entry_module=False too) has them. Both are light (pyarrow).
from spmdrl.data import tiny_task, tools_task  # noqa: F401
from spmdrl.envs import config as _env_config  # noqa: F401  (the env section; light: no verifiers import)
from spmdrl.errors import ConfigError
from spmdrl.imports import import_file
from spmdrl.verl_keys import log_applied, translate, unknown_key_hint

_SCHEMA_NAME = "spmdrl_schema"
CONFIG_MODULE = "spmdrl.configs"
RECIPE_MODULE = "spmdrl.recipes"
# The ConfigStore name of a recipe YAML given by path ("file:my_grpo"): no shipped recipe's name has a colon.
_FILE_RECIPE_PREFIX = "file:"
# Keys that moved to a section of their own: an old config's key fails naming the new one.
_MOVED_KEYS = {"data.tiny": "tiny_task", "data.tiny_tools": "tools_task"}
# Keys that became part of another setting: the hint says what to write instead.
_REPLACED_KEYS = {
    "logging.tensorboard": "metrics backends are one list now: logging.backends=[tensorboard] (the default), "
    "logging.backends=[] for none, or any of tensorboard, console, wandb, mlflow",
    "rollout.latency_tail": "the simulated latency tail is no config setting now but a launcher of the tests and "
    "benchmarks: torchrun ... -m spmdrl.testing.latency_tail --prompts P --seconds S <spmdrl.train's "
    "arguments> (docs/rollout.md#simulated-latency-tail)",
}


def schema_class() -> type[Config]:
    """What Hydra composes against: Config, plus each registered section (spmdrl.config.CONFIG_SECTIONS) as
    a top-level key. Without sections, Config itself."""
    if not CONFIG_SECTIONS:
        return Config
    return _schema_with(tuple(CONFIG_SECTIONS.items()))


@functools.cache
def _schema_with(sections: tuple[tuple[str, type], ...]) -> type[Config]:
    """One class per set of sections, so that the schema Hydra holds is stored again only when it changed
    (:func:`_compose`)."""
    return dataclasses.make_dataclass(
        "Config",
        [(name, cls, dataclasses.field(default_factory=cls)) for name, cls in sections],
        bases=(Config,),
    )


def _field_types(cls: type) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls) if not f.metadata.get("omegaconf_ignore")}


def check_key(dotted: str, schema: type = Config) -> None:
    """Raises ConfigError if ``dotted`` (e.g. ``optim.lr``) is not a field of ``schema``, naming the valid ones."""
    cls: Any = schema
    walked: list[str] = []
    for part in dotted.split("."):
        if typing.get_origin(cls) is dict:
            return  # a mapping's keys are its values' names (reasoning_gym.config.<task>), not the schema's
        if not (isinstance(cls, type) and dataclasses.is_dataclass(cls)):
            raise ConfigError(f"unknown config key '{dotted}': '{'.'.join(walked)}' has no sub-keys")
        fields = _field_types(cls)
        if part not in fields:
            where = ".".join(walked) or "the top level"
            close = difflib.get_close_matches(part, fields, n=3)
            hint = (
                f" Did you mean {' or '.join(repr('.'.join([*walked, c])) for c in close)}?" if close else ""
            )
            old = ".".join([*walked, part])
            if old in _MOVED_KEYS:
                new = _MOVED_KEYS[old] + dotted[len(old) :]
                hint = f" '{old}' is the top-level section '{_MOVED_KEYS[old]}' now: '{new}'."
            elif old in _REPLACED_KEYS:
                hint = f" '{old}' is gone: {_REPLACED_KEYS[old]}."
            if (verl := unknown_key_hint(dotted)) is not None and old not in _MOVED_KEYS and not close:
                hint += f" {verl}."
            raise ConfigError(
                f"unknown config key '{dotted}'.{hint} Valid keys at {where}: {', '.join(sorted(fields))}"
            )
        walked.append(part)
        cls = fields[part]


def _assign_mapping(override: str, schema: type) -> str:
    """``env.args={a: 1}`` as Hydra's ``++env.args={a: 1}``: a free-form mapping field (config_section.mapping)
    takes the value whole; Hydra would refuse its keys as new ones otherwise."""
    key = _override_key(override)
    cls: Any = schema
    for part in (key or "").split("."):
        if not (isinstance(cls, type) and dataclasses.is_dataclass(cls)):
            return override
        found = {f.name: f for f in dataclasses.fields(cls)}.get(part)
        if found is None:
            return override
        if found.metadata.get("mapping"):
            return "++" + override.lstrip("+")
        cls = _field_types(cls)[part]
    return override


def _override_key(override: str) -> str | None:
    """The config key an override sets; None for group selections (recipe=...) and hydra.* keys."""
    body = override.lstrip("+~")
    key = body.split("=", 1)[0].strip()
    if key in ("recipe",) or key.startswith("hydra."):
        return None
    return key


# ---------------------------------------------------------------------------------------------- recipes


def available_recipes() -> list[str]:
    return sorted(
        p.name[: -len(".yaml")]
        for p in (files(CONFIG_MODULE) / "recipe").iterdir()
        if p.name.endswith(".yaml")
    )


def recipe_summaries() -> dict[str, str]:
    """Shipped recipe -> the first comment line of its YAML after the ``@package`` header (for --help)."""
    out = {}
    for name in available_recipes():
        text = (files(CONFIG_MODULE) / "recipe" / f"{name}.yaml").read_text()
        comments = [
            line.lstrip("# ").strip()
            for line in text.splitlines()
            if line.startswith("#") and "@package" not in line
        ]
        out[name] = comments[0].rstrip(":") if comments else ""
    return out


def is_recipe_path(value: str) -> bool:
    """``recipe=`` names a YAML file (``/dir/my.yaml``, ``my.yaml``) rather than a shipped recipe."""
    return value.endswith((".yaml", ".yml")) or "/" in value or os.sep in value


@contextlib.contextmanager
def _recipe_file_option(path: Path) -> Iterator[str]:
    """The recipe YAML at ``path`` as an option of the recipe group while the block runs (its name is
    yielded), with the YAMLs beside it that its defaults list names. Removed afterwards, so that a process
    that loads several configs (tests) never finds another load's files."""
    store = ConfigStore.instance()
    stored: list[str] = []
    try:
        top = _FILE_RECIPE_PREFIX + re.sub(r"[^\w.-]", "_", path.stem)  # a name Hydra's grammar reads
        _store_recipe_file(top, path, stored, shipped=set(available_recipes()))
        yield top
    finally:
        # ConfigStore has no removal API; its repo is a dict of groups, each a dict of "<name>.yaml" nodes.
        group = store.repo.get("recipe", {})
        for name in stored:
            group.pop(f"{name}.yaml", None)


def _store_recipe_file(name: str, path: Path, stored: list[str], *, shipped: set[str]) -> None:
    try:
        node = OmegaConf.load(path)
    except (OSError, OmegaConfBaseException, ValueError) as e:  # yaml's errors are ValueErrors too
        raise ConfigError(f"recipe={path}: cannot read it: {e}") from None
    if not isinstance(node, DictConfig):
        raise ConfigError(f"recipe={path}: a recipe YAML holds keys (a mapping), not a {type(node).__name__}")
    if name.startswith(_FILE_RECIPE_PREFIX) and "name" not in node:
        node.name = path.stem  # the run's name (outputs/<name>/...) unless the YAML sets one
    stored.append(name)
    # A defaults entry a shipped recipe's name is that recipe; another name is a YAML beside this one.
    for item in node.get("defaults", []):
        if isinstance(item, str) and item not in shipped and item != "_self_" and item not in stored:
            sibling = path.parent / f"{item}.yaml"
            if sibling.is_file():
                _store_recipe_file(item, sibling, stored, shipped=shipped)
    # package _global_: the YAML's keys are the config's top-level keys, as in the shipped recipes' header.
    ConfigStore.instance().store(group="recipe", name=name, node=node, package="_global_", provider=str(path))


# ---------------------------------------------------------------------------------------------- entry


def is_entry_path(entry: str) -> bool:
    """``entry`` names a Python file (``my_grpo.py``, ``dir/x.py``) rather than a shipped recipe module."""
    return entry.endswith(".py") or "/" in entry or os.sep in entry


def shipped_entries() -> list[str]:
    return sorted(
        p.name[: -len(".py")]
        for p in files(RECIPE_MODULE).iterdir()
        if p.name.endswith(".py") and not p.name.startswith("_")
    )


def import_entry(entry: str) -> ModuleType:
    """The recipe module ``entry`` names, imported once per process: a shipped recipe (``grpo``:
    spmdrl.recipes.grpo), or a Python file by absolute path (as :func:`load_config` resolves it), loaded
    under a module name of its own with its directory on sys.path (it may import the files beside it, as a
    script does). Every rank imports it. Raises ConfigError if there is none, or it has no ``main(cfg)``."""
    label = f"entry={entry!r}"
    if is_entry_path(entry):
        path = Path(entry)
        if not path.is_file():
            raise ConfigError(
                f"{label}: no such file {str(path)!r} (a relative entry starts at the recipe YAML's directory, "
                "or at the working directory when given on the command line)"
            )
        if str(path.parent) not in sys.path:
            sys.path.insert(0, str(path.parent))
        module = import_file(path, label=label)
    else:
        name = f"{RECIPE_MODULE}.{entry}"
        if not entry.isidentifier():
            raise ConfigError(
                f"{label}: a shipped recipe's name ({', '.join(shipped_entries())}) or a .py file"
            )
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as e:
            if e.name != name:
                raise
            raise ConfigError(
                f"{label}: no recipe module {name} (recipes/*.py: {', '.join(shipped_entries())}); "
                "a recipe of your own: entry=path/to/my_recipe.py"
            ) from None
    if not callable(getattr(module, "main", None)):
        raise ConfigError(f"{label}: {getattr(module, '__file__', None) or module.__name__} has no main(cfg)")
    return module


def _resolve_entry(entry: str, base: Path) -> str:
    """A shipped recipe's name as it is; a file's absolute path (relative ones start at ``base``), so the
    saved config.yaml runs from any directory."""
    if not is_entry_path(entry):
        return entry
    return str((base / Path(entry).expanduser()).resolve())


# ---------------------------------------------------------------------------------------------- loading


_stored_schema: list[Any] = [None]  # what ConfigStore holds under _SCHEMA_NAME


def _compose(overrides: list[str], schema: Any) -> DictConfig:
    # Storing converts the schema to OmegaConf (~0.1 s for Config's 200-odd fields): only when it changed.
    if _stored_schema[0] is not schema:
        ConfigStore.instance().store(name=_SCHEMA_NAME, node=schema)
        _stored_schema[0] = schema
    with initialize_config_module(config_module=CONFIG_MODULE, version_base="1.3"):
        return compose(config_name="config", overrides=overrides)


_ENTRY_ONLY = OmegaConf.create({"entry": Config.entry})


def _probe_entry(select: list[str], hydra_keys: list[str], recipe_path: Path | None) -> str:
    """The ``entry`` the recipe's YAMLs name, composed untyped (a recipe's own sections are not in the
    schema yet). A shipped recipe's files do not change while the process runs, so its answer is kept."""
    if recipe_path is None:
        return _shipped_entry(tuple(select), tuple(hydra_keys))
    return _compose_entry(select, hydra_keys, recipe_path)


@functools.cache
def _shipped_entry(select: tuple[str, ...], hydra_keys: tuple[str, ...]) -> str:
    return _compose_entry(list(select), list(hydra_keys), None)


def _compose_entry(select: list[str], hydra_keys: list[str], recipe_path: Path | None) -> str:
    try:
        probe = _compose([*select, *hydra_keys], _ENTRY_ONLY)
    except (HydraException, OmegaConfBaseException) as e:
        raise _composition_error(e, Config, recipe_path) from None
    return str(probe.entry)


def _composition_error(e: Exception, schema: type, recipe_path: Path | None) -> ConfigError:
    """Hydra's / OmegaConf's error as a ConfigError: an unknown key in a YAML with check_key's did-you-mean,
    a defaults entry that names no recipe with the recipes there are, anything else with OmegaConf's message
    (full_key / value / object_type), without the stack."""
    cause = (e.__cause__ or e.__context__ or e) if isinstance(e, HydraException) else e
    full_key = getattr(cause, "full_key", None)
    if full_key and "not in" in str(cause):
        try:
            check_key(full_key, schema)
        except ConfigError as unknown:
            where = f" (in {recipe_path} or a YAML it starts from)" if recipe_path is not None else ""
            return ConfigError(f"{unknown}{where}")
        if "not in struct" in str(cause):  # a new key of a mapping (reasoning_gym.config.<task>): Hydra's +
            return ConfigError(
                f"{full_key} is a new key of a mapping: on the command line add it with a leading +, "
                f"+{full_key}=<value> (a whole entry: +{full_key}={{key: value}}), or set it in the recipe YAML"
            )
    missing = re.search(r"Could not load 'recipe/([^']+)'", str(e))
    if missing and recipe_path is not None:
        name, recipes = missing.group(1), available_recipes()
        close = difflib.get_close_matches(name, recipes, n=3)
        hint = f" Did you mean {' or '.join(close)}?" if close else ""
        return ConfigError(
            f"recipe={recipe_path}: its defaults list names {name!r}, which is neither a shipped recipe "
            f"({', '.join(recipes)}) nor a YAML beside it ({recipe_path.parent / name}.yaml).{hint}"
        )
    # Hydra's own message, or (an override that did not merge) the OmegaConf error under it.
    message = str(e.__cause__ or e) if isinstance(e, HydraException) else str(e)
    return ConfigError(f"invalid configuration: {message.strip()}")


def _quoted(value: str) -> str:
    """``value`` as one quoted string of Hydra's override grammar (a path may hold spaces, ``=`` or ``,``).
    In it a backslash escapes only a quote, or the backslashes before one: those are doubled, then the
    quotes escaped."""
    body = re.sub(r"(\\*)('|$)", lambda m: m.group(1) * 2 + ("\\'" if m.group(2) else ""), value)
    return f"'{body}'"


def _to_config(obj: Config) -> Config:
    """OmegaConf's object of the schema class -> a Config holding the sections in ``sections``."""
    if type(obj) is Config:
        return obj
    values = {f.name: getattr(obj, f.name) for f in dataclasses.fields(Config) if f.name != "sections"}
    return Config(**values, sections={name: getattr(obj, name) for name in CONFIG_SECTIONS})


def _split_overrides(overrides: list[str]) -> tuple[str | None, str | None, list[str]]:
    """The command line's ``recipe=`` and ``entry=`` values (the last of each, None if absent) and the
    other overrides, after checking that each argument is an override."""
    for ov in overrides:
        if "=" not in ov and not ov.startswith("~"):
            raise ConfigError(
                f"cannot parse argument '{ov}': overrides look like key=value (for example optim.lr=1e-5); "
                "python -m spmdrl.train --help lists the recipes and options"
            )
    recipe, entry, rest = None, None, []
    for ov in overrides:
        key, _, value = ov.partition("=")
        if key == "recipe":
            recipe = value
        elif key.lstrip("+") == "entry":
            entry = value
        else:
            rest.append(ov)
    return recipe, entry, rest


def _recipe_file(recipe: str | None) -> Path | None:
    """The YAML file ``recipe=`` names, absolute; None for a shipped recipe (checked to exist) or none."""
    if recipe is not None and is_recipe_path(recipe):
        path = Path(recipe).expanduser().resolve()
        if not path.is_file():
            raise ConfigError(f"recipe={recipe}: no such file {str(path)!r}")
        return path
    if recipe is not None and recipe not in available_recipes():
        recipes = available_recipes()
        close = difflib.get_close_matches(recipe, recipes, n=3)
        hint = f" Did you mean {' or '.join(close)}?" if close else ""
        raise ConfigError(
            f"unknown recipe '{recipe}'.{hint} Available recipes: {', '.join(recipes)}; "
            "or a YAML file: recipe=path/to/my_recipe.yaml"
        )
    return None


def _check_known_keys(overrides: list[str], schema: type) -> None:
    """check_key for each override whose top-level name is a section (or field) of ``schema``."""
    top = set(_field_types(schema))
    for ov in overrides:
        key = _override_key(ov)
        if key is not None and key.split(".", 1)[0] in top:
            check_key(key, schema)


def _is_schema_key(key: str) -> bool:
    try:
        check_key(key, schema_class())
    except ConfigError:
        return False
    return True


def _translate_verl_keys(overrides: list[str]) -> list[str]:
    """verl's names of spmdrl's settings rewritten to spmdrl's (spmdrl/verl_keys.py), the mapping logged once."""
    rewritten, applied = translate(overrides, _is_schema_key)
    log_applied(applied)
    return rewritten


def load_config(overrides: list[str], *, import_entry_module: bool = True) -> Config:
    """Composes configs/config.yaml + the selected recipe + command-line overrides into a Config.

    ``recipe=`` is a shipped recipe's name or a YAML file's path (relative to the working directory).
    ``import_entry_module=False``: the caller is the recipe (a forked recipe run as a script, through
    spmdrl.train.run_recipe), already imported, so ``entry`` is not imported again."""
    recipe, cli_entry, rest = _split_overrides(overrides)
    rest = _translate_verl_keys(rest)
    recipe_path = _recipe_file(recipe)
    with contextlib.ExitStack() as stack:
        select = []
        if recipe_path is not None:
            select = [f"recipe={stack.enter_context(_recipe_file_option(recipe_path))}"]
        elif recipe is not None:
            select = [f"recipe={recipe}"]
        hydra_keys = [ov for ov in rest if _override_key(ov) is None]

        # 1. The recipe's YAMLs alone, untyped (a recipe's own sections are not in the schema yet): its entry.
        entry = cli_entry if cli_entry is not None else _probe_entry(select, hydra_keys, recipe_path)
        base = recipe_path.parent if recipe_path is not None and cli_entry is None else Path.cwd()
        entry = _resolve_entry(entry, base)

        # A misspelled key fails before the entry's import (torch, transformers: seconds), in every section
        # the schema has already: the built-in ones stay closed. A key under another name may be a section
        # the entry registers; it is checked in step 3.
        _check_known_keys(rest, schema_class())

        # 2. The entry registers its config sections and the functions it names (policy losses, ...).
        module = import_entry(entry) if import_entry_module else None
        schema = schema_class()

        # 3. Everything, typed.
        for ov in rest:
            key = _override_key(ov)
            if key is not None:
                check_key(key, schema)
        rest = [_assign_mapping(ov, schema) for ov in rest]
        try:
            composed = _compose([*select, *rest, f"entry={_quoted(entry)}"], schema)
            obj = OmegaConf.to_object(composed)
        except (HydraException, OmegaConfBaseException) as e:
            raise _composition_error(e, schema, recipe_path) from None
    assert isinstance(obj, Config)
    cfg = _to_config(obj)
    validate(cfg)
    # 4. What only the recipe knows: a setting it would not run (a critic under a recipe without one) is
    #    an error at load, not ignored. A recipe says so in an optional check_config(cfg).
    check = getattr(module, "check_config", None)
    if check is not None:
        check(cfg)
    if cfg.warmstart.enabled:
        cfg = _with_warmstart_entry(cfg, recipe_path.parent if recipe_path is not None else Path.cwd())
    return cfg


def _with_warmstart_entry(cfg: Config, base: Path) -> Config:
    """warmstart.entry resolved as ``entry`` is, and checked at load: the recipe must have train_sft."""
    ws = dataclasses.replace(cfg.warmstart, entry=_resolve_entry(cfg.warmstart.entry, base))
    try:
        module = import_entry(ws.entry)
    except ConfigError as e:
        raise ConfigError(f"warmstart.{e}") from None  # import_entry's message starts with "entry=..."
    if not callable(getattr(module, "train_sft", None)):
        raise ConfigError(
            f"warmstart.entry={cfg.warmstart.entry!r}: {getattr(module, '__file__', None) or module.__name__} "
            "has no train_sft(run, cfg, stage) (spmdrl/supervised/sft.py shows its signature); "
            "warmstart.entry=sft runs the shipped one"
        )
    return dataclasses.replace(cfg, warmstart=ws)


def to_yaml(cfg: Config) -> str:
    """The config as YAML, the recipes' sections as top-level keys: a run's config.yaml, which loads again
    (``recipe=<output_dir>/config.yaml``) to the same Config."""
    tree = OmegaConf.to_container(OmegaConf.structured(cfg))
    assert isinstance(tree, dict)
    for name, section in cfg.sections.items():
        tree[name] = OmegaConf.to_container(OmegaConf.structured(section))
    return OmegaConf.to_yaml(tree)
