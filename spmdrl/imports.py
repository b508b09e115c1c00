"""Importing what a config names by path: a module by dotted name, or a Python file.

Shared by the registries of named functions (spmdrl.registry: ``algorithm.policy_loss=pkg.mod:fn``,
``reward.fn=path/to/file.py:fn``, ...) and the tool specs (spmdrl.tools.loading). Errors are ConfigErrors
that start with the caller's ``label`` (the key and value at fault) and say how to fix it.
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

from spmdrl.errors import ConfigError

# import_file's module names start with this: such a module cannot be imported by name in another process.
_FILE_MODULE_PREFIX = "_spmdrl_user_"


def import_module_named(name: str, *, label: str, attr: str = "name") -> ModuleType:
    """``importlib.import_module(name)``; ``attr`` is what the file form of the hint names."""
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as e:
        if e.name is not None and (name == e.name or name.startswith(e.name + ".")):
            raise ConfigError(
                f"{label}: no module named {e.name!r}; put the directory that holds it on "
                f"PYTHONPATH (or install it), or give the file instead: 'path/to/file.py:{attr}'"
            ) from e
        raise ConfigError(f"{label}: importing {name!r} failed: {e}") from e
    except Exception as e:
        raise ConfigError(f"{label}: importing {name!r} raised {type(e).__name__}: {e}") from e


def import_file(path: Path, *, label: str) -> ModuleType:
    """The module of a Python file, loaded once per process under a name derived from its path: loading
    again (a reward worker re-resolves its function every batch) would rerun the file's top level, and
    several objects named from one file share its globals."""
    if not path.is_file():
        raise ConfigError(
            f"{label}: no such file {str(path)!r} (relative paths start at the working directory)"
        )
    digest = hashlib.sha1(str(path).encode()).hexdigest()[:10]
    mod_name = f"{_FILE_MODULE_PREFIX}{path.stem}_{digest}"
    if mod_name in sys.modules:
        return sys.modules[mod_name]
    module_spec = importlib.util.spec_from_file_location(mod_name, path)
    if module_spec is None or module_spec.loader is None:
        raise ConfigError(f"{label}: {str(path)!r} cannot be loaded as a Python module")
    module = importlib.util.module_from_spec(module_spec)
    # Registered before running it: dataclasses and pickle look a module up in sys.modules.
    sys.modules[mod_name] = module
    try:
        module_spec.loader.exec_module(module)
    except Exception as e:
        del sys.modules[mod_name]
        raise ConfigError(f"{label}: running {str(path)!r} raised {type(e).__name__}: {e}") from e
    return module


def is_import_path(spec: str) -> bool:
    """Whether a config value names an object by import path (``'pkg.mod:attr'``, ``'file.py:attr'``)
    rather than by a registered name (names never hold a colon)."""
    return ":" in spec


def import_object(spec: str, *, label: str) -> tuple[Any, str]:
    """The callable that ``'my_pkg.my_mod:attr'`` or ``'path/to/file.py:attr'`` names (a relative path
    starts at the working directory), and ``spec`` with the file's path made absolute, so another process
    with another working directory finds it too."""
    target, sep, attr = spec.rpartition(":")
    if not sep or not target or not attr:
        raise ConfigError(f"{label}: expected 'my_pkg.my_mod:name' or 'path/to/file.py:name'")
    if target.endswith(".py") or "/" in target or os.sep in target:
        path = Path(target).expanduser().resolve()
        module = import_file(path, label=label)
        spec = f"{path}:{attr}"
    else:
        module = import_module_named(target, label=label, attr=attr)
    obj = getattr(module, attr, None)
    if obj is None:
        defined = sorted(
            name for name, value in vars(module).items() if callable(value) and not name.startswith("_")
        )
        raise ConfigError(
            f"{label}: module {target!r} has no attribute {attr!r}; "
            f"its public callables are: {', '.join(defined) or '(none)'}"
        )
    if not callable(obj):
        raise ConfigError(f"{label}: {attr!r} is a {type(obj).__name__}, not a function")
    return obj, spec


def import_spec_of(fn: Any) -> str:
    """The spec :func:`import_object` resolves to ``fn`` in a fresh interpreter: ``'module:qualname'``, or
    ``'/abs/file.py:qualname'`` for a function of a file loaded by :func:`import_file` or run as a script.
    Raises ValueError for a function that is not a module-level name (a lambda, a nested function)."""
    module_name = getattr(fn, "__module__", None)
    qualname = getattr(fn, "__qualname__", None)
    if not module_name or not qualname or "." in qualname or "<" in qualname:
        raise ValueError(f"{fn!r} is not a module-level function, so another process cannot import it")
    if module_name == "__main__" or module_name.startswith(_FILE_MODULE_PREFIX):
        file = getattr(sys.modules.get(module_name), "__file__", None)
        if not file:
            raise ValueError(f"{fn!r} comes from a module with no file, so another process cannot import it")
        return f"{Path(file).resolve()}:{qualname}"
    return f"{module_name}:{qualname}"
