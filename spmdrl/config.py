"""The job's typed configuration: the one :class:`Config` the loader builds, composed of the sections the
packages own, and :func:`validate`, which checks it at load.

Each section's dataclass, with its defaults and the checks of its values alone, lives in the package that
reads it: ``model`` in spmdrl/models/config.py, ``data`` in spmdrl/data/config.py, ``rollout`` in
spmdrl/rollout/config.py, ``algorithm`` and ``teacher`` in spmdrl/algos/config.py, ``reward`` and ``reward_model`` in
spmdrl/rewards/config.py, ``logging`` in spmdrl/logging/config.py, ``parallel`` in
spmdrl/distributed/config.py; ``trainer``, ``optim``, ``critic`` and ``warmstart`` in
spmdrl/trainer_config.py. Every default lives there, nowhere else (no ``cfg.get(key, default)`` in the
code). This module holds what spans sections: the root, the recipes' own sections
(:func:`register_config_section`, spmdrl/config_section.py) and the checks between sections. Values that
follow from others (per-rank batch sizes, steps per epoch) are computed once by spmdrl.derived.derive.

Every name above is importable from here too (``from spmdrl.config import RolloutConfig``), as it always
was; within spmdrl, code imports a section from the module that owns it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, TypeVar

from spmdrl.algos.config import (
    AlgorithmConfig,
    FilterGroupsConfig,
    KLCtrlConfig,
    RolloutCorrectionConfig,
    TeacherConfig,
)
from spmdrl.config_section import (
    CONFIG_SECTIONS,
    SWITCH_MODES,
    choice,
    register_config_section,
    registered,
    switch_mode,
)
from spmdrl.data.config import DataConfig
from spmdrl.derived import Derived, RLDerived, derive, derive_rl, max_sequence_length
from spmdrl.distributed.config import ParallelConfig

# Defined in spmdrl.errors (importable without this module); every config check raises it.
from spmdrl.errors import ConfigError
from spmdrl.logging.config import LoggingConfig
from spmdrl.models.config import AC_MODES, FUSED_AUTO_MIN_VOCAB, LoraConfig, ModelConfig, ac_mode
from spmdrl.rewards.config import (
    JUDGE_TEMPLATE,
    JudgeConfig,
    OverlongBufferConfig,
    RewardConfig,
    RewardModelConfig,
)
from spmdrl.rollout.config import CPU_GEMM_PATHS, MultiTurnConfig, RolloutConfig
from spmdrl.trainer_config import AUTO_TOKENS, CriticConfig, OptimConfig, TrainerConfig, WarmstartConfig

__all__ = [
    "AC_MODES",
    "AUTO_TOKENS",
    "CONFIG_SECTIONS",
    "CPU_GEMM_PATHS",
    "FUSED_AUTO_MIN_VOCAB",
    "JUDGE_TEMPLATE",
    "SWITCH_MODES",
    "AlgorithmConfig",
    "Config",
    "ConfigError",
    "CriticConfig",
    "DataConfig",
    "Derived",
    "FilterGroupsConfig",
    "JudgeConfig",
    "KLCtrlConfig",
    "LoggingConfig",
    "LoraConfig",
    "ModelConfig",
    "MultiTurnConfig",
    "OptimConfig",
    "OverlongBufferConfig",
    "ParallelConfig",
    "RLDerived",
    "RewardConfig",
    "RewardModelConfig",
    "RolloutConfig",
    "RolloutCorrectionConfig",
    "TeacherConfig",
    "TrainerConfig",
    "WarmstartConfig",
    "ac_mode",
    "choice",
    "derive",
    "derive_rl",
    "max_sequence_length",
    "register_config_section",
    "registered",
    "switch_mode",
    "validate",
]

T = TypeVar("T")


def _registered_sections() -> dict[str, Any]:
    return {name: cls() for name, cls in CONFIG_SECTIONS.items()}


@dataclass
class Config:
    # The recipe config's name (what recipe= selected; a recipe YAML given by path: its file name unless
    # it sets name) and what it runs: a shipped recipe module (spmdrl.recipes.<entry>) or a Python file's
    # absolute path (config_loader.import_entry).
    name: str = "sft_tiny"
    entry: str = "sft"
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    warmstart: WarmstartConfig = field(default_factory=WarmstartConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    reward_model: RewardModelConfig = field(default_factory=RewardModelConfig)
    # On-policy distillation's teacher (teacher.path "": none).
    teacher: TeacherConfig = field(default_factory=TeacherConfig)
    # The registered sections' values (register_config_section), by key. Not a key itself: each section is
    # a top-level key of the YAML and the command line, which the loader adds to the schema it composes.
    sections: dict[str, Any] = field(
        default_factory=_registered_sections, metadata={"omegaconf_ignore": True}
    )

    def section(self, cls: type[T]) -> T:
        """The values of the section ``cls`` is registered as, typed as ``cls`` (no string key to repeat)."""
        name = next((n for n, c in CONFIG_SECTIONS.items() if c is cls), None)
        if name is None:
            raise KeyError(
                f"{cls.__qualname__} is not a registered config section: decorate it with "
                '@register_config_section("my_section")'
            )
        if name not in self.sections:
            raise KeyError(
                f"this Config has no section {name!r}: it was built before {name!r} was registered"
            )
        return self.sections[name]


def _check_choice(key: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ConfigError(f"{key}={value!r} is not one of {', '.join(choices)}")


def _check_registered(key: str, value: str, module: str, registry: str) -> None:
    """``value`` names a function of the registry: a registered name, or an import path that imports and
    takes the kind's arguments (spmdrl.registry.Registry.get raises the ConfigError)."""
    import importlib

    getattr(importlib.import_module(module), registry).get(value, key=key)


def _check_choices(node: Any, prefix: str) -> None:
    for f in dataclasses.fields(node):
        value = getattr(node, f.name)
        if dataclasses.is_dataclass(value):
            _check_choices(value, f"{prefix}{f.name}.")
        elif "choices" in f.metadata:
            choices = f.metadata["choices"]
            _check_choice(f"{prefix}{f.name}", value, choices() if callable(choices) else choices)
        elif "registry" in f.metadata:
            _check_registered(f"{prefix}{f.name}", value, *f.metadata["registry"])


def _check_across_sections(cfg: Config) -> None:
    """The checks of a value against another section's: timeouts against trainer.collective_timeout_min,
    the token budgets against the longest sequence, the async settings against parallel.placement."""
    t = cfg.trainer
    limit_s = t.collective_timeout_min * 60
    if cfg.reward.batch_timeout_s >= limit_s:
        raise ConfigError(
            f"reward.batch_timeout_s={cfg.reward.batch_timeout_s} must stay below trainer.collective_timeout_min="
            f"{t.collective_timeout_min} minutes: the other ranks wait in a collective while a rank "
            "scores, and a slow reward must be named as such, not as a collective timeout"
        )
    longest = max_sequence_length(cfg)
    for key in ("ppo_max_token_len_per_gpu", "log_prob_max_token_len_per_gpu"):
        value = getattr(t, key)
        if 0 < value < longest:
            raise ConfigError(
                f"trainer.{key}={value} is smaller than one sequence of the longest length, {longest} tokens "
                "(rollout.max_model_len, or data.max_prompt_length + data.max_response_length); set it to at "
                f"least {longest}, {AUTO_TOKENS} to size it from the GPU's memory, or 0 for micro_batch_size "
                "sequences"
            )
    _check_async(cfg)
    ob = cfg.reward.overlong_buffer
    if ob.enable and not (0 < ob.len <= cfg.data.max_response_length and ob.penalty_factor >= 0):
        raise ConfigError(
            f"reward.overlong_buffer.len={ob.len} must be in (0, data.max_response_length="
            f"{cfg.data.max_response_length}] and penalty_factor={ob.penalty_factor} >= 0"
        )
    mt = cfg.rollout.multi_turn
    if mt.enable and (mt.rollout_deadline_s >= limit_s or mt.tool_timeout_s >= limit_s):
        raise ConfigError(
            f"rollout.multi_turn.rollout_deadline_s={mt.rollout_deadline_s} and tool_timeout_s={mt.tool_timeout_s} "
            f"must stay below trainer.collective_timeout_min={t.collective_timeout_min} minutes: the "
            "other ranks wait in the next collective while a rank finishes its rollout"
        )
    _check_reward_model_placement(cfg)
    _check_teacher_placement(cfg.teacher, cfg.parallel, cfg.model, cfg.reward_model)


def _check_teacher_placement(
    teacher: TeacherConfig, parallel: ParallelConfig, model: ModelConfig, reward_model: RewardModelConfig
) -> None:
    """On-policy distillation: where the teacher may run, and what its own ranks (parallel.teacher_ranks)
    do not run yet."""
    if teacher.enabled and parallel.placement != "colocated":
        raise ConfigError(
            f"teacher.path={teacher.path} scores the actor's rows on the actor's ranks or on ranks of its own next "
            f"to a colocated actor, which needs parallel.placement=colocated (entry: grpo, as in "
            f"recipe=opd_tiny); got parallel.placement={parallel.placement}"
        )
    if not (teacher.enabled and parallel.teacher_ranks):
        return
    own = f"parallel.teacher_ranks={parallel.teacher_ranks} (the teacher on ranks of its own)"
    if model.lora.enabled:
        raise ConfigError(
            f"{own} with model.lora (rank {model.lora.rank}) is not supported yet: the teacher's ranks would "
            "serve the merged adapters by the actor's broadcast, which is untested; set model.lora.rank=0, or "
            "parallel.teacher_ranks=0 (the teacher sharded over the actor's ranks)"
        )
    if reward_model.enable or reward_model.judge.enable:
        raise ConfigError(
            f"{own} with reward_model.enable / reward_model.judge.enable is not supported: the reward model "
            "scores on the actor's ranks, and the teacher's ranks generate samples too; turn the reward model "
            "off, or set parallel.teacher_ranks=0 (the teacher sharded over the actor's ranks)"
        )


def _check_async(cfg: Config) -> None:
    """The settings of parallel.placement=async (staleness, partial rollouts) under any other placement, and
    a parity gate where the engine samples from an older policy."""
    t, placement = cfg.trainer, cfg.parallel.placement
    if cfg.parallel.rollout_ranks < 0 or t.max_staleness < 0:
        raise ConfigError(
            f"parallel.rollout_ranks (0 = half the world) and trainer.max_staleness must be >= 0, got "
            f"{cfg.parallel.rollout_ranks} and {t.max_staleness}"
        )
    if t.max_staleness > 0 and placement != "async":
        raise ConfigError(
            f"trainer.max_staleness={t.max_staleness} applies to parallel.placement=async only (entry "
            f"grpo_async, recipe=grpo_async_tiny); with parallel.placement={placement} every batch is "
            "generated by the policy it trains: set trainer.max_staleness=0"
        )
    if t.stale_policy != "drop" and placement != "async":
        raise ConfigError(
            f"trainer.stale_policy={t.stale_policy} applies to parallel.placement=async only; with "
            f"parallel.placement={placement} no batch is ever stale: remove the setting"
        )
    r = cfg.rollout
    if r.partial != "off" and (placement != "async" or t.max_staleness < 1):
        raise ConfigError(
            f"rollout.partial={r.partial} interrupts a generation when the next weights arrive, which "
            "happens only with parallel.placement=async and trainer.max_staleness >= 1 (got "
            f"parallel.placement={placement}, trainer.max_staleness={t.max_staleness}): "
            "set rollout.partial=off, or run recipe=grpo_async_tiny with trainer.max_staleness >= 1"
        )
    if r.parity_tol != 0 and t.max_staleness > 0:
        raise ConfigError(
            f"rollout.parity_tol={r.parity_tol} compares the trainer's logprobs with the engine's for the same "
            f"weights, but with trainer.max_staleness={t.max_staleness} the engine samples from a policy "
            "up to that many versions old, so they differ by design: set rollout.parity_tol=0, or "
            "trainer.max_staleness=0 for a parity run"
        )


def _check_reward_model_placement(cfg: Config) -> None:
    """Where a reward model or judge may run, by parallel.placement."""
    rm, judge, placement = cfg.reward_model, cfg.reward_model.judge, cfg.parallel.placement
    if rm.placement == "separate" and (rm.enable or judge.enable) and placement != "async":
        raise ConfigError(
            f"reward_model.placement=separate puts the reward model on the rollout ranks of "
            f"parallel.placement=async, but parallel.placement={placement}: set parallel.placement=async "
            "(entry: grpo_async, as in recipe=grpo_async_tiny), or reward_model.placement=colocated (every "
            "rank holds the reward model sharded with FSDP2 and scores its own samples)"
        )
    if (rm.enable or judge.enable) and placement not in ("colocated", "async"):
        raise ConfigError(
            "reward_model.enable / reward_model.judge.enable need parallel.placement=colocated (every rank "
            "scores the samples it generated) or async (the rollout ranks score); got "
            f"parallel.placement={placement}"
        )


def validate(cfg: Config) -> None:
    """Checks that need no world size. Raises ConfigError naming the key: first the closed choices and
    registry names of every field, then each section's own values (its ``check``), then the values of one
    section against another's."""
    _check_choices(cfg, "")
    for name, section in cfg.sections.items():  # the recipes' own sections (register_config_section)
        _check_choices(section, f"{name}.")
    cfg.trainer.check()
    cfg.data.check()
    cfg.parallel.check()
    cfg.optim.check("optim")
    cfg.rollout.check()
    cfg.model.check()
    cfg.logging.check()
    cfg.reward.check()
    cfg.reward_model.check()
    cfg.critic.check()
    cfg.algorithm.check()
    cfg.teacher.check()
    _check_across_sections(cfg)
