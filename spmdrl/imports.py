"""Importing what a config names by path: a module by dotted name, or a Python file.

Shared by ``reward.fn`` (spmdrl.rewards.registry) and the tool specs (spmdrl.tools.loading). Errors are
ConfigErrors that start with the caller's ``label`` (the key and value at fault) and say how to fix it.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

from spmdrl.config import ConfigError


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
    mod_name = f"_spmdrl_user_{path.stem}_{digest}"
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
