"""What a run's inputs are checked for before anything heavy starts, on every rank and by ``--check``.

The config itself is validated when it loads (spmdrl.config_loader: keys, types, choices, and the
functions it names, reward.fn's signature among them). What the config points at is checked here, each
check cheap (no torch, no model, no row of data read):

- the data entries (data.train_files, data.val_files): each exists, has rows and holds the prompt column
  (data.prompt_key), a parquet file from its footer alone, a hub dataset from its metadata, a json
  file or a dataset directory read as the run reads it (spmdrl.data.sources). The built-in tasks' names (``tiny:train``) are
  generated files: their split names are checked. The other columns a recipe needs (RL's reward_model,
  SFT's response) and every cell are checked when the recipe loads the data;
- model.compile: a C++ compiler on the PATH (inductor builds its kernels' wrappers with one, on CPU and
  GPU alike; without it the first forward failed deep in inductor, after the engine was built);
- the model paths (model.path, critic.model_path): ``tiny``; a local directory with config.json and
  safetensors, of a supported family (spmdrl.models.families: an unsupported architecture is refused
  here, with the list of supported ones, before any process group or model); or a hub id (org/name) that is in the local hub cache, or that the hub can serve now (one
  TCP connection; none when the hub is set offline or a proxy is in use: the download then tells).

Without these a missing file or an offline hub surfaced 30-50 seconds in, after the process group, the
tiny model's build and the tokenizer, once per rank.
"""

from __future__ import annotations

import os
import shutil
import socket
import urllib.parse
from pathlib import Path

from spmdrl.config import Config
from spmdrl.data import tiny_task, tools_task
from spmdrl.data.sources import check_sources, read_options
from spmdrl.errors import ConfigError
from spmdrl.models.families import LINEAR_MODULES, check_architecture
from spmdrl.models.load import check_model_path

# A TCP connection to the hub takes milliseconds when it is reachable; a firewall that drops packets would
# otherwise hold every rank for the system's connect timeout (minutes).
_HUB_CONNECT_TIMEOUT_S = 3.0
_PROXY_VARIABLES = ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy")


def check_inputs(cfg: Config) -> list[str]:
    """Checks the data files and model paths ``cfg`` names; returns what was checked, for ``--check``'s
    line. Raises spmdrl.data.parquet.DataError (a data file) or ConfigError (a model path), each naming
    the key, the file and the fix."""
    checked = [f"data ({', '.join(check_data_files(cfg))})"]
    checked.append(check_model(cfg.model.path, "model.path"))
    if cfg.critic.model_path:
        checked.append(check_model(cfg.critic.model_path, "critic.model_path", critic=True))
    elif cfg.model.path != "tiny":
        _check_actor_as_critic(cfg)
    if cfg.model.lora.enabled:
        checked.append(check_lora_targets(list(cfg.model.lora.target_modules)))
    if cfg.model.compile:
        checked.append(check_cxx_compiler())
    if cfg.reward_model.enable:
        from spmdrl.rewards.reward_model_path import check_reward_model_dir

        check_reward_model_dir(cfg.reward_model.path)
        checked.append(f"reward_model.path={cfg.reward_model.path}")
    return checked


def check_lora_targets(names: list[str]) -> str:
    """model.lora.target_modules names linear modules every supported family has (or all-linear)."""
    unknown = sorted(set(names) - {*LINEAR_MODULES, "all-linear"})
    if unknown:
        raise ConfigError(
            f"model.lora.target_modules: {unknown} name no linear module of the supported models; their "
            f"linear modules are {list(LINEAR_MODULES)} (or use [all-linear]; the LM head is never adapted)"
        )
    return f"model.lora.target_modules={','.join(names)}"


# What inductor looks for, in its order: $CXX, then g++ (torch._inductor.cpp_builder); clang++ and c++ too.
_CXX_NAMES = ("g++", "clang++", "c++")


def check_cxx_compiler() -> str:
    """model.compile needs a C++ compiler; returns which one, or raises ConfigError naming the fix."""
    wanted = os.environ.get("CXX")
    candidates = [wanted] if wanted else list(_CXX_NAMES)
    for name in candidates:
        found = shutil.which(name)
        if found:
            return f"model.compile (C++ compiler {found})"
    where = (
        f"CXX={wanted!r} is not on the PATH" if wanted else f"none of {', '.join(_CXX_NAMES)} is on the PATH"
    )
    raise ConfigError(
        f"model.compile=true needs a C++ compiler (torch.compile's inductor builds its kernels with one), and "
        f"{where}: install one (Debian/Ubuntu: apt-get install g++), point CXX at it, or set model.compile=false"
    )


def _check_actor_as_critic(cfg: Config) -> None:
    """Without critic.model_path a critic starts from the actor's checkpoint: its family needs a
    token-classification class (Gemma 3 has none), checked when the advantage estimator needs a critic."""
    local = Path(cfg.model.path).expanduser()
    if not (local / "config.json").is_file():
        return  # a hub id: checked after the download
    from spmdrl.algos.advantages import adv_estimator

    if adv_estimator(cfg.algorithm.adv_estimator).needs_critic:
        check_architecture(local, key="model.path (the critic's start, critic.model_path unset)", critic=True)


def check_data_files(cfg: Config) -> list[str]:
    """The data entries (spmdrl.data.sources), each as cheaply as its kind allows (a parquet file's footer,
    a hub dataset's metadata): they exist, have rows and the prompt column. Returns the entries checked."""
    d = cfg.data
    names: list[str] = []
    for key, files in (("data.train_files", d.train_files), ("data.val_files", d.val_files)):
        on_disk = [f for f in files if not _builtin_task_file(f, key)]
        if on_disk:
            check_sources(on_disk, [d.prompt_key], {d.prompt_key: "data.prompt_key"}, read_options(d, key))
        names += files
    return names


def _builtin_task_file(name: str, key: str) -> bool:
    """Whether ``name`` is a built-in task's generated split (``tiny:train``); an unknown split is an error."""
    for prefix, splits in (("tiny:", tiny_task.SPLITS), (tools_task.PREFIX, tools_task.SPLITS)):
        if name.startswith(prefix):
            split = name.removeprefix(prefix)
            if split not in splits:
                raise ConfigError(
                    f"{key}: {name!r} names no split of the built-in task; use one of "
                    f"{', '.join(prefix + s for s in splits)}"
                )
            return True
    return False


def check_model(path: str, key: str, *, critic: bool = False) -> str:
    """``path`` is ``tiny``, a local model directory of a supported family (spmdrl.models.families;
    ``critic``: one a critic can be built on), or a hub id the run can get; returns a few words on which,
    for ``--check``'s line. Raises ConfigError with one line saying what to do."""
    if path == "tiny":
        return f"{key}=tiny (built in)"
    try:
        local = check_model_path(path, key=key, critic=critic)
    except FileNotFoundError as e:
        raise ConfigError(str(e)) from None
    if local is not None:
        return f"{key}={path} (a local directory)"
    from huggingface_hub import constants, try_to_load_from_cache

    cached = try_to_load_from_cache(path, "config.json")
    if isinstance(cached, str):
        check_architecture(Path(cached).parent, key=key, critic=critic)
        return f"{key}={path} (in the hub cache {constants.HF_HUB_CACHE})"
    fix = "download it where the hub is reachable and set {key} to its directory (or copy the hub cache here)"
    if constants.HF_HUB_OFFLINE:
        raise ConfigError(
            f"{key}={path} is a hub id that is not in the hub cache ({constants.HF_HUB_CACHE}), and the hub "
            f"is set offline (HF_HUB_OFFLINE); {fix.format(key=key)}"
        )
    if any(os.environ.get(v) for v in _PROXY_VARIABLES):
        return f"{key}={path} (a hub id, not cached: downloaded through the proxy at start)"
    endpoint = constants.ENDPOINT
    problem = _unreachable(endpoint)
    if problem:
        raise ConfigError(
            f"{key}={path} is a hub id that is not in the hub cache ({constants.HF_HUB_CACHE}), and the hub "
            f"({endpoint}) is unreachable ({problem}); {fix.format(key=key)}"
        )
    return f"{key}={path} (a hub id, not cached: downloaded at start)"


def _unreachable(endpoint: str) -> str | None:
    """Why a TCP connection to ``endpoint``'s host fails (None: it opens)."""
    url = urllib.parse.urlparse(endpoint)
    host, port = url.hostname or "", url.port or (443 if url.scheme == "https" else 80)
    try:
        socket.create_connection((host, port), timeout=_HUB_CONNECT_TIMEOUT_S).close()
    except OSError as e:
        return f"{type(e).__name__}: {e}"
    return None
