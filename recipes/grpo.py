"""GRPO as one SPMD program. Read it top to bottom: it is the step in docs/architecture.md.

    torchrun --nproc_per_node=2 -m spmdrl.train recipe=grpo_tiny

Every rank, every step:
  1. rollout    its shard of the prompts -> rollout.n samples each, from the in-process vLLM engine
  2. reward     rule / user reward functions on its own samples (sandboxed, with a timeout)
  3. old, ref   the trainer's and the reference model's logprobs of the sampled tokens (when needed)
  4. batch      rows + advantages (algorithm.adv_estimator); a rank holds whole groups, so only the
                batch-wide statistics (whitening, GPG's scale) are summed over the actor's ranks
  5. update     policy loss (algorithm.policy_loss) + KL loss, mini-batches x micro-batches; every term
                is sum / (the mini-batch's global count) and FSDP sums gradients (algos/aggregation.py)
  6. sync       the actor's FSDP2 shards -> full tensors per bucket -> the engine, in place
  7. log        metrics (reduced over ranks), samples, validation, curves

With algorithm.adv_estimator=gae it is PPO: a critic (value head on the actor's backbone) is built, gives
the values GAE needs in step 4 and trains towards the returns in step 5 (recipe=ppo_tiny). With
parallel.placement=split the actor and the critic live on different ranks: the rows move to each role's
ranks (plan_rows), the values to the actor, the returns to the critic, the two updates run at the same
time, and the critic's ranks receive the actor's weights for their engines (docs/architecture.md).

Checkpoints (spmdrl/checkpoint/checkpointer.py) every trainer.save_every steps and after the last; a run
resumes from the newest complete one in its output directory (trainer.resume=auto), exactly.

The step's larger pieces live beside this file, one module each: grpo_rollout.py (rollout, reward and
validation), grpo_models.py (the actor, the reference and the critic), grpo_update.py (the logprob and
value passes and the updates) and grpo_metrics.py (the step's metrics). A fork that changes one of them
copies it too and imports its copy.

"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from spmdrl.algos.advantages import (
    NEEDS_BASELINE,
    NEEDS_CRITIC,
    NEEDS_SUM_PI_SQUARED,
    AdvantageInputs,
    compute_advantages,
    token_level_rewards,
)
from spmdrl.algos.batch import PolicyBatch, build_policy_batch
from spmdrl.algos.correction import metric_reduction, rollout_correction
from spmdrl.algos.kl_control import (
    AdaptiveKLController,
    FixedKLController,
    apply_kl_penalty,
    build_kl_controller,
)
from spmdrl.checkpoint.checkpointer import (
    Checkpointer,
    RoleState,
    checkpoint_root,
    load_checkpoint,
    plan_resume,
)
from spmdrl.checkpoint.export import write_hf_metadata
from spmdrl.config import Config, ConfigError, RLDerived, derive, derive_rl
from spmdrl.data.prompts import PromptDataset
from spmdrl.data.sampler import DistributedSampler
from spmdrl.data.tiny_task import resolve_data_files
from spmdrl.distributed.env import broadcast_object, broadcast_str
from spmdrl.distributed.placement import plan_placement
from spmdrl.distributed.reduce import all_reduce_max, all_reduce_min, all_reduce_sum, sum_over_group
from spmdrl.distributed.role_rows import plan_rows
from spmdrl.distributed.topology import check_tp_within_nodes, node_layout_from_env
from spmdrl.logging.metrics import truncate_after
from spmdrl.logging.plot import plot_curves
from spmdrl.logging.samples import write_samples
from spmdrl.logging.timer import PhaseTimer
from spmdrl.models.load import load_tokenizer, resolve_model_path_all_ranks
from spmdrl.optim import OptimizerOffload, build_lr_scheduler, build_optimizer
from spmdrl.recipes.grpo_metrics import step_metrics
from spmdrl.recipes.grpo_models import build_critic, build_models
from spmdrl.recipes.grpo_rollout import (
    check_reward_errors,
    greedy_rollout,
    rollout_and_score,
    score,
    train_samples,
    validate,
)
from spmdrl.recipes.grpo_update import (
    UpdateResult,
    logprobs_and_sum_pi_squared_of,
    logprobs_of,
    micro_rows,
    update_critic,
    update_policy,
    values_of,
)
from spmdrl.rewards.registry import check_data_sources, load_reward_fn
from spmdrl.rewards.sandbox import RewardResult
from spmdrl.rollout.engine import build_engine, check_engine_config
from spmdrl.rollout.rollout import Rollout, build_agent_loop, load_multi_turn_tools
from spmdrl.rollout.weight_sync import Fanout, SyncCheck, sync_weights
from spmdrl.runtime import Run, restart_count, start_run
from spmdrl.tools import tool_schemas

log = logging.getLogger("spmdrl")

CURVE_KEYS = ["rollout/reward_mean", "val/accuracy"]


# ----------------------------------------------------------------------------------------- set-up
def warmstart_config(cfg: Config) -> Config:
    """The SFT stage's config: the RL config with the warm-start's optimizer and batch settings."""
    ws = cfg.warmstart
    return dataclasses.replace(
        cfg,
        optim=ws.optim,
        trainer=dataclasses.replace(
            cfg.trainer,
            total_steps=ws.total_steps,
            global_batch_size=ws.global_batch_size,
            micro_batch_size=ws.micro_batch_size,
            val_every=0,
            save_hf=True,
        ),
    )


def load_prompts(
    run: Run, tokenizer: object, files: list[str], tools: list[dict[str, Any]] | None = None
) -> PromptDataset:
    d = run.cfg.data
    return PromptDataset(
        resolve_data_files(files, run.cache_dir, d.tiny, d.tiny_tools),
        tokenizer,
        prompt_key=d.prompt_key,
        max_prompt_length=d.max_prompt_length,
        overlong=d.overlong,
        tools=tools,
    )


# ------------------------------------------------------------------------------------ the pieces
def advantage_estimator(
    cfg: Config,
    num_prompts: int,
    baseline_B: torch.Tensor | None,
    values_BT: torch.Tensor | None = None,
    group: dist.ProcessGroup | None = None,
    *,
    old_logprobs_BT: torch.Tensor | None = None,
    sum_pi_squared_BT: torch.Tensor | None = None,
    is_weights_BT: torch.Tensor | None = None,
    reward_components_BK: torch.Tensor | None = None,
) -> Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    """algorithm.adv_estimator over this rank's rows (rollout.n consecutive samples per prompt):
    ``(token_rewards_BT, response_mask_BT) -> (advantages_BT, returns_BT)``. Group statistics are the
    rank's own (it holds whole groups); batch-wide ones are summed over ``group``, the actor's ranks, as
    verl computes them over the whole batch. Every rank of ``group`` must call it. The optimal token
    baseline reads the old logprobs, their sum of squared probabilities and any rollout-correction
    weights; gdpo its reward components (gdpo_reward_components)."""
    a = cfg.algorithm
    weights_K = tuple(a.gdpo_reward_weights) if a.gdpo_reward_weights is not None else None

    def advantages(
        token_rewards_BT: torch.Tensor, response_mask_BT: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        inputs = AdvantageInputs(
            token_rewards_BT,
            response_mask_BT,
            group_ids_B=torch.arange(num_prompts).repeat_interleave(cfg.rollout.n),
            values_BT=values_BT,
            baseline_B=baseline_B,
            batch_sum=sum_over_group(group),
            old_logprobs_BT=old_logprobs_BT,
            sum_pi_squared_BT=sum_pi_squared_BT,
            is_weights_BT=is_weights_BT,
            reward_components_BK=reward_components_BK,
            reward_weights_K=weights_K,
            gamma=a.gamma,
            lam=a.lam,
            norm_by_std=a.norm_adv_by_std,
        )
        return compute_advantages(a.adv_estimator, inputs)

    return advantages


def kl_in_reward(
    cfg: Config,
    batch: PolicyBatch,
    token_rewards_BT: torch.Tensor,
    kl_ctrl: FixedKLController | AdaptiveKLController,
    device: torch.device,
    group: dist.ProcessGroup | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """verl's use_kl_in_reward: rewards minus coef x KL(old policy || reference) per token on the sampled
    mask, the old policy being verl's old_log_probs: the trainer's recomputed logprobs, or the engine's in
    rollout_correction.bypass_mode (where verl sets old_log_probs to them). The adaptive controller moves
    coef with the KL of the whole batch (all ranks), so every rank agrees."""
    policy_BT = (
        batch.engine_logprobs_BT if cfg.algorithm.rollout_correction.bypass_mode else batch.old_logprobs_BT
    )
    assert batch.ref_logprobs_BT is not None and policy_BT is not None, "needs_old_logprobs says when"
    rewards_BT, mean_kl = apply_kl_penalty(
        token_rewards_BT,
        policy_BT,
        batch.ref_logprobs_BT,
        batch.response_mask_BT,
        kl_ctrl.value,
        cfg.algorithm.kl_penalty,
    )
    total = all_reduce_sum({"kl": float(mean_kl) * batch.num_rows, "n": batch.num_rows}, device, group)
    coef = kl_ctrl.value
    kl_ctrl.update(total["kl"] / total["n"], int(total["n"]))
    return rewards_BT, {
        "actor/reward_kl_penalty": total["kl"] / total["n"],
        "actor/reward_kl_penalty_coeff": coef,
    }


def correct_rollout(
    cfg: Config, batch: PolicyBatch, device: torch.device, group: dist.ProcessGroup | None = None
) -> tuple[PolicyBatch, dict[str, float]]:
    """verl's rollout correction: importance weights and rejection of the tokens or sequences whose
    engine logprobs stray too far from the trainer's (spmdrl/algos/correction.py)."""
    rc = cfg.algorithm.rollout_correction
    assert batch.old_logprobs_BT is not None
    corr = rollout_correction(
        batch.old_logprobs_BT,
        batch.engine_logprobs_BT,
        batch.response_mask_BT,
        rollout_is=rc.rollout_is or None,
        rollout_is_threshold=rc.rollout_is_threshold,
        rollout_is_batch_normalize=rc.rollout_is_batch_normalize,
        rollout_rs=rc.rollout_rs or None,
        rollout_rs_threshold=rc.rollout_rs_threshold or None,
    )
    # Over ranks: maxima by their max, minima by their min (verl computes them on the whole batch), the
    # rest as the mean of each rank's value (each over its own tokens).
    values = {k: float(v) for k, v in corr.metrics.items()}
    by = {r: {k: v for k, v in values.items() if metric_reduction(k) == r} for r in ("mean", "max", "min")}
    world = dist.get_world_size(group) if dist.is_initialized() else 1  # as all_reduce_*: one process
    reduced = {k: v / world for k, v in all_reduce_sum(by["mean"], device, group).items()}
    reduced.update(all_reduce_max(by["max"], device, group))
    reduced.update(all_reduce_min(by["min"], device, group))
    metrics = {f"rollout_corr/{k}": v for k, v in sorted(reduced.items())}
    return batch.replace(response_mask_BT=corr.mask_BT, is_weights_BT=corr.is_weights_BT), metrics


def batch_advantages(
    cfg: Config,
    batch: PolicyBatch,
    baseline_B: torch.Tensor | None,
    kl_ctrl: FixedKLController | AdaptiveKLController,
    device: torch.device,
    group: dist.ProcessGroup | None = None,
    reward_components_BK: torch.Tensor | None = None,
) -> tuple[PolicyBatch, dict[str, float]]:
    """Step 4 on the actor's ranks, in verl's order (its fit loop): the KL to the reference folded into
    the reward if asked (on the sampled mask), the rollout correction (its rejection edits the response
    mask), then algorithm.adv_estimator on the edited mask, so rejected tokens take no part in the
    whitening and returns. A rank holds whole groups; the batch-wide statistics are summed over ``group``.
    """
    a = cfg.algorithm
    assert batch.token_rewards_BT is not None
    token_rewards_BT, metrics = batch.token_rewards_BT, {}
    if a.use_kl_in_reward:
        token_rewards_BT, metrics = kl_in_reward(cfg, batch, token_rewards_BT, kl_ctrl, device, group)
    if a.rollout_correction.enabled:
        batch, corr_metrics = correct_rollout(cfg, batch, device, group)
        metrics.update(corr_metrics)
    estimate = advantage_estimator(
        cfg,
        batch.num_rows // cfg.rollout.n,
        baseline_B,
        batch.values_BT,
        group,
        old_logprobs_BT=batch.old_logprobs_BT,
        sum_pi_squared_BT=batch.sum_pi_squared_BT,
        is_weights_BT=batch.is_weights_BT,
        reward_components_BK=reward_components_BK,
    )
    advantages_BT, returns_BT = estimate(token_rewards_BT, batch.response_mask_BT)
    return batch.replace(advantages_BT=advantages_BT, returns_BT=returns_BT), metrics


def needs_old_logprobs(cfg: Config, rl: RLDerived) -> bool:
    """Whether step 3 recomputes the old logprobs. verl always does (outside its rollout-correction
    bypass mode); here only when the update's first forward is not the old policy (several optimizer
    steps), or when something needs them before the update: the rollout correction, and the KL in the
    reward (verl's apply_kl_penalty reads old_log_probs: recomputed ones, the engine's only in bypass
    mode)."""
    a = cfg.algorithm
    if a.rollout_correction.bypass_mode:
        return False  # the engine's logprobs are the old ones (verl's apply_bypass_mode)
    # The optimal token baseline reads the old policy's logprobs and sum of squared probabilities.
    otb = a.adv_estimator in NEEDS_SUM_PI_SQUARED
    several_steps = a.ppo_epochs > 1 or rl.mini_batches_per_step > 1
    return several_steps or a.rollout_correction.enabled or a.use_kl_in_reward or otb


def gdpo_reward_components(cfg: Config, rewards: RewardResult) -> torch.Tensor | None:
    """(B, K): each sample's algorithm.gdpo_reward_keys, from the reward function's returned dict; None
    for any other estimator."""
    a = cfg.algorithm
    if a.adv_estimator != "gdpo":
        return None
    keys = a.gdpo_reward_keys or []
    missing = [k for k in keys if k not in rewards.extra]
    if missing:
        raise RuntimeError(
            f"gdpo: the reward function returned no {missing} (algorithm.gdpo_reward_keys); it returned "
            f"{sorted(rewards.extra) or 'a plain score'}: return a dict with a float for each key"
        )
    components_BK = torch.tensor([rewards.extra[k] for k in keys], dtype=torch.float32).T
    # A sample whose reward call failed has no components: it scores reward.error_score in each, as its
    # score does.
    return torch.nan_to_num(components_BK, nan=cfg.reward.error_score)


# --------------------------------------------------------------------------------------- the run
def main(cfg: Config) -> None:
    run = start_run(cfg)
    env = run.env
    t_start = time.perf_counter()
    # An engine this machine cannot run (vLLM release, forced CPU GEMM path) fails now, not after the SFT.
    check_engine_config(cfg.rollout, env.device.type)
    # Which ranks run which role (a placement that cannot fit this world fails here, before any model).
    a, n = cfg.algorithm, cfg.rollout.n
    placement = plan_placement(cfg.parallel, env.world_size, needs_critic=a.adv_estimator in NEEDS_CRITIC)
    check_tp_within_nodes(cfg.rollout.tp, *node_layout_from_env())  # an engine never spans two nodes
    log.info("placement %s", placement.describe())

    # Resume: the newest complete checkpoint of this output directory (trainer.resume=auto), a path, or
    # none. Rank 0 decides for everyone (every rank must agree on it).
    restarted = restart_count() > 0
    found = plan_resume(cfg.trainer.resume, run.output_dir, restarted=restarted) if env.is_main else None
    resume_from = Path(p) if (p := broadcast_str(str(found or ""))) else None

    # Data, rewards and batch arithmetic: every check that can fail does so before the warm-start and the
    # engine (the tokenizer is the base model's; the warm-start's export keeps it).
    base_dir = resolve_model_path_all_ranks(cfg.model.path, run.cache_dir)
    tokenizer = load_tokenizer(base_dir, cfg.model.trust_remote_code)
    # Multi-turn tools load first: the prompts describe them to the model (the chat template's tools).
    tools = load_multi_turn_tools(cfg) if cfg.rollout.multi_turn.enable else None
    schemas = tool_schemas(tools) if tools else None
    train_ds = load_prompts(run, tokenizer, cfg.data.train_files, schemas)
    val_ds = load_prompts(run, tokenizer, cfg.data.val_files, schemas) if cfg.data.val_files else None
    derived = derive(cfg, env.world_size, len(train_ds), samples_per_item=cfg.rollout.n)
    if placement.is_split:
        rl = derive_rl(cfg, derived, train_ranks=placement.role("actor").num_ranks, role="actor")
        rl_critic = derive_rl(cfg, derived, train_ranks=placement.role("critic").num_ranks, role="critic")
    else:
        rl = rl_critic = derive_rl(cfg, derived)
    check_model_fits(base_dir, rl.max_model_len, cfg.rollout.tp, cfg.model.trust_remote_code)
    # Multi-turn: the chat template must render tool turns, the parser must load (before the warm-start).
    agent = build_agent_loop(cfg, tokenizer, tools, max_model_len=rl.max_model_len)
    reward_fn = load_reward_fn(cfg.reward.fn)
    check_data_sources(cfg.reward.fn, _data_sources(train_ds, val_ds))

    # Model files; optionally an SFT stage first (in this same job), whose export RL starts from.
    model_dir = base_dir
    if cfg.warmstart.enabled:
        # A resumed run's warm-start is done: its export sits next to the checkpoints.
        done = resume_from.parent.parent / "sft" / "hf_model" if resume_from else None
        if done is not None and (done / "config.json").is_file():
            log.info("warm-start done earlier: %s", done)
            model_dir = done
        else:
            if env.is_main and restarted:  # an attempt that died before its first checkpoint: start over
                truncate_after(run.output_dir / "sft" / "metrics.jsonl", -1)
            model_dir = _train_sft(run, warmstart_config(cfg))

    recompute_old = needs_old_logprobs(cfg, rl)
    # Offloaded parameters take their optimizer state with them; on a CPU trainer there is nowhere to move it.
    offload_optim = cfg.model.offload_optimizer and not cfg.model.offload_params and env.device.type == "cuda"
    run.log_derived(
        derived,
        **rl.as_dict(),
        placement=placement.describe(),
        critic_per_rank_mini_batch_seqs=rl_critic.per_rank_mini_batch_seqs,
        recompute_old_logprobs=recompute_old,
        offload_optimizer_between_updates=offload_optim,
        train_prompts=len(train_ds),
        train_filtered_overlong=train_ds.num_filtered,
        val_prompts=len(val_ds) if val_ds else 0,
    )
    sampler = DistributedSampler(
        len(train_ds),
        rank=env.rank,
        world_size=env.world_size,
        batch_size_per_rank=derived.per_rank_batch_size,
        seed=cfg.data.seed,
        shuffle=cfg.data.shuffle,
    )

    # Models on their meshes (colocated: the same ranks), then the engine on every rank.
    meshes = placement.build_meshes(env.device.type)
    is_actor, is_critic = meshes.holds("actor"), a.adv_estimator in NEEDS_CRITIC and meshes.holds("critic")
    actor_group, critic_group = meshes.group("actor"), meshes.group("critic")
    actor, ref = build_models(cfg, env.device, meshes, model_dir)
    critic = build_critic(cfg, env.device, meshes, model_dir, run.cache_dir) if is_critic else None
    optimizer = build_optimizer(actor, cfg.optim) if is_actor else None
    # model.offload_optimizer: the moments in (pinned) host memory between updates.
    actor_offload = OptimizerOffload(optimizer, env.device, offload_optim) if optimizer else None
    critic_offload = OptimizerOffload(critic.optimizer, env.device, offload_optim) if critic else None
    scheduler = build_lr_scheduler(optimizer, cfg.optim, derived.total_steps) if optimizer else None
    fanout = (
        Fanout(meshes.fanout_group, placement.fanout_ranks()[0], receiving=not is_actor)
        if meshes.fanout_group is not None
        else None
    )
    engine = build_engine(model_dir, cfg.rollout, max_model_len=rl.max_model_len, device_type=env.device.type)
    rollout = Rollout(engine, agent)
    metrics_path, samples_path = run.output_dir / "metrics.jsonl", run.output_dir / "samples.jsonl"
    kl_ctrl = build_kl_controller(
        a.kl_ctrl.type, a.kl_ctrl.kl_coef, target_kl=a.kl_ctrl.target_kl, horizon=a.kl_ctrl.horizon
    )

    # The state a checkpoint holds: each trained role (model, optimizer, schedule) on its own ranks, and
    # the loop's position (step, sampler, KL coefficient); RNG states are saved per rank.
    roles = [
        RoleState(
            "actor",
            is_actor,
            actor,
            optimizer,
            scheduler,
            actor_group,
            _hf_writer(actor, tokenizer),
            placement.role("actor").ranks,
        ),
    ]
    if a.adv_estimator in NEEDS_CRITIC:
        roles.append(
            RoleState(
                "critic",
                is_critic,
                *((critic.model, critic.optimizer, critic.scheduler) if critic else (None, None, None)),
                critic_group,
                _hf_writer(critic.model, tokenizer) if critic else None,
                placement.role("critic").ranks,
            )
        )
    start_step = 0
    if resume_from is not None:
        t_load = time.perf_counter()
        state = load_checkpoint(resume_from, roles)
        log.info("loaded %s in %.2f s", resume_from, time.perf_counter() - t_load)
        start_step = int(state["step"])
        sampler.load_state_dict(state["sampler"])
        kl_ctrl.value = float(state["kl_coef"])
        # The engine was built from the starting weights: load the checkpoint's, with the usual check.
        sync_weights(
            actor,
            engine,
            bucket_mb=cfg.rollout.weight_sync_bucket_mb,
            fanout=fanout,
            device=env.device,
            check=SyncCheck(0, cfg.rollout.weight_sync_check_tol) if cfg.rollout.weight_sync_check else None,
        )
        if env.is_main:  # the steps after the checkpoint are logged again
            dropped = truncate_after(metrics_path, start_step) + truncate_after(samples_path, start_step)
            log.info(
                "resumed from %s: step %d of %d (%d later log rows dropped)",
                resume_from,
                start_step,
                derived.total_steps,
                dropped,
            )
    elif restarted and env.is_main:
        truncate_after(metrics_path, -1)
        truncate_after(samples_path, -1)
    if start_step >= derived.total_steps:
        log.info("the checkpoint is at the last step (%d): nothing left to train", start_step)
    logger = run.metric_logger(derived.total_steps, resume_step=start_step)
    checkpointer = Checkpointer(
        checkpoint_root(run.output_dir),
        roles,
        keep=cfg.trainer.keep_checkpoints,
        async_save=cfg.trainer.async_save,
    )
    max_tokens = cfg.data.max_response_length
    pad_id = tokenizer.pad_token_id

    def run_validation(step: int) -> dict[str, float]:
        metrics, samples = validate(run, rollout, tokenizer, reward_fn, val_ds, max_tokens)  # type: ignore[arg-type]
        if env.is_main:
            write_samples(samples_path, [dataclasses.replace(s, step=step) for s in samples])
        return metrics

    if val_ds is not None and cfg.trainer.val_every > 0 and start_step == 0:
        logger.log(0, run_validation(0))

    for step in range(start_step + 1, derived.total_steps + 1):
        timer = PhaseTimer()

        # 1-2. Rollout and reward on every rank: this rank's prompts, rollout.n samples each, grouped by
        #      prompt (with DAPO's dynamic sampling, more batches until every rank has enough groups
        #      with signal).
        ro = rollout_and_score(cfg, rollout, sampler, train_ds, tokenizer, reward_fn, step, timer, env.device)
        check_reward_errors(cfg, ro.rewards, step, env.device)
        prompts, gens, rewards, responses = ro.prompts, ro.gens, ro.rewards, ro.responses
        baseline_B = None
        if a.adv_estimator in NEEDS_BASELINE:  # remax: each prompt's greedy answer is its baseline
            with timer("rollout"):
                greedy = greedy_rollout(rollout, prompts, cfg, step)
            with timer("reward"):
                baseline_B = score(cfg, reward_fn, tokenizer, prompts, greedy)[0].scores_B.repeat_interleave(
                    n
                )
        engine.sleep(keep_weights=False)  # CUDA: the next engine call is the sync; CPU: a no-op
        local = build_policy_batch([p.prompt_ids for p in prompts], gens, pad_id=pad_id).to(env.device)
        local = local.replace(
            token_rewards_BT=token_level_rewards(rewards.scores_B.to(env.device), local.response_mask_BT)
        )

        # Split placement: the rows go to the actor's ranks and to the critic's (tensor point-to-point).
        rows = plan_rows(cfg, placement, rl, rl_critic, local, env.device)
        with timer.maybe("exchange", rows.moves):
            batch = rows.to_actor(local)
            critic_batch = rows.to_critic(local) if critic is not None or placement.is_split else None
        sampled_mask_BT = batch.response_mask_BT if batch is not None else None  # before any rejection

        # 3. Old (a separate pass when the update takes several optimizer steps, corrects the rollout or
        #    folds the KL into the reward) and reference logprobs on the actor's ranks; values on the
        #    critic's (at once, when split).
        temp, pack = cfg.rollout.temperature, cfg.trainer.pack_sequences
        if batch is not None:
            with timer("old_ref"):
                if recompute_old:
                    parts = micro_rows(cfg, rl, batch, actor_group)
                    # The optimal token baseline also reads each step's sum of squared probabilities.
                    old_BT, sps_BT = logprobs_and_sum_pi_squared_of(
                        actor, batch, parts, temp, pack, a.adv_estimator in NEEDS_SUM_PI_SQUARED
                    )
                    batch = batch.replace(old_logprobs_BT=old_BT, sum_pi_squared_BT=sps_BT)
                if ref is not None:
                    parts = micro_rows(cfg, rl, batch, actor_group)
                    batch = batch.replace(ref_logprobs_BT=logprobs_of(ref, batch, parts, temp, pack))
        if critic is not None:
            assert critic_batch is not None
            with timer("values"):
                parts = micro_rows(cfg, rl_critic, critic_batch, critic_group)
                critic_batch = critic_batch.replace(
                    values_BT=values_of(critic.model, critic_batch, parts, pack)
                )
        if a.adv_estimator in NEEDS_CRITIC:
            with timer.maybe("exchange", rows.moves):
                batch = rows.values_to_actor(critic_batch, batch)

        # 4. Advantages on the actor's ranks, after the KL in the reward and the rollout correction's
        #    rejection (verl's order); batch-wide statistics over the actor's ranks.
        extra: dict[str, float] = {}
        if batch is not None:
            batch, extra = batch_advantages(
                cfg, batch, baseline_B, kl_ctrl, env.device, actor_group, gdpo_reward_components(cfg, rewards)
            )
        with timer.maybe("exchange", rows.moves):
            if a.adv_estimator in NEEDS_CRITIC:
                critic_batch = rows.returns_to_critic(batch, critic_batch)
            # parallel.balance_tokens, colocated: rows move only now, once the group advantages are known.
            batch, sampled_mask_BT = rows.balance_colocated(batch, sampled_mask_BT)
        if critic is not None and not placement.is_split:
            critic_batch = batch

        # 5. Update the critic and the actor: one after the other when colocated, at the same time on
        #    their own ranks when split.
        critic_metrics: dict[str, float] = {}
        update: UpdateResult | None = None
        # The engine is asleep: what is allocated now is the trainer's (parameters, moments, the batch), plus
        # the engine's sleep-mode allocations, which the allocator counts though their memory is released.
        resident_gb = torch.cuda.memory_allocated(env.device) / 2**30 if env.device.type == "cuda" else None
        with timer("update"):
            if critic is not None:
                assert critic_batch is not None and critic_offload is not None
                with timer("critic_update"), critic_offload.on_device():
                    critic_metrics = update_critic(cfg, rl_critic, critic, critic_batch, critic_group)
            if batch is not None:
                assert optimizer is not None and scheduler is not None and actor_offload is not None
                with timer("actor_update"):
                    if a.adv_estimator in NEEDS_CRITIC and step <= cfg.critic.warmup_steps:
                        # critic.warmup_steps: the actor waits for values that mean something (verl's
                        # critic_warmup); its logprobs are still computed, for the trainer-vs-engine metrics.
                        old_BT = (
                            batch.old_logprobs_BT
                            if batch.old_logprobs_BT is not None
                            else logprobs_of(
                                actor, batch, micro_rows(cfg, rl, batch, actor_group), temp, pack
                            )
                        )
                        update = UpdateResult({}, old_BT)
                    else:
                        with actor_offload.on_device():
                            update = update_policy(cfg, rl, actor, optimizer, batch, actor_group)
                        scheduler.step()  # once per RL step (optim.warmup_steps counts RL steps)

        # 6. Sync the new weights into every rank's engine; the check proves each engine now serves exactly
        #    them (split: the critic's ranks receive them from the first actor rank).
        with timer("weight_sync"):
            check = (
                SyncCheck(step, cfg.rollout.weight_sync_check_tol) if cfg.rollout.weight_sync_check else None
            )
            sync = sync_weights(
                actor,
                engine,
                bucket_mb=cfg.rollout.weight_sync_bucket_mb,
                check=check,
                fanout=fanout,
                device=env.device,
            )
        timer.add("weight_sync_check", sync.check_seconds)

        # 7. Log: metrics reduced over ranks (each role's over its own), samples, validation, curves.
        actor_part = None
        if batch is not None:
            assert update is not None and sampled_mask_BT is not None
            actor_part = (batch, sampled_mask_BT, update.old_logprobs_BT)
        if placement.is_split:  # the first critic rank tells rank 0, which logs
            critic_metrics = broadcast_object(critic_metrics, src=placement.role("critic").first_rank)
        metrics = {
            **step_metrics(cfg, ro, timer, env.device, actor_part, actor_group, resident_gb),
            **(update.metrics if update is not None else {}),
            **critic_metrics,
            **extra,
            **rows.metrics,
        }
        if scheduler is not None:
            metrics["actor/lr"] = scheduler.get_last_lr()[0]
        if env.is_main and cfg.logging.samples_every > 0 and step % cfg.logging.samples_every == 0:
            write_samples(
                samples_path, train_samples(step, tokenizer, prompts, gens, responses, rewards, cfg)
            )
        is_last = step == derived.total_steps
        if (
            val_ds is not None
            and cfg.trainer.val_every > 0
            and (step % cfg.trainer.val_every == 0 or is_last)
        ):
            metrics.update(run_validation(step))
        metrics["timing/step_s"] = timer.elapsed()
        logger.log(step, metrics)
        if env.is_main and "val/accuracy" in metrics:
            plot_curves(metrics_path, run.output_dir / "curves.png", CURVE_KEYS, title=cfg.name)
        # Logged first, saved second: a kill between them loses no row (the resumed run logs it again).
        if is_last or (cfg.trainer.save_every > 0 and step % cfg.trainer.save_every == 0):
            saved = checkpointer.save(
                step,
                {"sampler": sampler.state_dict(), "kl_coef": kl_ctrl.value},
                meta={"placement": placement.describe(), "total_steps": derived.total_steps},
            )
            if saved is not None:
                log.info("checkpoint %s: %.1f MB in %.2f s", saved.path, saved.bytes / 1e6, saved.seconds)

    saved = checkpointer.finish()  # an asynchronous save still in flight
    if saved is not None:
        log.info("checkpoint %s: %.1f MB in %.2f s", saved.path, saved.bytes / 1e6, saved.seconds)
    if cfg.trainer.save_hf:
        from spmdrl.checkpoint.export import export_hf

        if is_actor:
            export_hf(actor, tokenizer, run.output_dir / "hf_model", group=actor_group)
        if critic is not None:
            export_hf(critic.model, tokenizer, run.output_dir / "critic_hf_model", group=critic_group)
    engine.close()
    logger.close()
    if env.is_main and metrics_path.exists():
        plot_curves(metrics_path, run.output_dir / "curves.png", CURVE_KEYS, title=cfg.name)
    dist.barrier()
    log.info(
        "done: %d steps in %.0f s, outputs in %s",
        derived.total_steps,
        time.perf_counter() - t_start,
        run.output_dir,
    )


def _data_sources(*datasets: PromptDataset | None) -> set[str]:
    return {ds[i].data_source for ds in datasets if ds is not None for i in range(len(ds))}


def check_model_fits(model_dir: Path, max_model_len: int, tp: int, trust_remote_code: bool) -> None:
    """Prompt + response must fit the model's positions, and rollout.tp must split its attention heads:
    vLLM would refuse either only once the engine is built, after the warm-start."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_dir, trust_remote_code=trust_remote_code)
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


def _hf_writer(model: torch.nn.Module, tokenizer: object) -> Callable[[Path], None]:
    return lambda d: write_hf_metadata(model, tokenizer, d)


def _train_sft(run: Run, sft_cfg: Config) -> Path:
    from spmdrl.recipes.sft import train_sft

    try:
        return train_sft(run, sft_cfg, stage="sft")
    except ConfigError as e:
        raise ConfigError(
            f"in the SFT warm-start (its trainer.* batch keys come from warmstart.*): {e}"
        ) from None


if __name__ == "__main__":
    # A forked copy runs as a script: torchrun --nproc_per_node=2 my_grpo.py recipe=grpo_tiny ...
    from spmdrl.train import run_recipe

    run_recipe(main)
