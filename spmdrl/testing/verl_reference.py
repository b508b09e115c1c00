"""verl 0.9.1's own algorithm code, imported from its released wheel, for the parity tests.

spmdrl re-implements verl's advantage estimators, policy losses, loss aggregation, KL terms, rollout
correction, DAPO pieces and value loss under verl's names; ``tests/unit/algos/test_verl_parity.py`` runs
verl's functions and spmdrl's on the same inputs. verl is not a dependency of spmdrl and its package cannot be
imported here (``verl/__init__.py`` imports ray through ``verl.protocol``), so this module:

1. fetches the pinned wheel once (``pip download --no-deps``, sha256 checked) and unzips it into the
   git-ignored ``.cache/verl-0.9.1/`` (:func:`fetch`; ``torchrun_scripts/setup_cpu.sh`` runs
   ``python spmdrl/testing/verl_reference.py --fetch``);
2. imports the modules the comparisons need from that tree by file location (:func:`load`):
   ``verl/trainer/ppo/core_algos.py``, ``verl/trainer/ppo/rollout_corr_helper.py``,
   ``verl/utils/torch_functional.py``, ``verl/trainer/config/algorithm.py``,
   ``verl/workers/config/actor.py`` (the real ``ActorConfig``), ``verl/workers/reward_manager/dapo.py``
   and ``verl/trainer/ppo/v1/replay_buffer.py``, with everything they import that loads with what is
   installed (torch, numpy, omegaconf, transformers) loaded for real.

Placeholders, each only for what cannot run here:

- the packages ``verl``, ``verl.utils``, ``verl.utils.profiler``, ``verl.utils.qat``, ``verl.workers.config``,
  ``verl.workers.reward_manager``, ``verl.trainer.ppo.v1``: empty packages over the wheel's folders, so
  their ``__init__`` (which import ray, vllm, the tokenizer and model stacks) never runs; their
  submodules load for real, and the few names the code takes from a package (``as_torch_index``,
  ``group_mean_std``, ``QATConfig``, ``register``) are set from the real submodules;
- ``verl.protocol`` (imports ray): :class:`DataProto`, a dict of tensors and a dict of arrays with
  verl's ``from_dict`` / ``len`` / row indexing, which is all that the loaded functions use of it;
- ``verl.workers.config.engine`` and ``verl.workers.config.model`` (the engine and Hugging Face model
  configs, whose imports need tensordict, the tokenizer stack and verl's model registry): empty config
  classes, so that ``actor.py`` and its ``ActorConfig`` / ``PolicyLossConfig`` load;
- ``tensordict`` (not installed; ``torch_functional`` imports ``TensorDict`` only as a name no called
  function uses): an empty class, registered only while verl loads;
- ``transfer_queue`` (verl's distributed sample store): ``kv_batch_get`` over the in-memory dict
  :data:`TRANSFER_QUEUE_STORE`, so ``ReplayBuffer._dapo_filtered_keys`` (verl's DAPO group filter) runs;
- ``apply_kl_penalty``, ``compute_advantage`` and ``compute_response_mask`` live in
  ``verl/trainer/ppo/ray_trainer.py``, which imports ray and verl's whole trainer: their definitions are
  read from that file and compiled alone (:func:`_functions_from_file`), over the real ``core_algos``.

No verl code is copied into this repository: it is read from the wheel at test time.
"""

from __future__ import annotations

import ast
import contextlib
import hashlib
import importlib
import os
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any, Optional

VERL_VERSION = "0.9.1"
WHEEL_NAME = f"verl-{VERL_VERSION}-py3-none-any.whl"
# PyPI's sha256 of the wheel: a different file under the cache path is refused, not tested against.
WHEEL_SHA256 = "db6e6f2a8d9d5808d9ec32d357a42319fdc6967df688ff9d9810050f49bfdd14"
# <repo>/.cache/verl-0.9.1 (git-ignored); SPMDRL_VERL_REFERENCE_DIR overrides it.
CACHE_DIR = Path(
    os.environ.get("SPMDRL_VERL_REFERENCE_DIR")
    or Path(__file__).resolve().parents[2] / ".cache" / f"verl-{VERL_VERSION}"
)
_CORE_ALGOS = Path("verl/trainer/ppo/core_algos.py")

# What the transfer_queue placeholder's kv_batch_get reads: {key: {field: value}}.
TRANSFER_QUEUE_STORE: dict[str, dict[str, Any]] = {}


class VerlUnavailable(RuntimeError):
    """The wheel is neither cached nor downloadable (no network)."""


# ---------------------------------------------------------------------------------------------- fetching


def fetch(cache_dir: Path = CACHE_DIR, timeout_s: float = 300.0) -> Path:
    """The unzipped wheel (a folder holding ``verl/``): downloaded and unzipped on the first call."""
    if (cache_dir / _CORE_ALGOS).is_file():
        return cache_dir
    cache_dir.mkdir(parents=True, exist_ok=True)
    wheel = cache_dir / WHEEL_NAME
    if not wheel.is_file():
        with tempfile.TemporaryDirectory(dir=cache_dir) as tmp:
            cmd = [
                sys.executable,
                "-m",
                "pip",
                "download",
                "-q",
                "--no-deps",
                f"verl=={VERL_VERSION}",
                "-d",
                tmp,
            ]
            try:
                done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
            except subprocess.TimeoutExpired:
                raise VerlUnavailable(f"`{' '.join(cmd)}` timed out after {timeout_s:.0f}s") from None
            if done.returncode != 0 or not (Path(tmp) / WHEEL_NAME).is_file():
                raise VerlUnavailable(
                    f"no verl {VERL_VERSION} wheel in {cache_dir} and `pip download` failed "
                    f"(exit {done.returncode}): {done.stderr.strip()[-500:]}"
                )
            (Path(tmp) / WHEEL_NAME).replace(wheel)
    digest = hashlib.sha256(wheel.read_bytes()).hexdigest()
    if digest != WHEEL_SHA256:
        raise VerlUnavailable(
            f"{wheel} has sha256 {digest}, not PyPI's {WHEEL_SHA256}: delete it and fetch again"
        )
    with zipfile.ZipFile(wheel) as zf:
        zf.extractall(cache_dir)
    return cache_dir


# ---------------------------------------------------------------------------------------------- placeholders


class _Batch(dict):
    """verl's TensorDict batch as a dict of (B, ...) tensors; ``batch_size`` as TensorDict has it."""

    @property
    def batch_size(self) -> tuple[int, ...]:
        return (len(next(iter(self.values()))),)


@dataclass
class DataProto:
    """Placeholder for ``verl.protocol.DataProto``: what the loaded functions use of it."""

    batch: _Batch = field(default_factory=_Batch)
    non_tensor_batch: dict[str, Any] = field(default_factory=dict)
    meta_info: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_dict(
        cls, tensors: dict | None = None, non_tensors: dict | None = None, meta_info: dict | None = None
    ) -> DataProto:
        return cls(_Batch(tensors or {}), dict(non_tensors or {}), dict(meta_info or {}))

    def __len__(self) -> int:
        return self.batch.batch_size[0]

    def __getitem__(self, i: int) -> DataProto:  # verl's DataProtoItem: one row of each field
        return DataProto(
            _Batch({k: v[i] for k, v in self.batch.items()}),
            {k: v[i] for k, v in self.non_tensor_batch.items()},
            self.meta_info,
        )


def _kv_batch_get(keys: list[str], partition_id: str, select_fields: list[str]) -> dict[str, list]:
    del partition_id
    return {f: [TRANSFER_QUEUE_STORE[k][f] for k in keys] for f in select_fields}


def _placeholder(name: str, path: Path | None = None, **attrs: Any) -> ModuleType:
    """A placeholder module (a package over ``path`` when given) holding ``attrs``."""
    module = ModuleType(name, f"spmdrl.testing.verl_reference placeholder for {name}")
    if path is not None:
        module.__path__ = [str(path)]
    module.__dict__.update(attrs)
    return module


def _install(module: ModuleType) -> ModuleType:
    """Registers ``module`` in sys.modules and binds it to its parent package, as an import would."""
    sys.modules[module.__name__] = module
    parent, _, child = module.__name__.rpartition(".")
    if parent in sys.modules:
        setattr(sys.modules[parent], child, module)
    return module


@contextlib.contextmanager
def _while_importing(*modules: ModuleType) -> Iterator[None]:
    """Top-level placeholders (not verl's) in sys.modules only while verl's modules import them: the
    modules that did keep their reference, and nothing else in the process sees a fake ``tensordict``."""
    saved = {m.__name__: sys.modules.get(m.__name__) for m in modules}
    sys.modules.update({m.__name__: m for m in modules})
    try:
        yield
    finally:
        for name, old in saved.items():
            if old is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = old


def _functions_from_file(path: Path, names: list[str], namespace: dict[str, Any]) -> dict[str, Any]:
    """Compiles the top-level functions ``names`` of ``path`` alone, in ``namespace`` (their globals).

    The file's own name and line numbers are kept, so tracebacks point into the wheel's source."""
    tree = ast.parse(path.read_text(), filename=str(path))
    nodes = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name in names]
    missing = set(names) - {n.name for n in nodes}
    if missing:
        raise ImportError(f"{path} has no top-level function {sorted(missing)}")
    exec(compile(ast.Module(body=nodes, type_ignores=[]), str(path), "exec"), namespace)
    return {name: namespace[name] for name in names}


# ---------------------------------------------------------------------------------------------- loading


@dataclass(frozen=True)
class VerlReference:
    """verl 0.9.1's modules and functions, as loaded by :func:`load`."""

    root: Path
    core_algos: ModuleType
    rollout_corr_helper: ModuleType
    torch_functional: ModuleType
    algorithm_config: ModuleType  # verl.trainer.config.algorithm: AlgoConfig, KLControlConfig, ...
    actor_config: ModuleType  # verl.workers.config.actor: ActorConfig, PolicyLossConfig
    dapo_reward_manager: ModuleType  # verl.workers.reward_manager.dapo
    replay_buffer: ModuleType  # verl.trainer.ppo.v1.replay_buffer
    ray_trainer: dict[str, Any]  # apply_kl_penalty, compute_advantage, compute_response_mask


_LOADED: VerlReference | None = None


def load(root: Path | None = None) -> VerlReference:
    """Imports verl's modules from the unzipped wheel at ``root`` (default: :func:`fetch`), once per process."""
    global _LOADED
    if _LOADED is not None:
        return _LOADED
    root = fetch() if root is None else root
    if "verl" in sys.modules and not (sys.modules["verl"].__doc__ or "").startswith("spmdrl"):
        raise ImportError("a real verl package is already imported; the reference loads into a clean process")
    # Imported for real before any placeholder exists, so that their own import-time probes see no fake.
    import numpy as np
    import torch
    import transformers  # noqa: F401

    src = root / "verl"
    _install(_placeholder("verl", src, DataProto=DataProto))
    _install(_placeholder("verl.protocol", DataProto=DataProto))
    _install(_placeholder("verl.utils", src / "utils"))
    with _while_importing(_placeholder("tensordict", TensorDict=type("TensorDict", (), {}))):
        torch_functional = importlib.import_module("verl.utils.torch_functional")
    groupwise = importlib.import_module("verl.utils.groupwise")
    utils = sys.modules["verl.utils"]
    utils.as_torch_index, utils.group_mean_std = groupwise.as_torch_index, groupwise.group_mean_std
    _install(_placeholder("verl.utils.profiler", src / "utils" / "profiler"))
    _install(_placeholder("verl.utils.qat", src / "utils" / "qat"))
    sys.modules["verl.utils.qat"].QATConfig = importlib.import_module("verl.utils.qat.core").QATConfig

    actor_config = _load_actor_config(src)
    core_algos = importlib.import_module("verl.trainer.ppo.core_algos")
    algorithm_config = importlib.import_module("verl.trainer.config.algorithm")

    _install(_placeholder("verl.workers.reward_manager", src / "workers" / "reward_manager"))
    registry = importlib.import_module("verl.workers.reward_manager.registry")
    sys.modules["verl.workers.reward_manager"].register = registry.register

    _install(_placeholder("verl.trainer.ppo.v1", src / "trainer" / "ppo" / "v1"))
    tq = _placeholder("transfer_queue", kv_batch_get=_kv_batch_get, KVBatchMeta=type("KVBatchMeta", (), {}))
    with _while_importing(tq):
        replay_buffer = importlib.import_module("verl.trainer.ppo.v1.replay_buffer")

    # ray_trainer.py's own imports (ray, torchdata, verl's trainer) cannot load; these are the names its
    # three functions use.
    namespace: dict[str, Any] = {
        "__name__": "verl.trainer.ppo.ray_trainer",
        "np": np,
        "torch": torch,
        "Any": Any,
        "Optional": Optional,
        "DataProto": DataProto,
        "AlgoConfig": algorithm_config.AlgoConfig,
        "core_algos": core_algos,
        "AdvantageEstimator": core_algos.AdvantageEstimator,
        "masked_mean": torch_functional.masked_mean,
    }
    _LOADED = VerlReference(
        root=root,
        core_algos=core_algos,
        rollout_corr_helper=importlib.import_module("verl.trainer.ppo.rollout_corr_helper"),
        torch_functional=torch_functional,
        algorithm_config=algorithm_config,
        actor_config=actor_config,
        dapo_reward_manager=importlib.import_module("verl.workers.reward_manager.dapo"),
        replay_buffer=replay_buffer,
        ray_trainer=_functions_from_file(
            src / "trainer" / "ppo" / "ray_trainer.py",
            ["apply_kl_penalty", "compute_advantage", "compute_response_mask"],
            namespace,
        ),
    )
    return _LOADED


def _load_actor_config(src: Path) -> ModuleType:
    """``verl/workers/config/actor.py``, the real ``ActorConfig`` / ``PolicyLossConfig``, over empty
    engine and model config classes (their modules' imports cannot load here)."""
    base_config = importlib.import_module("verl.base_config")
    importlib.import_module("verl.workers")  # an empty __init__: real
    package = _install(_placeholder("verl.workers.config", src / "workers" / "config"))
    _install(
        _placeholder("verl.workers.config.model", HFModelConfig=_empty_config("HFModelConfig", base_config))
    )
    engines = ("FSDPEngineConfig", "McoreEngineConfig", "TorchtitanEngineConfig", "VeOmniEngineConfig")
    _install(
        _placeholder("verl.workers.config.engine", **{n: _empty_config(n, base_config) for n in engines})
    )
    actor_config = importlib.import_module("verl.workers.config.actor")
    package.ActorConfig, package.PolicyLossConfig = actor_config.ActorConfig, actor_config.PolicyLossConfig
    return actor_config


def _empty_config(name: str, base_config: ModuleType) -> type:
    return dataclass(type(name, (base_config.BaseConfig,), {"__doc__": f"placeholder for verl's {name}"}))


if __name__ == "__main__":
    # torchrun_scripts/setup_cpu.sh: python spmdrl/testing/verl_reference.py --fetch
    if sys.argv[1:] != ["--fetch"]:
        raise SystemExit("usage: python spmdrl/testing/verl_reference.py --fetch")
    print(f"verl {VERL_VERSION} reference: {fetch()}")
