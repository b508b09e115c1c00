"""Loading a Python object named in a config: ``"pkg.mod:attr"``, ``"path/to/file.py:attr"``, or
verl's ``class_name`` form ``"pkg.mod.ClassName"``.

Like :func:`spmdrl.rewards.registry.load_reward_fn`, but for any config key (its errors name the
key) and for classes as well as functions. Relative file paths start at the working directory.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from spmdrl.errors import ConfigError
from spmdrl.imports import import_file, import_module_named


def load_object(spec: str, *, key: str) -> Any:
    """The object ``spec`` names; raises ConfigError (mentioning ``key``) saying what is wrong."""
    spec = spec.strip()
    target, sep, attr = spec.rpartition(":")
    if not sep and not spec.endswith(".py"):
        target, _, attr = spec.rpartition(".")  # verl's "pkg.mod.ClassName"
    if not target or not attr:
        raise ConfigError(
            f"{key} {spec!r} is not an import path: give 'my_pkg.my_mod:name', 'path/to/file.py:name' "
            "or 'my_pkg.my_mod.ClassName'"
        )
    if target.endswith(".py") or "/" in target or os.sep in target:
        module = import_file(Path(target).expanduser().resolve(), label=f"{key} {spec!r}")
    else:
        module = import_module_named(target, label=f"{key} {spec!r}")
    obj: Any = module
    for part in attr.split("."):  # "mod:Class.method"
        if not hasattr(obj, part):
            public = sorted(n for n in vars(module) if not n.startswith("_"))
            raise ConfigError(
                f"{key} {spec!r}: {target!r} has no attribute {attr!r}; its public names are: "
                f"{', '.join(public) or '(none)'}"
            )
        obj = getattr(obj, part)
    return obj
