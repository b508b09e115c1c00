"""What an RL job will be, decided before anything is built: a pure function of the config, the world
size and the training set's size.

:func:`plan_job` places the roles on the ranks, derives the batch arithmetic of every trained role, the
settings that follow from them (whether the old logprobs get a pass of their own, where reward_model.*
scores, whether the optimizer's moments move off the GPU between updates), and runs every check that needs
nothing more. It starts no process group and builds no model: build_job (spmdrl/rl/job.py) builds what the
plan says, and ``python -m spmdrl.train recipe=... --check --world-size N`` prints the same plan, from the
recipe's own ``plan`` function, before a job is launched.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from spmdrl.algos.config import AlgorithmConfig
from spmdrl.config import Config
from spmdrl.derived import Derived, RLDerived, derive, derive_rl
from spmdrl.distributed.placement import Placement, plan_placement
from spmdrl.errors import ConfigError
from spmdrl.logging.profiler import check_profile_steps
from spmdrl.models.memory_model import check_bare_module
from spmdrl.rl.async_rows import check_async_batch
from spmdrl.rl.experience import needs_old_logprobs
from spmdrl.trainer_config import TrainerConfig
from spmdrl.trainer_config import check_val_only as check_val_only_data


@dataclass(frozen=True)
class JobPlan:
    """The job every rank will build: where each role runs and the batch arithmetic of each trained role
    (the same on every rank; computed once, logged, written to derived.json)."""

    placement: Placement
    derived: Derived  # the step's prompts per generating rank, steps
    rl: RLDerived  # the actor's update: mini- and micro-batches, token budgets
    rl_critic: RLDerived | None  # PPO's critic's (None: the job trains no critic)
    recompute_old: bool  # the old logprobs get a pass of their own (needs_old_logprobs, or async k >= 1)
    offload_optimizer: bool  # model.offload_optimizer where it applies (a CUDA trainer)
    scorer: str  # the role whose ranks score with reward_model.* (async: the rollout ranks)

    @property
    def with_critic(self) -> bool:
        return self.rl_critic is not None

    def describe(self, cfg: Config) -> dict[str, Any]:
        """The plan's values as derived.json records them (after the Derived fields)."""
        out: dict[str, Any] = {**self.rl.as_dict(), "placement": self.placement.describe()}
        if self.rl_critic is not None:
            out["critic_per_rank_mini_batch_seqs"] = self.rl_critic.per_rank_mini_batch_seqs
        if cfg.reward_model.enable or cfg.reward_model.judge.enable:
            out["reward_model"] = self.placement.role(self.scorer).describe()
        if "teacher" in self.placement.roles:  # on-policy distillation: where the teacher is, its weight
            out["teacher"] = self.placement.role("teacher").describe()
            out["distillation_coef"] = cfg.teacher.coef
        out["recompute_old_logprobs"] = self.recompute_old
        out["offload_optimizer_between_updates"] = self.offload_optimizer
        return out


@dataclass(frozen=True)
class Roles:
    """The roles an RL recipe runs, beyond the actor, the reference and the engines every one has: a recipe
    declares them as its module's ``ROLES`` (``--check --world-size N`` reads it) and builds its job with
    them (``build_job(cfg, ROLES)``)."""

    critic: bool = False  # PPO's value model (its own ranks under parallel.placement=split)
    asynchronous: bool = False  # the asynchronous loop, which alone runs parallel.placement=async


NO_EXTRA_ROLES = Roles()  # GRPO's: the actor, the reference and the engines, every one on every rank


def plan_job(
    cfg: Config,
    world_size: int,
    num_train_prompts: int,
    roles: Roles = NO_EXTRA_ROLES,
    *,
    device_type: str = "cpu",
    memory_budgets: tuple[int, int] | None = None,
) -> JobPlan:
    """The plan of an RL job with ``roles`` on ``world_size`` ranks over ``num_train_prompts`` prompts, or a
    ConfigError naming the fix. ``memory_budgets``: the (update, no-grad) token budgets a GPU's free memory allows, for the keys left at
    auto (spmdrl/rl/token_budgets.py); None: those keep sequence counts (always on CPU)."""
    check_val_only(cfg)
    with_critic = roles.critic
    placement = plan_placement(
        cfg.parallel,
        world_size,
        needs_critic=with_critic,
        asynchronous=roles.asynchronous,
        teacher=cfg.teacher.enabled,
    )
    if placement.is_async:
        check_async_batch(cfg, placement)
    if cfg.model.fsdp_unit == "none":  # no FSDP2: each model on one rank (the build checks it too, later)
        built = ("actor", "ref", "critic") if with_critic else ("actor", "ref")
        check_bare_module({r: placement.role(r).num_ranks for r in built})
    # async: the rollout ranks split each batch's prompts among themselves (the trainer ranks' share is
    # derive_rl's below).
    gen_ranks = placement.role("rollout").num_ranks if placement.is_async else world_size
    derived = derive(cfg, gen_ranks, num_train_prompts, samples_per_item=cfg.rollout.n)
    check_profile_steps(cfg.logging.profile_steps, derived.total_steps)
    rl_critic = None
    if placement.is_async:
        rl = derive_rl(
            cfg, derived, train_ranks=placement.role("actor").num_ranks, memory_budgets=memory_budgets
        )
    elif placement.is_split:
        actor_ranks, critic_ranks = placement.role("actor").num_ranks, placement.role("critic").num_ranks
        rl = derive_rl(cfg, derived, train_ranks=actor_ranks, role="actor", memory_budgets=memory_budgets)
        rl_critic = derive_rl(
            cfg, derived, train_ranks=critic_ranks, role="critic", memory_budgets=memory_budgets
        )
    elif placement.teacher_apart:
        check_teacher_batch(cfg.trainer, cfg.algorithm, placement)
        rl = derive_rl(
            cfg, derived, train_ranks=placement.role("actor").num_ranks, memory_budgets=memory_budgets
        )
    else:
        rl = derive_rl(cfg, derived, memory_budgets=memory_budgets)
    if with_critic and rl_critic is None:  # colocated: the critic trains on the actor's rows
        rl_critic = rl
    # Off-policy rows (async, max_staleness >= 1): the old logprobs are the trainer's, not the engine's.
    recompute_old = needs_old_logprobs(cfg.algorithm, rl) or (
        placement.is_async and cfg.trainer.max_staleness > 0
    )
    # Offloaded parameters take their optimizer state with them; on a CPU trainer there is nowhere to move it.
    offload = cfg.model.offload_optimizer and not cfg.model.offload_params and device_type == "cuda"
    # reward_model.*: the actor's ranks (colocated: every rank) score, or the rollout ranks under async,
    # which hold the samples and the engines (the judge's).
    scorer = "rollout" if placement.is_async else "actor"
    return JobPlan(placement, derived, rl, rl_critic, recompute_old, offload, scorer)


def check_teacher_batch(trainer: TrainerConfig, algorithm: AlgorithmConfig, placement: Placement) -> None:
    """parallel.teacher_ranks: the actor trains on fewer ranks than generate, each holding an equal block of
    the step's rows, and its advantages need whole prompt groups (rollout.n rows each) on a rank: the step's
    and each mini-batch's prompts must split evenly over the actor's ranks."""
    actor, world = placement.role("actor").num_ranks, placement.world_size
    mini = algorithm.ppo_mini_batch_size or trainer.global_batch_size
    # The step's prompts also split over every generating rank (derive checks that): name a size that fits both.
    fits = {"trainer.global_batch_size": math.lcm(actor, world), "algorithm.ppo_mini_batch_size": actor}
    batches = (
        ("trainer.global_batch_size", trainer.global_batch_size),
        ("algorithm.ppo_mini_batch_size", mini),
    )
    for key, prompts in batches:
        if prompts % actor:
            raise ConfigError(
                f"{key}={prompts} prompts do not split evenly over the actor's {actor} ranks (world {world} minus "
                f"parallel.teacher_ranks={placement.role('teacher').num_ranks}): each actor rank trains on whole "
                f"prompt groups; pick a multiple of {fits[key]}, or another parallel.teacher_ranks"
            )


def check_val_only(cfg: Config) -> None:
    """trainer.val_only runs the validation alone: without held-out data there is nothing to run."""
    check_val_only_data(cfg.trainer, cfg.data.val_files, cfg.name)


def train_rows(cfg: Config, cache_dir: Path) -> int:
    """The training prompts before any is dropped as overlong: the rows of data.train_files (a parquet
    file's footer; a built-in task's split is generated into ``cache_dir`` first, as the run would)."""
    from spmdrl.data.reasoning_gym_task import ReasoningGymConfig
    from spmdrl.data.sources import check_sources, read_options
    from spmdrl.data.tiny_shapes_task import TinyShapesConfig
    from spmdrl.data.tiny_task import TinyTaskConfig, resolve_data_files
    from spmdrl.data.tools_task import ToolsTaskConfig
    from spmdrl.envs.config import EnvConfig

    if cfg.section(EnvConfig).enabled:  # env.source: the environment's training tasks
        from spmdrl.envs.setup import env_train_rows

        return env_train_rows(cfg.section(EnvConfig))
    files = resolve_data_files(
        cfg.data.train_files,
        cache_dir,
        cfg.section(TinyTaskConfig),
        cfg.section(ToolsTaskConfig),
        cfg.section(ReasoningGymConfig),
        cfg.section(TinyShapesConfig),
    )
    views = check_sources(files, [cfg.data.prompt_key], options=read_options(cfg.data, "data.train_files"))
    return sum(v.num_rows for v in views)


def describe_plan(cfg: Config, roles: Roles, world_size: int, cache_dir: Path) -> list[str]:
    """``--check --world-size N``'s lines: the plan of this config on ``world_size`` ranks (CPU token
    budgets: a GPU run may size its micro-batches by its free memory), from the training set's rows."""
    rows = train_rows(cfg, cache_dir)
    plan = plan_job(cfg, world_size, rows, roles)
    d, r = plan.derived, plan.rl
    lines = [
        f"plan on {world_size} ranks: {plan.placement.describe()}",
        f"  {rows} training prompts (before any longer than data.max_prompt_length={cfg.data.max_prompt_length}"
        f" is dropped): {d.steps_per_epoch} steps an epoch, {d.total_steps} steps",
        f"  a step: {cfg.trainer.global_batch_size} prompts x rollout.n={cfg.rollout.n}, "
        f"{d.per_rank_batch_size} prompts per generating rank",
        f"  the actor's update on {r.train_ranks} ranks: {r.mini_batches_per_step} mini-batches of "
        f"{r.per_rank_mini_batch_seqs} sequences per rank, micro-batches of {r.micro_batch_size} "
        f"({r.grad_accum_steps} accumulated), {r.optimizer_steps_per_step} optimizer steps a step; "
        f"rows up to {r.max_model_len} tokens",
    ]
    if plan.rl_critic is not None:
        c = plan.rl_critic
        lines.append(
            f"  the critic's update on {c.train_ranks} ranks: mini-batches of {c.per_rank_mini_batch_seqs} "
            f"sequences per rank, micro-batches of {c.micro_batch_size}"
        )
    if plan.placement.teacher_apart:
        t, a = plan.placement.role("teacher"), plan.placement.role("actor")
        lines.append(
            f"  the teacher on ranks of its own ({t.describe().split(': ')[1].split(' (')[0]}): every rank generates "
            f"(the teacher's ranks get the actor's weights by broadcast), each step's rows go to the teacher's "
            f"ranks to be scored and, with its logprobs, to the actor's {a.num_ranks} ranks to be trained on"
        )
    actor = plan.placement.role("actor")
    if actor.ep > 1:  # the ep groups: consecutive actor ranks (spmdrl.distributed.placement.Meshes.experts)
        ends = range(actor.first_rank, actor.first_rank + actor.num_ranks, actor.ep)
        groups = ", ".join(f"{first}-{first + actor.ep - 1}" for first in ends)
        holders = actor.num_ranks // actor.ep
        fanout = plan.placement.fanout_ranks()
        served = "every engine gets every expert at each sync" + (
            f" (ranks {fanout[1]}-{fanout[-1]}'s by broadcast from rank {fanout[0]})" if fanout else ""
        )
        lines.append(
            f"  expert parallelism (parallel.ep={actor.ep}): ranks {groups} each split every MoE layer's experts, "
            f"tokens sent to them by all-to-all; each expert FSDP2-sharded over the {holders} rank(s) holding "
            f"it; {served}"
        )
    recomputed = "yes" if plan.recompute_old else "no (the engine's are used)"
    lines.append(f"  old logprobs recomputed: {recomputed}")
    return lines
