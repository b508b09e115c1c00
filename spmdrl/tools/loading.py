"""Loading a Python object named in a config: ``"pkg.mod:attr"``, ``"path/to/file.py:attr"``, or
verl's ``class_name`` form ``"pkg.mod.ClassName"``.

Like :func:`spmdrl.rewards.registry.load_reward_fn`, but for any config key (its errors name the
key) and for classes as well as functions. Relative file paths start at the working directory.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import os
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

from spmdrl.config import ConfigError


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
        module = _import_file(spec, Path(target).expanduser().resolve(), key)
    else:
        module = _import_module(spec, target, key)
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


def _import_module(spec: str, name: str, key: str) -> ModuleType:
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as e:
        if e.name is not None and (name == e.name or name.startswith(e.name + ".")):
            raise ConfigError(
                f"{key} {spec!r}: no module named {e.name!r}; put the directory that holds it on "
                "PYTHONPATH (or install it), or give the file instead: 'path/to/file.py:name'"
            ) from e
        raise ConfigError(f"{key} {spec!r}: importing {name!r} failed: {e}") from e
    except Exception as e:
        raise ConfigError(f"{key} {spec!r}: importing {name!r} raised {type(e).__name__}: {e}") from e


def _import_file(spec: str, path: Path, key: str) -> ModuleType:
    if not path.is_file():
        raise ConfigError(
            f"{key} {spec!r}: no such file {str(path)!r} (relative paths start at the working directory)"
        )
    # One module per file, run once per process: several tools from one file share its globals.
    digest = hashlib.sha1(str(path).encode()).hexdigest()[:10]
    mod_name = f"_spmdrl_tool_{path.stem}_{digest}"
    if mod_name in sys.modules:
        return sys.modules[mod_name]
    module_spec = importlib.util.spec_from_file_location(mod_name, path)
    if module_spec is None or module_spec.loader is None:
        raise ConfigError(f"{key} {spec!r}: {str(path)!r} cannot be loaded as a Python module")
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[mod_name] = module  # before running it: dataclasses look their module up there
    try:
        module_spec.loader.exec_module(module)
    except Exception as e:
        del sys.modules[mod_name]
        raise ConfigError(f"{key} {spec!r}: running {str(path)!r} raised {type(e).__name__}: {e}") from e
    return module
