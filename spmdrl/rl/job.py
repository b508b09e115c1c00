"""The RL job: what the phases of an RL step work with (RLJob), built once on every rank by build_job, and
what happens around the steps: the weight sync, validation, checkpoints and the end of the run.

build_job, in order; every check that can fail does so before the warm-start and the engine:
  1. the run (process group, output directory) and the placement of the roles on the ranks
  2. resume: the newest complete checkpoint of the output directory (trainer.resume=auto), rank 0 decides
     (parallel.placement=async: one saved by a pipeline of another shape is refused here)
  3. data, the reward function, the batch arithmetic (derive, derive_rl) and the model's limits
  4. the SFT warm-start (warmstart.*), whose export RL starts from
  5. the models on their meshes (the actor, the reference when a KL term needs it (under LoRA the actor
     with its adapters off, no model of its own), PPO's critic), their
     optimizers, then the engine on every rank (parallel.placement=async: on the rollout ranks only),
     and reward_model.*'s models on the ranks that score (async: the rollout ranks too)
  6. when resuming, the checkpoint's state (models, optimizers, sampler, KL coefficient, RNG states) and
     the engine synced to its weights; the metric logger and the checkpointer

trainer.val_only builds less (no warm-start run, reference, critic or reward model), logs into
output_dir/val_only/, and its loop is :func:`validate_only`: one validation, no step.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from spmdrl import loop
from spmdrl.algos.kl_control import AdaptiveKLController, FixedKLController, build_kl_controller
from spmdrl.checkpoint.checkpointer import Checkpointer, RoleState, checkpoint_root
from spmdrl.checkpoint.export import write_hf_metadata
from spmdrl.config import Config
from spmdrl.data.config import DataConfig
from spmdrl.data.prompts import PromptDataset
from spmdrl.data.reasoning_gym_task import ReasoningGymConfig
from spmdrl.data.sampler import DistributedSampler
from spmdrl.data.sources import read_options
from spmdrl.data.tiny_shapes_task import TinyShapesConfig
from spmdrl.data.tiny_task import TinyTaskConfig, resolve_data_files
from spmdrl.data.tools_task import ToolsTaskConfig
from spmdrl.derived import Derived, RLDerived
from spmdrl.distributed.env import DistEnv, broadcast_object
from spmdrl.distributed.placement import Meshes, Placement, plan_placement
from spmdrl.distributed.topology import check_tp_within_nodes, node_layout_from_env, ranks_on_node
from spmdrl.envs.config import EnvConfig
from spmdrl.envs.setup import EnvJob, build_env_job
from spmdrl.errors import ConfigError
from spmdrl.logging.metrics import NullLogger
from spmdrl.logging.plot import plot_curves
from spmdrl.logging.profiler import profile_step
from spmdrl.logging.samples import Sample
from spmdrl.logging.timer import PhaseTimer
from spmdrl.models.grad_sync import describe_grad_sync
from spmdrl.models.load import load_processor, load_tokenizer, resolve_model_path_all_ranks
from spmdrl.models.router_replay import router_tap
from spmdrl.optim import OptimizerOffload, build_lr_scheduler, build_optimizer
from spmdrl.rewards.registry import check_data_sources, load_reward_fn
from spmdrl.rl.async_queue import PipelineShape, check_resume_all_ranks
from spmdrl.rl.model_rewards import ModelRewards, build_model_rewards, check_model_rewards
from spmdrl.rl.models import ModelAndOptimizer, build_critic, build_models
from spmdrl.rl.plan import NO_EXTRA_ROLES, JobPlan, Roles, plan_job
from spmdrl.rl.reference import Reference
from spmdrl.rl.samples import ScoredSamples, train_samples, validate
from spmdrl.rl.settings import update_settings
from spmdrl.rl.teacher import Teacher, build_teacher, check_same_tokenizer
from spmdrl.rl.token_budgets import measure_token_budgets, wants_memory_budgets
from spmdrl.rl.update import UpdateSettings
from spmdrl.rollout.engine import (
    RolloutEngine,
    build_engine,
    check_engine_config,
    check_kv_cache_fits,
    check_kv_cache_tokens,
)
from spmdrl.rollout.mismatch import ParityError, parity_failure
from spmdrl.rollout.rollout import Rollout, build_agent_loop, build_rollout, load_multi_turn_tools
from spmdrl.rollout.weight_sync import Fanout, SyncCheck, SyncStats, sync_weights, sync_with_fallback
from spmdrl.runtime import Run, start_run
from spmdrl.supervised.warmstart import val_only_model, warm_start
from spmdrl.tools import tool_schemas
from spmdrl.trainer_config import VAL_ONLY_STAGE, TrainerConfig

log = logging.getLogger("spmdrl")

CURVE_KEYS = ["rollout/reward_mean", "val/accuracy"]


@dataclasses.dataclass
class TrainedRole(ModelAndOptimizer):
    """A role this rank trains (the actor; PPO's critic): its model, optimizer and schedule, where the
    optimizer's moments live between updates (model.offload_optimizer), its update's batch arithmetic and
    its ranks' process group. Present on the role's ranks, absent (None) on every other rank."""

    offload: OptimizerOffload
    rl: RLDerived
    group: dist.ProcessGroup | None


@dataclasses.dataclass
class RLJob:
    """Everything the phases of a step work with, on this rank. The roles are present or absent as a whole:
    ``actor`` and ``critic`` on the ranks that train them (colocated: every rank; parallel.placement=split:
    their own ranks; async: the actor on the trainer ranks), ``ref`` where a KL term needs it, ``engine``
    on the ranks that generate (async: not on the trainer ranks)."""

    run: Run
    plan: JobPlan  # placement, batch arithmetic, derived settings: the same on every rank
    meshes: Meshes
    tokenizer: Any
    # What an export writes beside the weights: a vision-language model's processor (its tokenizer and
    # image processor), else the tokenizer.
    hf_files: Any
    train_ds: PromptDataset
    val_ds: PromptDataset | None
    reward_fn: Any
    sampler: DistributedSampler
    model_dir: Path  # what RL starts from: the base model, or the warm-start's export
    # The actor's module on every rank: its shards on the actor's ranks, a meta-device copy elsewhere (the
    # shapes a weight sync receives by).
    policy: torch.nn.Module
    actor: TrainedRole | None
    critic: TrainedRole | None  # PPO's value model
    ref: Reference | None  # only when a KL term needs it; under LoRA the actor with its adapters off
    engine: RolloutEngine | None
    rollout: Rollout  # generates with the engine (and the multi-turn agent loop)
    fanout: Fanout | None  # split: the actor's weights to the engines of the critic's ranks
    kl_ctrl: FixedKLController | AdaptiveKLController  # the KL-in-reward coefficient
    # Where the loop starts (0, or the resumed checkpoint's step), where it logs and how it saves.
    start_step: int
    logger: NullLogger
    checkpointer: Checkpointer
    started_at: float  # time.perf_counter() at build_job's start
    # reward_model.*: the reward model and/or the judge, weighted with the rule reward (None: rule only).
    model_rewards: ModelRewards | None = None
    # The checkpoint loaded, if any (async: the rollout ranks read their queues in it).
    resumed_from: Path | None = None
    # teacher.*: on-policy distillation's frozen teacher, on its ranks: the actor's, or its own under
    # parallel.teacher_ranks (None: no distillation, or a rank that does not hold it).
    teacher: Teacher | None = None

    @property
    def cfg(self) -> Config:
        return self.run.cfg

    @functools.cached_property
    def update_settings(self) -> UpdateSettings:
        """What the trainer's passes read of the config (spmdrl.rl.update), gathered once."""
        return update_settings(self.cfg)

    @property
    def env(self) -> DistEnv:
        return self.run.env

    @property
    def device(self) -> torch.device:
        return self.run.env.device

    @property
    def placement(self) -> Placement:
        return self.plan.placement

    def trained(self, role: str) -> TrainedRole:
        """The ``role`` ("actor", "critic") this rank trains; a phase that runs only where it is trained asks
        for it so. An error naming the placement if this rank does not train it."""
        found = self.actor if role == "actor" else self.critic if role == "critic" else None
        if found is None:
            raise RuntimeError(
                f"rank {self.env.rank} trains no {role} (placement {self.placement.describe()}): this phase runs "
                f"on the {role}'s ranks only"
            )
        return found

    @property
    def derived(self) -> Derived:
        return self.plan.derived

    @property
    def rl(self) -> RLDerived:
        """The actor's update's batch arithmetic (every rank knows it: rows are laid out by it)."""
        return self.plan.rl

    @property
    def recompute_old(self) -> bool:
        return self.plan.recompute_old

    @property
    def total_steps(self) -> int:
        return self.derived.total_steps

    @property
    def holds_engine(self) -> bool:
        """Whether this rank generates (every rank, except a trainer rank under parallel.placement=async)."""
        return self.engine is not None

    @property
    def actor_group(self) -> dist.ProcessGroup | None:
        return self.meshes.group("actor")

    @property
    def critic_group(self) -> dist.ProcessGroup | None:
        return self.meshes.group("critic")

    @property
    def metrics_path(self) -> Path:
        return self.log_dir / "metrics.jsonl"

    @property
    def log_dir(self) -> Path:
        """Where metrics and samples go: the output directory, or trainer.val_only's own sub-directory of
        it (beside the training run whose checkpoint it evaluates, not mixed with its logs)."""
        return self.run.output_dir / val_only_stage(self.cfg.trainer)


def build_job(cfg: Config, roles: Roles = NO_EXTRA_ROLES) -> RLJob:
    """The job on this rank (every rank calls it), in the order of the module docstring: what
    :func:`~spmdrl.rl.plan.plan_job` plans for the recipe's ``roles``, built."""
    run = start_run(cfg)
    env = run.env
    started_at = time.perf_counter()
    # An engine this machine cannot run (vLLM release, forced CPU GEMM path) fails now, not after the SFT.
    check_engine_config(cfg.rollout, env.device.type)
    # Which ranks run which role (a placement that cannot fit this world fails here, before the data;
    # the plan below, with the data's size, runs the rest of its checks).
    placement = plan_placement(
        cfg.parallel,
        env.world_size,
        needs_critic=roles.critic,
        asynchronous=roles.asynchronous,
        teacher=cfg.teacher.enabled,
    )
    world_size, local_world_size = node_layout_from_env()
    check_tp_within_nodes(cfg.rollout.tp, world_size, local_world_size)  # an engine never spans two nodes
    log.info("placement %s", placement.describe())

    # Resume: the newest complete checkpoint of this output directory (trainer.resume=auto), a path, or
    # none. Rank 0 decides for everyone (every rank must agree on it; spmdrl/loop.py).
    start = loop.plan_start(run)
    if placement.is_async and start.resume_from is not None:  # a pipeline this one cannot continue exactly
        check_resume_all_ranks(start.resume_from, PipelineShape.of(cfg, placement))

    # Data, rewards and batch arithmetic (the tokenizer is the base model's; the warm-start's export keeps it).
    base_dir = resolve_model_path_all_ranks(cfg.model.path, run.cache_dir)
    tokenizer = load_tokenizer(base_dir, cfg.model.trust_remote_code)
    # Multi-turn tools load first: the prompts describe them to the model (the chat template's tools).
    tools = load_multi_turn_tools(cfg) if cfg.rollout.multi_turn.enable else None
    schemas = tool_schemas(tools) if tools else None
    # env.source: the environment's tasks are the prompts and its rubric the reward (spmdrl/envs/).
    env_job = build_env_job(cfg.section(EnvConfig), run.cache_dir) if cfg.section(EnvConfig).enabled else None
    if env_job is not None and env_job.loaded.multi_turn:  # a verifiers ToolEnv's tools, in the prompts
        from spmdrl.rollout.vf_turns import tool_schemas as env_tool_schemas

        schemas = env_tool_schemas(env_job.loaded)
    train_files, val_files = _prompt_files(cfg.data, env_job)
    # A vision-language model's processor: the prompts' images are decoded and checked here, before any model.
    processor = load_processor(base_dir, cfg.model.trust_remote_code)
    train_ds = load_prompts(run, tokenizer, train_files, schemas, processor=processor)
    val_ds = (
        load_prompts(run, tokenizer, val_files, schemas, key="data.val_files", processor=processor)
        if val_files
        else None
    )
    # teacher.path: its files (a built-in teacher built once) and its tokenizer, the actor's, before the warm-start
    # and the token budgets (which count its memory).
    teacher_dir = None
    if cfg.teacher.enabled and not cfg.trainer.val_only:
        teacher_dir = resolve_model_path_all_ranks(cfg.teacher.path, run.cache_dir)
        teacher_tok = load_tokenizer(teacher_dir, cfg.model.trust_remote_code)
        check_same_tokenizer(tokenizer, teacher_tok, base_dir, teacher_dir)
    plan = plan_job(cfg, env.world_size, len(train_ds), roles, device_type=env.device.type)
    # CUDA: the token budgets left at auto, from the free memory before any model or engine is allocated.
    if wants_memory_budgets(cfg, env.device):
        memory = measure_token_budgets(
            cfg, base_dir, env.device, placement, needs_critic=roles.critic, teacher_dir=teacher_dir
        )
        budgets = (memory.train, memory.no_grad)
        plan = plan_job(
            cfg, env.world_size, len(train_ds), roles, device_type=env.device.type, memory_budgets=budgets
        )
    else:
        memory = None
    derived, rl = plan.derived, plan.rl
    check_model_fits(base_dir, rl.max_model_len, cfg.rollout.tp, cfg.model.trust_remote_code)
    check_kv_cache_tokens(cfg.rollout.kv_cache_tokens, rl.max_model_len)
    # The engines' KV caches against the memory they would live in (on CPU, the node's host memory).
    rollout_ranks = placement.role("rollout").ranks if placement.is_async else range(env.world_size)
    check_kv_cache_fits(
        base_dir,
        cfg.rollout,
        rl.max_model_len,
        env.device.type,
        engines_on_node=ranks_on_node(rollout_ranks, env.rank, local_world_size),
    )
    # Multi-turn: the chat template must render tool turns, the parser must load (before the warm-start).
    agent = build_agent_loop(
        cfg,
        tokenizer,
        tools,
        max_model_len=rl.max_model_len,
        env=env_job.loaded if env_job else None,
        processor=processor,
    )
    reward_fn = env_job.reward_fn if env_job else load_reward_fn(cfg.reward.fn)
    check_model_rewards(cfg.reward_model)  # reward_model.path's files, before the warm-start
    # critic.model_path: its files resolved on every rank, before the roles split: rank 0 goes first and
    # the others wait on it, so a resolve on the critic's ranks alone would wait for a rank that never
    # comes (parallel.placement=split puts rank 0 on the actor).
    critic_dir = None
    if cfg.critic.model_path and plan.rl_critic is not None and not cfg.trainer.val_only:
        critic_dir = resolve_model_path_all_ranks(cfg.critic.model_path, run.cache_dir, critic=True)
    if env_job is None:
        check_data_sources(cfg.reward.fn, _data_sources(train_ds, val_ds))

    # trainer.val_only trains nothing, the warm-start neither: its export beside the checkpoint, if any.
    val_only = cfg.trainer.val_only
    if cfg.warmstart.enabled:
        model_dir = val_only_model(start, base_dir) if val_only else warm_start(run, start)
    else:
        model_dir = base_dir

    run.log_derived(
        derived,
        stage=val_only_stage(cfg.trainer),
        **plan.describe(cfg),
        **(memory.as_dict() if memory else {}),
        train_prompts=len(train_ds),
        train_filtered_overlong=train_ds.num_filtered,
        val_prompts=len(val_ds) if val_ds else 0,
    )
    sampler = (
        async_sampler(run, placement, len(train_ds), derived.per_rank_batch_size)
        if placement.is_async
        else run.train_sampler(len(train_ds), derived.per_rank_batch_size)
    )

    # Models on their meshes (colocated: the same ranks), then the engine on every rank.
    meshes = placement.build_meshes(env.device.type)
    # trainer.val_only: no reference, critic or reward model (validation scores with reward.fn alone);
    # the actor with its optimizer still, which the checkpoint's state loads into.
    policy, ref = build_models(
        cfg.model, cfg.trainer, cfg.algorithm, env.device, meshes, model_dir, reference=not val_only
    )
    if cfg.model.router_replay == "r3" and policy is not None and router_tap(policy) is None:
        # A hub id is checked here, once built (spmdrl.preflight.check_router_replay checks local paths).
        raise ConfigError(
            f"model.router_replay=r3: model.path={cfg.model.path} has no mixture-of-experts router "
            "(layers.<i>.mlp.gate); set model.router_replay=disabled or train a mixture of experts"
        )
    actor = None
    if meshes.holds("actor"):
        optimizer = build_optimizer(policy, cfg.optim)
        actor = TrainedRole(
            policy,
            optimizer,
            build_lr_scheduler(optimizer, cfg.optim, derived.total_steps),
            # model.offload_optimizer: the moments in (pinned) host memory between updates.
            OptimizerOffload(optimizer, env.device, plan.offload_optimizer),
            rl,
            meshes.group("actor"),
        )
        log.info("actor update: %s", describe_grad_sync(policy, cfg.trainer.defer_grad_sync))
    teacher = None
    if teacher_dir is not None and meshes.holds("teacher"):
        teacher = build_teacher(cfg.teacher, cfg.model, cfg.trainer, teacher_dir, env.device, meshes)
    critic = None
    if plan.rl_critic is not None and meshes.holds("critic") and not val_only:
        c = build_critic(
            cfg.critic, cfg.model, cfg.trainer.total_steps, env.device, meshes, critic_dir or model_dir
        )
        offload = OptimizerOffload(c.optimizer, env.device, plan.offload_optimizer)
        critic = TrainedRole(
            c.model, c.optimizer, c.scheduler, offload, plan.rl_critic, meshes.group("critic")
        )
        log.info("critic update: %s", describe_grad_sync(critic.model, cfg.trainer.defer_grad_sync))
    fanout = (
        Fanout(meshes.fanout_group, placement.fanout_ranks()[0], receiving=actor is None)
        if meshes.fanout_group is not None
        else None
    )
    # async: the engines on the rollout ranks only (None on the trainer ranks, which still take part).
    engine_ranks = placement.role("rollout").ranks if placement.is_async else None
    engine = build_engine(
        model_dir,
        cfg.rollout,
        max_model_len=rl.max_model_len,
        device_type=env.device.type,
        ranks=engine_ranks,
        # model.router_replay=r3: each generation carries the experts the engine routed it through.
        routed_experts=cfg.model.router_replay == "r3",
    )
    # reward_model.*: on the scoring ranks only, sharded over them (FSDP2), scores reduced over them.
    model_rewards = (
        build_model_rewards(
            cfg,
            meshes.fsdp(plan.scorer),
            engine,
            tokenizer,
            env.device,
            max_model_len=rl.max_model_len,
            group=meshes.group(plan.scorer),
        )
        if meshes.holds(plan.scorer) and not val_only
        else None
    )
    a = cfg.algorithm
    kl_ctrl = build_kl_controller(
        a.kl_ctrl.type, a.kl_ctrl.kl_coef, target_kl=a.kl_ctrl.target_kl, horizon=a.kl_ctrl.horizon
    )

    # The state a checkpoint holds: each trained role (model, optimizer, schedule) on its own ranks, and
    # the loop's position (step, sampler, KL coefficient); RNG states are saved per rank.
    roles = [_role_state("actor", actor, policy, meshes, placement, processor or tokenizer)]
    if plan.with_critic:
        roles.append(_role_state("critic", critic, None, meshes, placement, tokenizer))
    checkpointer = Checkpointer(
        checkpoint_root(run.output_dir),
        roles,
        keep=cfg.trainer.keep_checkpoints,
        async_save=cfg.trainer.async_save,
    )
    job = RLJob(
        run=run,
        plan=plan,
        meshes=meshes,
        tokenizer=tokenizer,
        hf_files=processor if processor is not None else tokenizer,
        train_ds=train_ds,
        val_ds=val_ds,
        reward_fn=reward_fn,
        sampler=sampler,
        model_dir=model_dir,
        policy=policy,
        actor=actor,
        critic=critic,
        ref=ref,
        engine=engine,
        # group: the multi-turn metrics reduce over the ranks that generate (async: the rollout ranks).
        # build_rollout: what a launcher wrapped it in, if anything (spmdrl.rollout.rollout.wrap_rollouts).
        rollout=build_rollout(engine, agent, group=meshes.group("rollout")),
        fanout=fanout,
        kl_ctrl=kl_ctrl,
        start_step=0,
        logger=NullLogger(),  # opened by _resume_or_start, once the resumed run's later rows are dropped
        checkpointer=checkpointer,
        started_at=started_at,
        model_rewards=model_rewards,
        teacher=teacher,
    )
    _resume_or_start(job, roles, start)
    return job


def _role_state(
    name: str,
    role: TrainedRole | None,
    module: torch.nn.Module | None,
    meshes: Meshes,
    placement: Placement,
    tokenizer: object,
) -> RoleState:
    """What a checkpoint holds of a trained role: its model, optimizer and schedule on its own ranks
    (``module``: the role's module on the ranks that do not train it, when they hold one)."""
    model = role.model if role is not None else module
    return RoleState(
        name,
        role is not None,
        model,
        role.optimizer if role is not None else None,
        role.scheduler if role is not None else None,
        meshes.group(name),
        _hf_writer(model, tokenizer) if model is not None else None,
        placement.role(name).ranks,
    )


def _resume_or_start(job: RLJob, roles: list[RoleState], plan: loop.StartPlan) -> None:
    """The skeleton's resume (spmdrl/loop.py: the roles' states, the sampler, the metric logger), then the
    RL loop's own: the KL coefficient, and the engine synced to the checkpoint's weights."""
    # trainer.val_only trains nothing: the rows its checkpoint's run logged after it are kept.
    val_only = job.cfg.trainer.val_only
    start = loop.resume_or_start(
        job.run,
        plan,
        roles,
        job.sampler,
        job.total_steps,
        val_only_stage(job.cfg.trainer),
        rewind=not val_only,
    )
    job.start_step, job.logger = start.step, start.logger
    if plan.resume_from is not None:
        job.resumed_from = plan.resume_from
        job.kl_ctrl.value = float(start.state["kl_coef"])
        # The engine was built from the starting weights: load the checkpoint's, with the usual check.
        sync_actor_weights(job, check_seed=0)


# -------------------------------------------------------------------------------- around the steps
def sync_actor_weights(job: RLJob, check_seed: int) -> SyncStats:
    """The actor's weights into every rank's engine, in place (split: the critic's ranks receive them from
    the first actor rank). With rollout.weight_sync_check, the check proves each engine now serves exactly
    them, probing columns chosen by ``check_seed`` (the step), and stops the run on every rank if not."""
    # The engines' dtype, also on a rank that holds none (the module imports vLLM only inside the engine).
    from spmdrl.rollout.quantization import check_tol
    from spmdrl.rollout.vllm_plan import resolve_engine_dtype

    cfg = job.cfg
    check = (
        SyncCheck(check_seed, check_tol(cfg.rollout.quantization, cfg.rollout.weight_sync_check_tol))
        if cfg.rollout.weight_sync_check
        else None
    )
    engine = job.engine  # async: None on the trainer ranks, which gather, send, load nothing

    def sync() -> SyncStats:
        return sync_weights(
            job.policy,
            engine,
            bucket_mb=cfg.rollout.weight_sync_bucket_mb,
            check=check,
            fanout=job.fanout,
            device=job.device,
            dtype=resolve_engine_dtype(cfg.rollout.dtype, job.device.type),
        )

    # A direct load that fails the check under auto is retried with vLLM's reload (its docstring: why).
    return sync_with_fallback(sync, engine, job.device, auto=cfg.rollout.weight_load == "auto")


def profiled(job: RLJob, step: int) -> contextlib.AbstractContextManager[None]:
    """The step under torch.profiler on every rank if logging.profile_steps names it (its trace and op
    table in output_dir/profile/step-<N>/, spmdrl/logging/profiler.py); else nothing."""
    rank = job.run.env.rank
    return profile_step(job.cfg.logging.profile_steps, job.run.output_dir, step, rank, job.device)


def validates_at(job: RLJob, step: int) -> bool:
    """Validation runs every trainer.val_every steps, at the last, and at step 0 of a run that starts
    (unless trainer.val_before_train is false)."""
    trainer = job.cfg.trainer
    return job.val_ds is not None and loop.validation_due(
        step, trainer.val_every, job.total_steps, at_start=trainer.val_before_train
    )


def saves_at(job: RLJob, step: int) -> bool:
    """A checkpoint is due every trainer.save_every steps and after the last."""
    return loop.due(step, job.cfg.trainer.save_every, job.total_steps)


def validation(job: RLJob, step: int) -> dict[str, float]:
    """Greedy decoding on the held-out split (spmdrl.rl.samples.validate); rank 0 logs its samples.
    parallel.placement=async: the rollout ranks decode, the first of them tells every rank the metrics
    and rank 0 its samples, which rank 0 writes. Every rank calls it."""
    assert job.val_ds is not None
    if job.placement.is_async:
        spec = job.placement.role("rollout")
        result: tuple[dict[str, float], list[Sample]] | None = None
        if job.holds_engine:
            result = validate(
                job.run,
                job.rollout,
                job.tokenizer,
                job.reward_fn,
                job.val_ds,
                job.cfg.data.max_response_length,
                shard=(job.env.rank - spec.first_rank, spec.num_ranks),
                group=job.meshes.group("rollout"),
            )
        metrics, samples = broadcast_object(result, src=spec.first_rank)
    else:
        metrics, samples = validate(
            job.run, job.rollout, job.tokenizer, job.reward_fn, job.val_ds, job.cfg.data.max_response_length
        )
    job.logger.log_samples([dataclasses.replace(s, step=step) for s in samples])  # rank 0's
    return metrics


def validate_only(job: RLJob) -> None:
    """trainer.val_only: one validation of the weights the job loaded (the resumed checkpoint's, or the
    model as configured), its metrics row at that checkpoint's step (0 without one) and its samples in
    output_dir/val_only/; then the end, with no checkpoint and no export. Every rank calls it."""
    step = job.start_step
    metrics = validation(job, step)
    job.logger.log(step, metrics)
    if job.engine is not None:
        job.engine.close()
    job.logger.close()
    dist.barrier()
    log.info(
        "validation only (trainer.val_only): %s at step %d, val/accuracy=%.4f; outputs in %s",
        job.resumed_from or f"{job.model_dir} (no checkpoint)",
        step,
        metrics["val/accuracy"],
        job.log_dir,
    )


def draw_curves(job: RLJob) -> None:
    """curves.png from metrics.jsonl (rank 0)."""
    if job.env.is_main and job.metrics_path.exists():
        plot_curves(job.metrics_path, job.run.output_dir / "curves.png", CURVE_KEYS, title=job.cfg.name)


def log_step(
    job: RLJob,
    step: int,
    metrics: dict[str, float],
    samples: ScoredSamples,
    timer: PhaseTimer,
    val_metrics: dict[str, float] | None = None,
) -> None:
    """The end of every RL recipe's log phase, given the step's reduced ``metrics``: its samples
    (logging.samples_every), validation (trainer.val_every; ``val_metrics`` when the caller ran it), the
    step's time, a metrics row every trainer.log_every steps, at validations and at the last step, and the
    curves after a validation."""
    cfg = job.cfg
    if job.env.is_main and cfg.logging.samples_every > 0 and step % cfg.logging.samples_every == 0:
        job.logger.log_samples(train_samples(step, job.tokenizer, samples, cfg.logging.samples_per_log))
    validated = validates_at(job, step)
    if validated:
        metrics.update(val_metrics if val_metrics is not None else validation(job, step))
    metrics["timing/step_s"] = timer.elapsed()
    # rollout.parity_tol: the reduced metrics are the same on every rank, so all stop together, after the
    # step's row is written (the evidence) and before its checkpoint.
    parity = parity_failure(cfg.rollout.parity_tol, metrics, step, lambda: _dtypes(job))
    if validated or parity or loop.due(step, cfg.trainer.log_every, job.total_steps):
        job.logger.log(step, metrics)
    if validated:
        draw_curves(job)
    if parity:
        raise ParityError(parity)


def _dtypes(job: RLJob) -> str:
    from spmdrl.models.build import resolve_dtype
    from spmdrl.rollout.vllm_plan import resolve_engine_dtype

    trainer = resolve_dtype(job.cfg.model.param_dtype, job.device)
    engine = resolve_engine_dtype(job.cfg.rollout.dtype, job.device.type)
    return f"trainer {str(trainer).removeprefix('torch.')}, engine {str(engine).removeprefix('torch.')}"


def save_checkpoint(
    job: RLJob, step: int, *, meta: dict[str, Any] | None = None, extra: dict[str, object] | None = None
) -> None:
    """step-<step>: every role's state on its ranks, the sampler and the KL coefficient; ``meta``: more
    entries for meta.json, ``extra``: this rank's own files (path in the checkpoint -> object), part of the
    same checkpoint (async: the rollout ranks' queues, spmdrl/rl/async_queue.py)."""
    loop.save(
        job.checkpointer,
        step,
        job.sampler,
        meta={"placement": job.placement.describe(), "total_steps": job.total_steps, **(meta or {})},
        state={"kl_coef": job.kl_ctrl.value},
        extra=extra,
    )


def finish(job: RLJob) -> None:
    """After the last step: an asynchronous save still in flight, the HF exports (trainer.save_hf), the
    engine closed, the curves drawn (spmdrl/loop.py's finish)."""

    def outputs() -> None:
        if job.cfg.trainer.save_hf:
            from spmdrl.checkpoint.export import export_hf

            out, dtype = job.run.output_dir, job.cfg.trainer.export_dtype
            if job.actor is not None:
                export_hf(job.actor.model, job.hf_files, out / "hf_model", dtype=dtype, group=job.actor_group)
            if job.critic is not None:
                export_hf(
                    job.critic.model,
                    job.tokenizer,
                    out / "critic_hf_model",
                    dtype=dtype,
                    group=job.critic_group,
                )
        if job.engine is not None:  # async: a trainer rank may hold none
            job.engine.close()

    loop.finish(job.run, job.checkpointer, job.logger, outputs=outputs, curves=lambda: draw_curves(job))
    log.info(
        "done: %d steps in %.0f s, outputs in %s",
        job.total_steps,
        time.perf_counter() - job.started_at,
        job.run.output_dir,
    )


# ------------------------------------------------------------------------------------- the set-up
def load_prompts(
    run: Run,
    tokenizer: object,
    files: list[str],
    tools: list[dict[str, Any]] | None = None,
    *,
    key: str = "data.train_files",
    processor: Any | None = None,
) -> PromptDataset:
    """The prompts of ``files``, the config's ``key`` (its split: data.train_split or data.val_split)."""
    d = run.cfg.data
    return PromptDataset(
        resolve_data_files(
            files,
            run.cache_dir,
            run.cfg.section(TinyTaskConfig),
            run.cfg.section(ToolsTaskConfig),
            run.cfg.section(ReasoningGymConfig),
            run.cfg.section(TinyShapesConfig),
        ),
        tokenizer,
        prompt_key=d.prompt_key,
        max_prompt_length=d.max_prompt_length,
        overlong=d.overlong,
        tools=tools,
        options=read_options(d, key),
        processor=processor,
    )


def _prompt_files(data: DataConfig, env_job: EnvJob | None) -> tuple[list[str], list[str]]:
    """data.train_files and data.val_files, or the environment's rows in their place (env.source)."""
    if env_job is None:
        return data.train_files, data.val_files
    return [str(env_job.train_file)], [str(env_job.val_file)] if env_job.val_file else []


def check_model_fits(model_dir: Path, max_model_len: int, tp: int, trust_remote_code: bool) -> None:
    """Prompt + response must fit the model's positions, and rollout.tp must split its attention heads:
    vLLM would refuse either only once the engine is built, after the warm-start."""
    from transformers import AutoConfig

    # (A vision-language model's decoder: its text config.)
    config = AutoConfig.from_pretrained(model_dir, trust_remote_code=trust_remote_code).get_text_config()
    limit = getattr(config, "max_position_embeddings", None)
    if limit is not None and max_model_len > limit:
        raise ConfigError(
            f"data.max_prompt_length + data.max_response_length (or rollout.max_model_len) = {max_model_len} "
            f"exceeds the model's max_position_embeddings={limit} ({model_dir}); shorten them"
        )
    heads = getattr(config, "num_attention_heads", None)
    kv = getattr(config, "num_key_value_heads", None) or heads
    if heads and (heads % tp or (kv and kv % tp and tp % kv)):
        fits = [t for t in range(1, heads + 1) if heads % t == 0 and (not kv or kv % t == 0 or t % kv == 0)]
        raise ConfigError(
            f"rollout.tp={tp} does not split the model's {heads} attention heads ({kv} key/value heads; "
            f"{model_dir}); use one of {fits}"
        )


def async_sampler(run: Run, placement: Placement, num_samples: int, per_rank: int) -> DistributedSampler:
    """parallel.placement=async: rollout rank j takes shard j of the rollout ranks' batches (what rank j of a
    synchronous run on that many ranks takes). A trainer rank keeps a sampler too, stepped once per batch it
    trains on: its position is what trainer.pt saves (rank 0 writes it); the rollout ranks' own, k batches
    ahead, is saved with their queues (spmdrl/rl/async_queue.py)."""
    spec = placement.role("rollout")
    index = run.env.rank - spec.first_rank if spec.has(run.env.rank) else 0
    return DistributedSampler(
        num_samples,
        rank=index,
        world_size=spec.num_ranks,
        batch_size_per_rank=per_rank,
        seed=run.cfg.data.seed,
        shuffle=run.cfg.data.shuffle,
    )


def val_only_stage(trainer: TrainerConfig) -> str:
    """The sub-directory of the output that metrics and samples go to: trainer.val_only's, else none."""
    return VAL_ONLY_STAGE if trainer.val_only else ""


def _hf_writer(model: torch.nn.Module, tokenizer: object) -> Callable[[Path], None]:
    return lambda d: write_hf_metadata(model, tokenizer, d)


def _data_sources(*datasets: PromptDataset | None) -> set[str]:
    return {ds[i].data_source for ds in datasets if ds is not None for i in range(len(ds))}
