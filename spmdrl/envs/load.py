"""Loading an installed verifiers environment, of either generation, into one typed object (LoadedEnv).

verifiers' two generations package an environment differently, and a module tells which it is:

- 0.3.x ("legacy", ``import verifiers as vf`` with ``vf.Environment``): the package's module has
  ``load_environment(**kwargs)`` returning an Environment (its dataset, eval_dataset, parser and Rubric;
  a ``SingleTurnEnv``, or a ``MultiTurnEnv`` whose turns spmdrl's agent loop drives turn by turn:
  spmdrl.rollout.vf_turns).
  verifiers 0.3.1 ships this API as ``verifiers.legacy``; 0.4.0 has none of it.
- 0.4 (``verifiers.v1``): the module exports (``__all__``) a ``Taskset`` subclass, configured by its
  ``TasksetConfig`` (env.args are its fields), whose tasks carry ``@vf.reward`` methods; a module that also
  exports an ``Env`` subclass, or whose tasks have toolsets, is multi-turn, and refused: a v1 ``Env`` runs
  its agents itself (its async ``run`` drives a harness that sends the model's calls over HTTP), which
  spmdrl's in-process engine could serve only through an HTTP server or a fork of verifiers.

Every failure here is a ConfigError naming env.source and the fix: verifiers not installed (the ``envs``
extra), the environment package not installed, a 0.3.x environment under a verifiers without the legacy
API, load_environment raising (its cause), arguments its config refuses.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import sys
import traceback
from dataclasses import dataclass, field
from typing import Any

from spmdrl.errors import ConfigError

log = logging.getLogger("spmdrl")

INSTALL_EXTRA = 'pip install -e ".[envs]"'
# The legacy API's release this project tests (docs/environments.md).
LEGACY_RELEASE = "0.3.1"
LEGACY = "legacy"
V1 = "v1"


@dataclass(frozen=True)
class LoadedEnv:
    """An environment loaded in this process: what the prompts, the reward and the agent loop read."""

    source: str  # env.source as configured ("verifiers:<name>")
    name: str  # the environment's name (its module: name with "-" as "_")
    generation: str  # LEGACY (0.3.x load_environment) or V1 (0.4 verifiers.v1 Taskset)
    # LEGACY: the vf.Environment load_environment returned. V1: the Taskset (its tasks are the prompts).
    env: Any
    multi_turn: bool  # turns after the first reply: a 0.3.x MultiTurnEnv (a v1 one is refused at load)
    verifiers_version: str
    args: dict[str, Any] = field(default_factory=dict)
    # V1 only: the Env subclass the module exports (None: a plain taskset, single-agent).
    env_class: type | None = None

    @property
    def data_source(self) -> str:
        """The data_source of its rows (and of validation's per-source accuracy)."""
        return f"verifiers:{self.name}"

    def describe(self) -> str:
        turns = "multi-turn" if self.multi_turn else "single-turn"
        kind = type(self.env).__name__
        return f"{self.source} ({kind}, {turns}; verifiers {self.verifiers_version}, {self.generation} API)"


def module_name(name: str) -> str:
    """The module an environment id installs as (verifiers' rule: ``owner/my-env`` -> ``my_env``)."""
    return name.split("/")[-1].split("@", 1)[0].replace("-", "_")


def load_verifiers_env(source: str, name: str, args: dict[str, Any]) -> LoadedEnv:
    """The environment ``name`` (env.source ``source``) with ``args``; ConfigError for every failure."""
    version = _require_verifiers(source)
    module = _import_env_module(source, name)
    taskset_cls, env_cls = _v1_exports(module)
    if taskset_cls is not None:
        from spmdrl.envs import v1

        taskset = v1.build_taskset(source, taskset_cls, args)
        if v1.is_multi_turn(taskset, env_cls):
            raise ConfigError(_v1_multi_turn(source, module.__name__, env_cls))
        return LoadedEnv(
            source, module.__name__, V1, taskset, v1.is_multi_turn(taskset, env_cls), version, args, env_cls
        )
    load = getattr(module, "load_environment", None)
    if not callable(load):
        raise ConfigError(
            f"env.source={source}: module {module.__name__} ({_origin(module)}) is no verifiers environment: it "
            "has no load_environment() (0.3.x) and exports no verifiers.v1 Taskset subclass in __all__ (0.4)"
        )
    if not legacy_available():
        raise ConfigError(_needs_legacy(source, module.__name__, version, "it has load_environment"))
    env = _call_load_environment(source, module, load, args)
    return _legacy_loaded(source, module.__name__, env, version, args)


def _v1_multi_turn(source: str, module: str, env_cls: type | None) -> str:
    what = f"it exports the Env {env_cls.__name__}" if env_cls is not None else "its tasks have toolsets"
    return (
        f"env.source={source}: {module} is a multi-turn verifiers 0.4 environment ({what}). A verifiers.v1 "
        "Env runs its agents itself, through a harness that takes the model's calls over HTTP, and spmdrl "
        "samples with its in-process engine and serves no HTTP endpoint, so it cannot drive those turns. "
        "Package the environment as a verifiers 0.3.x MultiTurnEnv (load_environment; spmdrl drives its "
        "turns), or use spmdrl's own tools (rollout.multi_turn.tools) with its single-turn taskset "
        "(docs/environments.md)"
    )


def legacy_available() -> bool:
    """Whether ``import verifiers as vf`` has the 0.3.x API (verifiers.legacy, 0.3.x)."""
    return importlib.util.find_spec("verifiers.legacy") is not None


def _needs_legacy(source: str, module: str, version: str, why: str) -> str:
    return (
        f"env.source={source}: {module} is a verifiers 0.3.x environment ({why}), and the installed "
        f"verifiers {version} has no 0.3.x API (only verifiers.v1). Install verifiers {LEGACY_RELEASE} beside "
        f"it (pip install --no-deps --target DIR verifiers=={LEGACY_RELEASE} aiolimiter, DIR first on "
        "PYTHONPATH; docs/environments.md), or port the environment to a verifiers.v1 Taskset"
    )


def _require_verifiers(source: str) -> str:
    try:
        import verifiers
    except ImportError as e:
        raise ConfigError(
            f"env.source={source} needs the verifiers package, which is not installed ({e}); install the "
            f"envs extra: {INSTALL_EXTRA}"
        ) from None
    return str(getattr(verifiers, "__version__", "?"))


def _import_env_module(source: str, name: str) -> Any:
    target = module_name(name)
    if importlib.util.find_spec(target) is None:
        raise ConfigError(
            f"env.source={source}: no environment package {name!r} is installed (no module {target!r} on the "
            f"path). Install it into this Python: pip install -e path/to/{name} (its directory, with its "
            f"pyproject.toml), or pip install {name} from your package index"
        )
    try:
        return importlib.import_module(target)
    except AttributeError as e:
        # `import verifiers as vf` then vf.Environment / vf.Rubric / vf.SingleTurnEnv at import time.
        if "module 'verifiers' has no attribute" in str(e) and not legacy_available():
            why = f"importing it needs vf.{e.name}" if e.name else "importing it needs vf.Environment"
            raise ConfigError(_needs_legacy(source, target, _require_verifiers(source), why)) from e
        raise ConfigError(
            f"env.source={source}: importing the environment module {target!r} failed: {_cause(e)}"
        ) from e
    except Exception as e:
        raise ConfigError(
            f"env.source={source}: importing the environment module {target!r} failed: {_cause(e)}"
        ) from e


def _v1_exports(module: Any) -> tuple[type | None, type | None]:
    """The v1 Taskset and Env subclasses ``module`` exports in ``__all__`` (None: none)."""
    if "verifiers.v1" not in sys.modules:  # the module never imported it, so it defines no v1 class
        return None, None
    from verifiers.v1 import Env, Taskset

    found: dict[type, list[type]] = {Taskset: [], Env: []}
    for attr in getattr(module, "__all__", ()):
        obj = getattr(module, attr, None)
        for base, hits in found.items():
            if isinstance(obj, type) and issubclass(obj, base) and obj is not base:
                hits.append(obj)
    for base, hits in found.items():
        if len(hits) > 1:
            raise ConfigError(
                f"module {module.__name__} exports {len(hits)} {base.__name__} subclasses "
                f"({', '.join(c.__name__ for c in hits)}); a verifiers environment exports exactly one"
            )
    return (found[Taskset] or [None])[0], (found[Env] or [None])[0]


def _call_load_environment(source: str, module: Any, load: Any, args: dict[str, Any]) -> Any:
    try:
        return load(**args)
    except Exception as e:
        shown = ", ".join(f"{k}={v!r}" for k, v in args.items())
        raise ConfigError(
            f"env.source={source}: {module.__name__}.load_environment({shown}) raised {_cause(e)} "
            f"(env.args are its keyword arguments)"
        ) from e


def _legacy_loaded(source: str, name: str, env: Any, version: str, args: dict[str, Any]) -> LoadedEnv:
    vf = importlib.import_module("verifiers.legacy")
    if not isinstance(env, vf.Environment):
        raise ConfigError(
            f"env.source={source}: load_environment() returned a {type(env).__name__}, not a verifiers "
            "Environment (vf.SingleTurnEnv, vf.MultiTurnEnv, ...)"
        )
    multi_turn = isinstance(env, vf.MultiTurnEnv) and not isinstance(env, vf.SingleTurnEnv)
    return LoadedEnv(source, name, LEGACY, env, multi_turn, version, args)


def _origin(module: Any) -> str:
    return str(getattr(module, "__file__", None) or "a namespace package")


def _cause(e: BaseException) -> str:
    """``Type: message`` and where it was raised (the innermost frame), for a one-line error."""
    frames = traceback.extract_tb(e.__traceback__)
    where = f" at {frames[-1].filename}:{frames[-1].lineno}" if frames else ""
    return f"{type(e).__name__}: {e}{where}"
