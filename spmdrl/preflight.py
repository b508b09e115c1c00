"""What a run's inputs are checked for before anything heavy starts, on every rank and by ``--check``.

The config itself is validated when it loads (spmdrl.config_loader: keys, types, choices, and the
functions it names, reward.fn's signature among them). What the config points at is checked here, each
check cheap (no model; of the data, its footers and the reward's columns alone):

- the data entries (data.train_files, data.val_files): each exists, has rows and holds the prompt column
  (data.prompt_key), a parquet file from its footer alone, a hub dataset from its metadata, a json file or
  a dataset directory read as the run reads it (spmdrl.data.sources). The built-in tasks' names
  (``tiny:train``) are generated files: their split names are checked. An RL recipe's reward columns are
  checked below; SFT's response column and every cell are checked when the recipe loads the data;
- model.compile: a C++ compiler on the PATH (inductor builds its kernels' wrappers with one, on CPU and
  GPU alike; without it the first forward failed deep in inductor, after the engine was built);
- the model paths (model.path, critic.model_path): ``tiny``; a local directory with config.json and
  safetensors, of a supported family (spmdrl.models.families: an unsupported architecture is refused
  here, with the list of supported ones, before any process group or model); or a hub id (org/name) that is in the local hub cache, or that the hub has (one
  model_info request, after a TCP connection without a proxy; an error when the hub is set offline or
  unreachable, a note on the ok line when it did not answer);
- an RL recipe's start (spmdrl.preflight_start): the reward's columns and data sources, reward.fn, the
  engine's release, and the placement and batch arithmetic where the world size is known.

Without these a missing file or an offline hub surfaced 30-50 seconds in, after the process group, the
tiny model's build and the tokenizer, once per rank.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

from spmdrl import hub_probe
from spmdrl.config import Config
from spmdrl.data import reasoning_gym_task, tiny_shapes_task, tiny_task, tools_task
from spmdrl.data.config import DataConfig
from spmdrl.data.parquet import DataError
from spmdrl.data.sources import check_sources, read_options, resolve_entry
from spmdrl.distributed.config import ParallelConfig
from spmdrl.envs.config import EnvConfig
from spmdrl.errors import ConfigError
from spmdrl.models.config import ModelConfig
from spmdrl.models.families import (
    LINEAR_MODULES,
    Family,
    check_architecture,
    check_ep,
    family_of,
    lora_on_moe_message,
)
from spmdrl.models.load import check_model_path
from spmdrl.models.tiny import BUILT_IN_MODELS, MOE_SHAPE, TINY, TINY_MOE, TINY_MOE_FAMILY_CONFIG, TINY_VL
from spmdrl.models.tiny_vl import TINY_VL_FAMILY_CONFIG
from spmdrl.preflight_start import check_rl_start, data_files
from spmdrl.rollout.config import RolloutConfig
from spmdrl.trainer_config import TrainerConfig

if TYPE_CHECKING:
    from spmdrl.rl.plan import Roles

# One model_info request (a small JSON answer); a slow hub is reported as not checked, not waited for.
_HUB_INFO_TIMEOUT_S = 10.0

# What the built-in models that are not dense text models say of their family in their config.json.
_BUILT_IN_FAMILY_CONFIGS = {TINY_MOE: TINY_MOE_FAMILY_CONFIG, TINY_VL: TINY_VL_FAMILY_CONFIG}


def check_inputs(
    cfg: Config, *, roles: Roles | None = None, world: tuple[int, str] | None = None
) -> list[str]:
    """Checks the data files and model paths ``cfg`` names, and, for an RL recipe (``roles``: its module's
    ROLES), what its start checks (spmdrl.preflight_start: the reward's columns and data sources, the
    engine's release, the plan on ``world``, (ranks, where that came from)); returns what was checked, for
    ``--check``'s line. Raises spmdrl.data.parquet.DataError (a data file) or ConfigError (the rest), each
    naming the key, the file and the fix."""
    checked = []
    # env.source replaces the data files as the prompts; an SFT warm-start still reads them.
    if not cfg.section(EnvConfig).enabled or (cfg.warmstart.enabled and cfg.warmstart.entry == "sft"):
        checked.append(f"data ({', '.join(check_data_files(cfg))})")
    checked.append(check_model(cfg.model.path, "model.path"))
    if cfg.critic.model_path:
        checked.append(check_model(cfg.critic.model_path, "critic.model_path", critic=True))
    elif cfg.model.path != TINY:
        _check_actor_as_critic(cfg)
    if cfg.parallel.ep > 1:
        checked.append(check_expert_parallel(cfg.model.path, cfg.parallel.ep, lora=cfg.model.lora.enabled))
    if is_vision_model(cfg.model.path):
        checked.append(check_vision_model(cfg.model, cfg.trainer, cfg.rollout, cfg.parallel))
    if cfg.model.lora.enabled:
        checked.append(check_lora_targets(list(cfg.model.lora.target_modules)))
        check_no_lora_on_experts(cfg.model.path)
    if cfg.model.router_replay != "disabled":
        checked.append(
            check_router_replay(cfg.model, cfg.rollout, cfg.parallel, cfg.section(EnvConfig).source)
        )
    if cfg.model.compile:
        checked.append(check_cxx_compiler())
    if cfg.teacher.enabled:
        checked.append(check_model(cfg.teacher.path, "teacher.path"))
    if cfg.reward_model.enable:
        from spmdrl.rewards.reward_model_path import check_reward_model_dir

        check_reward_model_dir(cfg.reward_model.path)
        checked.append(f"reward_model.path={cfg.reward_model.path}")
    checked += check_rl_start(cfg, roles, world)
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


def check_no_lora_on_experts(path: str) -> None:
    """LoRA wraps linear layers; a mixture of experts keeps its experts in 3-D tensors (spmdrl.models.experts),
    which it cannot adapt, and adapters on the attention alone are untested: refused for an MoE model
    (the built-in tiny-moe or a local directory; a hub id is refused when the model is built)."""
    family = _family_before_build(path)
    if family is not None and family.moe:
        raise ConfigError(lora_on_moe_message(f"model.path={path}"))


def check_expert_parallel(path: str, ep: int, *, lora: bool) -> str:
    """parallel.ep > 1 against the model: a mixture of experts whose expert count ep divides, trained without
    LoRA (the built-in tiny-moe or a local directory; a hub id is checked when the model is built, by
    spmdrl.models.expert_parallel.apply_ep). Returns a few words for ``--check``'s line."""
    if lora:
        raise ConfigError(
            f"parallel.ep={ep} with model.lora (rank > 0) is not supported: expert parallelism shards the "
            "experts' weights, which LoRA would freeze; train every weight (model.lora.rank=0) or set "
            "parallel.ep=1"
        )
    local = Path(path).expanduser() / "config.json"
    if path == TINY_MOE:
        config: dict = dict(MOE_SHAPE)
    elif path == TINY:
        config = {}
    elif local.is_file():
        check_architecture(local.parent)
        config = json.loads(local.read_text())
    else:
        return f"parallel.ep={ep} (checked against {path} when it is built)"
    # transformers 5 writes Qwen3-MoE's expert count as num_local_experts; older configs as num_experts.
    keys = ("num_local_experts", "num_experts")
    num_experts = next((config[k] for k in keys if isinstance(config, dict) and k in config), None)
    check_ep(
        num_experts if isinstance(num_experts, int) and num_experts > 0 else None, ep, f"model.path={path}"
    )
    return f"parallel.ep={ep} ({num_experts // ep} of {num_experts} experts per rank)"


def check_router_replay(
    model: ModelConfig, rollout: RolloutConfig, parallel: ParallelConfig, env_source: str
) -> str:
    """model.router_replay=r3 needs a mixture of experts (the built-in tiny-moe or a local directory; a hub
    id is checked where the model is built) and an engine that returns each token's experts: vLLM's
    single-turn generate. The routing travels with its rows wherever they move (parallel.placement=async,
    parallel.balance_tokens, parallel.teacher_ranks: spmdrl.rl.batch.pack_routed)
    (docs/models.md#router-replay-and-the-routers-metrics)."""
    key = f"model.router_replay={model.router_replay}"
    path = model.path
    local = Path(path).expanduser()
    family = None
    if path in BUILT_IN_MODELS:
        family = (
            family_of(TINY_MOE_FAMILY_CONFIG, where=f"the built-in {TINY_MOE}") if path == TINY_MOE else None
        )
        dense = path != TINY_MOE
    elif (local / "config.json").is_file():
        family = check_architecture(local)
        dense = family is None or not family.moe
    else:
        dense = False  # a hub id: spmdrl.rl.job checks the built model
    if dense:
        raise ConfigError(
            f"{key}: model.path={path} is a dense model ({family.name if family else 'no experts'}), and router "
            "replay replays the experts a mixture of experts routed each token to; set "
            "model.router_replay=disabled, or train a mixture of experts (model.path=tiny-moe, a Qwen3-MoE)"
        )
    unsupported = []
    if rollout.multi_turn.enable:
        unsupported.append("rollout.multi_turn.enable (the agent loop's engine calls return no routing)")
    if env_source:
        unsupported.append(f"env.source={env_source} (untested with router replay)")
    if rollout.partial != "off":
        unsupported.append(f"rollout.partial={rollout.partial} (interruptible generation returns no routing)")
    if rollout.model_runner == "v1":
        unsupported.append(
            "rollout.model_runner=v1 (vLLM returns routed experts with its Model Runner V2 only; on CUDA use "
            "rollout.model_runner=auto or v2)"
        )
    if unsupported:
        raise ConfigError(
            f"{key} is not supported with {'; '.join(unsupported)}. Change those settings, or set "
            "model.router_replay=disabled"
        )
    return key


def is_vision_model(path: str) -> bool:
    """Whether ``path`` (the built-in tiny-vl or a local directory) is a vision-language model; a hub id is
    checked when the model is built."""
    family = _family_before_build(path)
    return family is not None and family.vision


def _family_before_build(path: str) -> Family | None:
    """The family of model.path ``path`` before it is built: a built-in model's from what its config.json
    says (the dense tiny models': None), a local directory's from its config.json; None for a hub id (checked
    when the model is built)."""
    if path in _BUILT_IN_FAMILY_CONFIGS:
        return family_of(_BUILT_IN_FAMILY_CONFIGS[path], where=f"the built-in {path}")
    local = Path(path).expanduser()
    if path in BUILT_IN_MODELS or not (local / "config.json").is_file():
        return None
    return check_architecture(local)


def check_vision_model(
    model: ModelConfig, trainer: TrainerConfig, rollout: RolloutConfig, parallel: ParallelConfig
) -> str:
    """What a vision-language model does not support yet, refused at start (docs/models.md#vision-language-models):
    packed micro-batches (packing reorders the rows, whose images fill their image tokens in row order),
    LoRA (its target names match the vision tower's layers too), partial rollouts, and the split placement
    (PPO's critic on ranks of its own: a VLM has no critic class). Where rows move between ranks after the
    rollout (parallel.placement=async, parallel.balance_tokens, parallel.teacher_ranks) each row's images
    move with it (spmdrl.rl.batch.pack_images). Multi-turn rollouts run, with image prompts and tools that
    return images (spmdrl.rollout.agent_loop)."""
    where = f"model.path={model.path} is a vision-language model"
    why = "(docs/models.md#vision-language-models)"
    if trainer.pack_sequences:
        raise ConfigError(
            f"trainer.pack_sequences=true: {where}, whose rows are not packed yet (packing reorders the rows, and "
            f"their images fill the image tokens in row order); set trainer.pack_sequences=false {why}"
        )
    if model.lora.enabled:
        raise ConfigError(
            f"model.lora: {where}, and LoRA on one is not supported yet; set model.lora.rank=0 {why}"
        )
    if rollout.partial != "off":
        raise ConfigError(f"rollout.partial={rollout.partial}: {where}; set rollout.partial=off {why}")
    if parallel.placement == "split":
        raise ConfigError(
            f"parallel.placement=split: {where}, and the split placement puts PPO's critic on ranks of its own, "
            f"which a VLM has no critic class for; set parallel.placement=colocated {why}"
        )
    return f"{where} (images: the data's images column)"


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
    builtin = cfg.model.path in _BUILT_IN_FAMILY_CONFIGS
    if not builtin and not (local / "config.json").is_file():
        return  # a hub id: checked after the download
    from spmdrl.algos.advantages import adv_estimator

    if adv_estimator(cfg.algorithm.adv_estimator).needs_critic:
        key = "model.path (the critic's start, critic.model_path unset)"
        if builtin:
            family_of(
                _BUILT_IN_FAMILY_CONFIGS[cfg.model.path],
                where=f"the built-in {cfg.model.path}",
                key=key,
                critic=True,
            )
        else:
            check_architecture(local, key=key, critic=True)


def check_data_files(cfg: Config) -> list[str]:
    """The data entries (spmdrl.data.sources), each as cheaply as its kind allows (a parquet file's footer,
    a hub dataset's metadata): they exist, have rows and the prompt column. Returns the entries checked."""
    d = cfg.data
    names: list[str] = []
    lists = {"data.train_files": d.train_files, "data.val_files": d.val_files}
    reasoning_gym_task.check_entries(lists, cfg.section(reasoning_gym_task.ReasoningGymConfig))
    for key, files in lists.items():
        on_disk = [f for f in files if not _builtin_task_file(f, key)]
        if on_disk:
            check_sources(on_disk, [d.prompt_key], {d.prompt_key: "data.prompt_key"}, read_options(d, key))
        names += files
    return names


def _builtin_task_file(name: str, key: str) -> bool:
    """Whether ``name`` is a built-in task's generated split (``tiny:train``); an unknown split is an error.
    A reasoning-gym task's entry is generated too (checked by reasoning_gym_task.check_entries)."""
    if reasoning_gym_task.is_entry(name):
        return True
    for prefix, splits in (
        ("tiny:", tiny_task.SPLITS),
        (tools_task.PREFIX, tools_task.SPLITS),
        (tiny_shapes_task.PREFIX, tiny_shapes_task.SPLITS),
    ):
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
    """``path`` is ``tiny``, a packaged model whose package is installed, a local model directory of a supported family (spmdrl.models.families;
    ``critic``: one a critic can be built on), or a hub id the run can get; returns a few words on which,
    for ``--check``'s line. Raises ConfigError with one line saying what to do."""
    if path in BUILT_IN_MODELS:
        return f"{key}={path} (built in)"
    from spmdrl.models import packaged

    if packaged.is_packaged(path):
        packaged.gguf_path(path, key=key)  # installed, or a ConfigError naming the install command
        return f"{key}={path} (packaged in {packaged.PACKAGED_MODELS[path].distribution})"
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
    endpoint = constants.ENDPOINT
    # Through a proxy a direct connection proves nothing: the hub is asked through it (httpx reads the
    # proxy variables), and a failure there is reported as not checked.
    if not hub_probe.behind_proxy():
        problem = hub_probe.unreachable(endpoint)
        if problem:
            raise ConfigError(
                f"{key}={path} is a hub id that is not in the hub cache ({constants.HF_HUB_CACHE}), and the "
                f"hub ({endpoint}) is unreachable ({problem}); {fix.format(key=key)}"
            )
    return check_hub_repo(path, key, endpoint)


def check_hub_repo(path: str, key: str, endpoint: str) -> str:
    """The hub at ``endpoint`` has the model repository ``path`` (one model_info request, with a short
    timeout): a misspelled id is refused here rather than by the download at start. Returns a few words for
    ``--check``'s line, saying so when the hub could not be asked."""
    from huggingface_hub import HfApi
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError

    try:
        HfApi(endpoint=endpoint).model_info(path, timeout=_HUB_INFO_TIMEOUT_S)
    except GatedRepoError:  # a subclass of RepositoryNotFoundError: it exists
        return f"{key}={path} (a gated hub repository: the download at start needs access, HF_TOKEN)"
    except RepositoryNotFoundError:
        raise ConfigError(
            f"{key}={path}: the hub ({endpoint}) has no model repository {path!r}, or it is private and no "
            "token is set; check the id (org/name, as on the model's hub page), or log in (hf auth login, "
            "or HF_TOKEN) for a private one"
        ) from None
    except Exception as e:  # noqa: BLE001 - a timeout, a server error, a proxy's refusal: not an answer
        return f"{key}={path} (a hub id, not cached; not checked on the hub: {type(e).__name__}: {e})"
    return f"{key}={path} (on the hub, not cached: downloaded at start)"


def _data_entry_exists(data: DataConfig, key: str, name: str) -> bool:
    """Whether a data entry names something that is there: a local file or directory, or a hub dataset id
    (its download is checked by --check); ``key`` is ``data.train_files[i]``."""
    try:
        resolve_entry(name, read_options(data, key.split("[", 1)[0]))
    except DataError:
        return False
    return True


def missing_inputs(cfg: Config) -> list[str]:
    """What ``cfg`` points at that is not there (yet), one line each, for ``--cfg job``, which prints the
    config anyway: the data files that do not exist, and the model paths :func:`check_model`
    refuses (a directory not made yet, a hub id neither cached nor reachable)."""
    missing = [
        f"{key} {name}" for key, name in data_files(cfg.data) if not _data_entry_exists(cfg.data, key, name)
    ]
    prepare = cfg.data.prepare  # the command that makes the data, where a recipe names one
    if missing and prepare:
        missing = [f"{line} (make it with: {prepare})" for line in missing]
    for key, path in (("model.path", cfg.model.path), ("critic.model_path", cfg.critic.model_path)):
        if path:
            try:
                check_model(path, key)
            except ConfigError as e:
                missing.append(str(e))
    return missing
