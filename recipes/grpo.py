"""GRPO as one SPMD program: a step of named phases over one state carrier. Read it top to bottom.

    torchrun --nproc_per_node=2 -m spmdrl.train recipe=grpo_tiny

Every rank, every step, one function per phase (a fork replaces any one of them on its own):

  rollout_and_score  this rank's prompts -> rollout.n samples each from the in-process vLLM engine, scored
                     by reward.fn in the sandbox; DAPO adds its overlong penalty and dynamic sampling here
  remax_baseline     adv_estimator=remax only: each prompt's greedy answer, scored, is its baseline
  make_experience    the samples as rows; the old logprobs (when needed) and the reference's; the KL in
                     the reward and the rollout correction, then the advantages (algorithm.adv_estimator)
  update             policy loss (algorithm.policy_loss) + KL loss, PPO epochs x mini-batches x
                     micro-batches; every term is sum / (the mini-batch's global count), FSDP sums the
                     gradients (spmdrl/algos/aggregation.py)
  sync               the actor's FSDP2 shards -> full tensors per bucket -> the engine, in place, checked
  log                metrics reduced over ranks, samples, validation, curves
  checkpoint         every trainer.save_every steps and after the last; a run resumes from the newest
                     complete one in its output directory (trainer.resume=auto), exactly

The pieces are the library's (spmdrl/rl/: job.py builds what the phases work with, samples.py,
experience.py, update.py, metrics.py). This file imports nothing else from recipes/: a copy of it, alone,
anywhere, is a fork.

Deliberately simple: no critic (PPO is recipes/ppo.py), so every rank holds every role and trains on the
samples it generated (parallel.balance_tokens aside); the phases run one after another (generation
never overlaps training); a step is exactly trainer.global_batch_size prompts, whatever DAPO drops;
rewards are computed on the CPU of the rank that generated the samples.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch

from spmdrl.algos.advantages import adv_estimator
from spmdrl.config import Config, ConfigError
from spmdrl.logging.timer import PhaseTimer
from spmdrl.rl.batch import PolicyBatch
from spmdrl.rl.experience import batch_advantages, gdpo_reward_components, old_and_ref_logprobs, policy_batch
from spmdrl.rl.job import (
    RLJob,
    build_job,
    finish,
    log_step,
    profiled,
    save_checkpoint,
    sync_actor_weights,
    validates_at,
    validation,
)
from spmdrl.rl.metrics import step_metrics
from spmdrl.rl.perf import actor_perf_metrics
from spmdrl.rl.role_rows import plan_rows
from spmdrl.rl.samples import (
    DynamicSampling,
    OverlongShaping,
    ScoredSamples,
    check_reward_errors,
    greedy_rollout,
    score,
    train_sampling,
)
from spmdrl.rl.update import UpdateResult, update_policy


@dataclass
class Step:
    """One step on this rank: what the phases produce, in their order (a field is set by its phase)."""

    step: int
    timer: PhaseTimer = field(default_factory=PhaseTimer)
    samples: ScoredSamples = field(init=False)  # rollout_and_score
    baseline_B: torch.Tensor | None = None  # remax_baseline
    batch: PolicyBatch = field(init=False)  # make_experience: rows, logprobs, advantages
    sampled_mask_BT: torch.Tensor = field(init=False)  # make_experience: the mask before any rejection
    update: UpdateResult = field(init=False)  # update
    resident_gb: float | None = None  # update: what the trainer holds on the GPU when it starts
    metrics: dict[str, float] = field(default_factory=dict)  # make_experience's (KL in reward, correction)


def check_config(cfg: Config) -> None:
    """Settings this recipe would not run fail at config load (spmdrl.config_loader calls this)."""
    a = cfg.algorithm
    if adv_estimator(a.adv_estimator).needs_critic:
        raise ConfigError(
            f"algorithm.adv_estimator={a.adv_estimator} needs a critic, and this recipe ({cfg.entry}) trains "
            f"none (recipe {cfg.name!r}): set entry: ppo, the PPO recipe with a critic (recipes/ppo.py, as in "
            "recipe=ppo_tiny), or choose a critic-free algorithm.adv_estimator such as grpo"
        )


def main(cfg: Config) -> None:
    job = build_job(cfg)  # checks, data, warm-start, models, engine; resumed from the newest checkpoint
    if job.start_step == 0 and validates_at(job, 0):
        job.logger.log(0, validation(job, 0))
    for step in range(job.start_step + 1, job.total_steps + 1):
        s = Step(step)
        with profiled(job, step):  # logging.profile_steps
            rollout_and_score(job, s)
            if adv_estimator(cfg.algorithm.adv_estimator).needs_baseline:  # ReMax
                remax_baseline(job, s)
            make_experience(job, s)
            update(job, s)
            sync(job, s)
            log(job, s)
        checkpoint(job, s)
    finish(job)


def rollout_and_score(job: RLJob, s: Step) -> None:
    """This rank's prompts -> rollout.n samples each, grouped by prompt, with their rewards.

    DAPO adds two things: its overlong penalty on each batch's rewards (reward.overlong_buffer), and
    dynamic sampling (algorithm.filter_groups): only prompts whose samples differ are kept, and further
    batches are generated until every rank has a step's worth of them."""
    cfg = job.cfg
    shaping = OverlongShaping(cfg, job.device) if cfg.reward.overlong_buffer.enable else None
    dynamic = DynamicSampling(cfg, s.step, job.device) if cfg.algorithm.filter_groups.enable else None
    for gen_batch in itertools.count(1):
        prompts = [job.train_ds[i] for i in job.sampler.next_batch()]
        with s.timer("rollout"):
            gens = job.rollout.generate(prompts, train_sampling(cfg, s.step, gen_batch))
        with s.timer("reward"):
            samples = score(cfg, job.reward_fn, job.tokenizer, prompts, gens)
            if job.model_rewards is not None:  # reward_model.*: weighted with the rule (docs/rewards.md)
                samples = job.model_rewards(samples, s.step)
        if shaping is not None:
            samples = shaping(samples)
        if dynamic is None:
            break
        dynamic.add(samples)
        if dynamic.enough():
            samples = dynamic.kept()
            break
    samples.metrics = {
        **job.rollout.take_metrics(job.device),  # multi-turn: turns, tool calls
        **(dynamic.metrics() if dynamic else {}),
        **(shaping.metrics() if shaping else {}),
        **(job.model_rewards.metrics() if job.model_rewards else {}),  # reward/rm_score, ...
    }
    check_reward_errors(cfg, samples.rewards, s.step, job.device)
    s.samples = samples


def remax_baseline(job: RLJob, s: Step) -> None:
    """ReMax: each prompt's baseline is the reward of its greedy answer (one more rollout, one sample)."""
    cfg, prompts = job.cfg, s.samples.prompts
    with s.timer("rollout"):
        greedy = greedy_rollout(job.rollout, prompts, cfg, s.step)
    with s.timer("reward"):
        baseline = score(cfg, job.reward_fn, job.tokenizer, prompts, greedy)
        if job.model_rewards is not None:  # the same reward as the samples'
            baseline = job.model_rewards(baseline, s.step, record=False)
        scores_B = baseline.scores_B
    check_reward_errors(cfg, baseline.rewards, s.step, job.device, what="greedy ReMax baselines")
    s.baseline_B = scores_B.repeat_interleave(cfg.rollout.n)


def make_experience(job: RLJob, s: Step) -> None:
    """The rows the update trains on, in verl's order: the samples as rows (each one's reward at its last
    token); the old logprobs (a pass of their own only when something needs them) and the reference's;
    the KL folded into the reward and the rollout correction (whose rejection edits the response mask);
    then the advantages on the edited mask. A rank holds whole groups, so only batch-wide statistics
    (whitening, GPG's scale) are summed over the ranks."""
    cfg = job.cfg
    with s.timer("engine_sleep"):  # generation is over (CUDA: the next engine call is the sync)
        job.engine.sleep(keep_weights=False)
    with s.timer("experience"):  # the rows on the device, and where they go (parallel.balance_tokens)
        batch = policy_batch(s.samples, job.tokenizer.pad_token_id, job.device)
        rows = plan_rows(cfg, job.placement, job.rl, batch, job.device)
    sampled_mask_BT = batch.response_mask_BT  # the mismatch metric reads every sampled token
    # Timed only when a pass runs (the old logprobs, the reference's): an on-policy step without a
    # reference runs neither, and logs no timing/old_ref_s.
    with s.timer.maybe("old_ref", job.recompute_old or job.ref is not None):
        batch = old_and_ref_logprobs(
            cfg, job.rl, job.actor, job.ref, batch, job.actor_group, recompute_old=job.recompute_old
        )
    with s.timer("experience"):  # the advantages
        components_BK = gdpo_reward_components(cfg, s.samples.rewards)
        batch, s.metrics = batch_advantages(
            cfg, batch, s.baseline_B, job.kl_ctrl, job.device, job.actor_group, components_BK
        )
    # parallel.balance_tokens: the rows move only now, as the group advantages needed whole groups.
    with s.timer.maybe("exchange", rows.moves):
        s.batch, s.sampled_mask_BT = rows.balance_colocated(batch, sampled_mask_BT)  # type: ignore[assignment]
    s.metrics.update(rows.metrics)


def update(job: RLJob, s: Step) -> None:
    """The actor's update; the learning rate steps once per RL step (optim.warmup_steps counts RL steps)."""
    assert job.optimizer is not None and job.scheduler is not None and job.actor_offload is not None
    # The engine is asleep: what is allocated now is the trainer's (parameters, moments, the batch), plus the
    # engine's sleep-mode allocations, which the allocator counts though their memory is released.
    if job.device.type == "cuda":
        s.resident_gb = torch.cuda.memory_allocated(job.device) / 2**30
    with s.timer("update"), s.timer("actor_update"):
        with job.actor_offload.on_device():  # model.offload_optimizer: the moments back for the update
            s.update = update_policy(job.cfg, job.rl, job.actor, job.optimizer, s.batch, job.actor_group)
        job.scheduler.step()


def sync(job: RLJob, s: Step) -> None:
    """The new weights into every rank's engine; the check (rollout.weight_sync_check) proves each engine
    now serves exactly them, or stops the run instead of training on stale rollouts."""
    with s.timer("weight_sync"):
        stats = sync_actor_weights(job, check_seed=s.step)
    for phase, seconds in stats.phases().items():  # its parts: wake, load, prefix-cache reset, check
        s.timer.add(phase, seconds)


def log(job: RLJob, s: Step) -> None:
    """The step's metrics (reduced over ranks; docs/metrics.md), its samples (logging.samples_every) and
    validation (trainer.val_every); a row every trainer.log_every steps, at validations and at the last."""
    cfg, step = job.cfg, s.step
    assert job.scheduler is not None
    actor_part = (s.batch, s.sampled_mask_BT, s.update.old_logprobs_BT)
    metrics = {
        **step_metrics(cfg, s.samples, s.timer, job.device, actor_part, job.actor_group, s.resident_gb),
        **s.update.metrics,
        **s.metrics,
        "actor/lr": job.scheduler.get_last_lr()[0],
    }
    # Tokens/s and MFU of the update and of the old/ref passes (spmdrl/logging/flops.py counts the FLOPs).
    passes = int(job.recompute_old) + int(job.ref is not None)
    metrics.update(
        actor_perf_metrics(
            cfg, job.actor, s.batch, metrics, forward_passes=passes, device=job.device, group=job.actor_group
        )
    )
    log_step(job, step, metrics, s.samples, s.timer)


def checkpoint(job: RLJob, s: Step) -> None:
    """Every trainer.save_every steps and after the last. Logged first, saved second: a kill between the
    two loses no row (the resumed run logs the step again)."""
    every = job.cfg.trainer.save_every
    if s.step == job.total_steps or (every > 0 and s.step % every == 0):
        save_checkpoint(job, s.step)


if __name__ == "__main__":
    # A forked copy runs as a script: torchrun --nproc_per_node=2 my_grpo.py recipe=grpo_tiny ...
    from spmdrl.train import run_recipe

    run_recipe(main)
