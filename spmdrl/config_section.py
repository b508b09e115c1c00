"""What a config section is made of: its field kinds (a closed choice, a registry's name, an auto / true /
false switch) and the registry of the sections a recipe declares (:func:`register_config_section`).

Each package's section module (spmdrl/rollout/config.py, ...) builds on this one and spmdrl.errors only,
never on spmdrl.config: that module composes every section into the one Config, so it sits above them all.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import field
from typing import Any, TypeVar

T = TypeVar("T")


def choice(default: str, choices: tuple[str, ...] | Callable[[], tuple[str, ...]]) -> Any:
    """A string field with a closed set of values, declared once, next to the field.

    ``choices`` is a tuple, or a function returning the names of a registry (``spmdrl.algos`` owns its
    algorithms' names; importing it lazily keeps the section modules light). spmdrl.config.validate checks
    every such field. (OmegaConf has no Literal type, and its Enum fields match member names, which cannot
    hold verl's hyphenated names such as ``token-mean``.)
    """
    return field(default=default, metadata={"choices": choices})


def registry_names(module: str, name: str) -> Callable[[], tuple[str, ...]]:
    """The names in ``module.name``, imported when a choice() field is checked, not when it is declared."""

    def names() -> tuple[str, ...]:
        import importlib

        return tuple(getattr(importlib.import_module(module), name))

    return names


def registered(default: str, module: str, registry: str) -> Any:
    """A string field naming a function of a registry (spmdrl.registry.Registry ``module.registry``): a
    registered name (``gspo``, or one a user's ``@register_policy_loss("my_loss")`` added), or an import
    path (``my_pkg.losses:my_loss``, ``path/to/file.py:my_loss``). spmdrl.config.validate resolves it
    through the registry when it runs, after the recipe's entry module (and the registrations in it) is
    imported; a wrong name fails there, listing the registered ones. The registry's module is imported only
    then, which keeps the section modules light."""
    return field(default=default, metadata={"registry": (module, registry)})


def mapping() -> Any:
    """A free-form mapping field (env.args: an environment's own arguments), whose keys no schema knows.
    Typed Any with default None (read as {} by its section): OmegaConf refuses new keys in a typed dict
    field of a struct config. The loader assigns ``key={a: 1}`` on the command line whole (Hydra's ``++``)."""
    return field(default=None, metadata={"mapping": True})


# The values of an auto / true / false setting (model.use_fused_kernels, trainer.defer_grad_sync).
SWITCH_MODES = ("auto", "true", "false")


def switch_mode(value: str | bool) -> str:
    """An auto / true / false setting as one of SWITCH_MODES: a YAML or command-line boolean (which the
    string field holds as "True" / "False") is its lower-case name."""
    return str(value).lower()


# The top-level keys of spmdrl.config.Config, which no recipe section may take. Written out here because
# this module sits below spmdrl.config; tests/unit/test_config.py checks that the two agree.
BUILT_IN_KEYS = (
    "name",
    "entry",
    "model",
    "data",
    "optim",
    "parallel",
    "trainer",
    "logging",
    "rollout",
    "algorithm",
    "reward",
    "warmstart",
    "critic",
    "reward_model",
    "teacher",
    "sections",
)

# Config sections a recipe owns, by top-level key. A recipe declares the settings only it reads as a
# dataclass in its own file and registers it (@register_config_section("my_section")); the loader imports
# the recipe's entry before it builds the Config, so the YAML's my_section: block and my_section.x=1 on the
# command line are checked against that dataclass like the built-in sections (types, unknown keys), and the
# recipe reads it typed: cfg.section(MySection). Check values in the dataclass's __post_init__ (raise
# ConfigError); its choice() fields are checked by spmdrl.config.validate.
CONFIG_SECTIONS: dict[str, type] = {}


def register_config_section(name: str) -> Callable[[type[T]], type[T]]:
    """Registers a dataclass as the config section ``name`` (a top-level key: ``name.field=value``).
    Registering a name again replaces it only with the same class (a module imported twice); another class
    under a taken name, or a built-in section's name, is an error."""

    def register(cls: type[T]) -> type[T]:
        where = f"{cls.__module__}.{cls.__qualname__}"
        if not dataclasses.is_dataclass(cls):
            raise TypeError(f"@register_config_section({name!r}): {where} is not a dataclass")
        if not name.isidentifier() or name in BUILT_IN_KEYS:
            raise ValueError(
                f"@register_config_section({name!r}): a section name is an identifier that is not a built-in "
                f"key of the config ({', '.join(BUILT_IN_KEYS)})"
            )
        old = CONFIG_SECTIONS.get(name)
        if old is not None and f"{old.__module__}.{old.__qualname__}" != where:
            raise ValueError(
                f"config section {name!r} is already registered, by {old.__module__}.{old.__qualname__}; "
                f"register {where} under another name"
            )
        CONFIG_SECTIONS[name] = cls
        return cls

    return register
