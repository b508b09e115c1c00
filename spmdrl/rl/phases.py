"""GRPO's phases, written once for every schedule that runs them.

A recipe is a schedule: which ranks run which phase, in which order. recipes/grpo.py runs them one after
another on every rank; recipes/grpo_async.py generates on some ranks and trains on the others, up to k
batches apart; recipes/ppo.py adds a critic around the same generation, actor update and sync. What a
phase does is here, so a fix to one is made once:

  steps               the loop: validation at the start, each step profiled, checkpoints when due
                      (trainer.val_only: the validation alone)
  generate_and_score  prompts -> rollout.n samples each, scored; DAPO's overlong penalty and dynamic
                      sampling, reward_model.*'s rewards
  greedy_baseline     ReMax: each prompt's greedy answer, scored, is its baseline
  experience          rows -> old and reference logprobs, the KL in the reward, the rollout correction,
                      the advantages; parallel.balance_tokens' moves
  update_actor        the policy loss's PPO epochs, the learning rate's step
  sync                the actor's weights into the engines, checked
  actor_metrics       the step's metrics reduced over the ranks that hold its samples

Each takes the job and the step's state (``Step``) and names the process group it reduces over when a
schedule runs it on some ranks only (None: every rank).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from spmdrl.data.prompts import PromptExample
from spmdrl.logging.timer import PhaseTimer
from spmdrl.rl.batch import PolicyBatch
from spmdrl.rl.experience import (
    batch_advantages,
    gdpo_reward_components,
    old_and_ref_logprobs,
    teacher_logprobs_apart,
)
from spmdrl.rl.job import (
    RLJob,
    finish,
    profiled,
    save_checkpoint,
    saves_at,
    sync_actor_weights,
    validate_only,
    validates_at,
    validation,
)
from spmdrl.rl.metrics import step_metrics
from spmdrl.rl.perf import actor_perf_metrics
from spmdrl.rl.role_rows import plan_rows, to_actor_ranks
from spmdrl.rl.samples import (
    DynamicSampling,
    OverlongShaping,
    ScoredSamples,
    check_reward_errors,
    greedy_rollout,
    score,
    train_sampling,
)
from spmdrl.rl.settings import reward_settings
from spmdrl.rl.update import UpdateResult, update_policy
from spmdrl.rollout.engine import Generation, SamplingSpec

# What generates a batch's samples: the engine's generate, or a schedule's own (async: interruptible).
GenerateFn = Callable[[list[PromptExample], SamplingSpec], list[Generation]]


@dataclass
class Step:
    """One step on a rank that trains: what the phases produce, in their order (a field is set by its
    phase)."""

    step: int
    timer: PhaseTimer = field(default_factory=PhaseTimer)
    samples: ScoredSamples = field(init=False)  # generate_and_score (async: received with the rows)
    baseline_B: torch.Tensor | None = None  # greedy_baseline (ReMax)
    batch: PolicyBatch = field(init=False)  # experience: rows, logprobs, advantages
    sampled_mask_BT: torch.Tensor = field(init=False)  # experience: the mask before any rejection
    update: UpdateResult = field(init=False)  # update_actor
    resident_gb: float | None = None  # update_actor: what the trainer holds on the GPU when it starts
    val_metrics: dict[str, float] | None = None  # validation, when the schedule ran it before log
    metrics: dict[str, float] = field(default_factory=dict)  # the phases' own (KL in reward, correction)


def steps(
    job: RLJob, save: Callable[[RLJob, int], None] = save_checkpoint, step_type: type[Step] | None = None
) -> Iterator[Step]:
    """The RL loop every schedule runs: validation at step 0 of a run that starts, then each step from the
    one after the resumed checkpoint's to trainer.total_steps, yielded to the schedule's body under
    logging.profile_steps' profiler; after the body, ``save`` when a checkpoint is due (logged first, saved
    second: a kill between the two loses no row, the resumed run logs the step again); at the end,
    :func:`~spmdrl.rl.job.finish`. trainer.val_only: validation alone, no step
    (:func:`~spmdrl.rl.job.validate_only`)."""
    if job.cfg.trainer.val_only:
        validate_only(job)
        return
    if job.start_step == 0 and validates_at(job, 0):
        job.logger.log(0, validation(job, 0))
    for step in range(job.start_step + 1, job.total_steps + 1):
        with profiled(job, step):
            yield (step_type or Step)(step)
        if saves_at(job, step):
            save(job, step)
    finish(job)


def rollout_and_score(job: RLJob, s: Step) -> None:
    """The colocated schedules' generation: this rank's prompts -> rollout.n samples each, scored
    (:func:`generate_and_score`), with the rollout's own metrics (multi-turn: turns, tool calls); the run
    stops if too many samples got no score (reward.max_error_frac)."""
    s.samples = generate_and_score(job, s.step, s.timer)
    s.samples.metrics.update(job.rollout.take_metrics(job.device))
    check_reward_errors(reward_settings(job.cfg), s.samples.rewards, s.step, job.device)


def generate_and_score(
    job: RLJob,
    step: int,
    timer: PhaseTimer,
    *,
    group: dist.ProcessGroup | None = None,
    again: list[PromptExample] | None = None,
    generate: GenerateFn | None = None,
) -> ScoredSamples:
    """This rank's next prompts -> rollout.n samples each, grouped by prompt, scored (reward.fn, then
    reward_model.*'s models weighted with it). DAPO adds its overlong penalty on each batch's rewards
    (reward.overlong_buffer) and dynamic sampling (algorithm.filter_groups): only prompts whose samples
    differ are kept, and further batches are generated until every rank of ``group`` has a step's worth.
    ``again``: these prompts instead of the sampler's, unfiltered (a stale batch generated again).
    The samples' ``metrics`` hold what DAPO and the reward models measured, reduced over ``group``."""
    cfg = job.cfg
    shaping = None
    if cfg.reward.overlong_buffer.enable:
        shaping = OverlongShaping(cfg.reward.overlong_buffer, cfg.data.max_response_length, job.device, group)
    dynamic = None
    if cfg.algorithm.filter_groups.enable and again is None:
        dynamic = DynamicSampling(cfg.algorithm.filter_groups, cfg.rollout.n, step, job.device, group)
    for gen_batch in itertools.count(1):
        prompts = again if again is not None else [job.train_ds[i] for i in job.sampler.next_batch()]
        spec = train_sampling(cfg.rollout, cfg.data.max_response_length, step, gen_batch)
        with timer("rollout"):
            gens = generate(prompts, spec) if generate is not None else job.rollout.generate(prompts, spec)
        with timer("reward"):
            samples = score(cfg.reward, job.reward_fn, job.tokenizer, prompts, gens)
            if job.model_rewards is not None:  # reward_model.*: weighted with the rule (docs/rewards.md)
                samples = job.model_rewards(samples, step)
        if shaping is not None:
            samples = shaping(samples)
        if dynamic is None:
            break
        dynamic.add(samples)
        if dynamic.enough():
            samples = dynamic.kept()
            break
    samples.metrics = {
        **(dynamic.metrics() if dynamic else {}),  # rollout/num_gen_batches, ...
        **(shaping.metrics() if shaping else {}),  # reward/overlong_*
        **(job.model_rewards.metrics() if job.model_rewards else {}),  # reward/rm_score, ...
    }
    return samples


def greedy_baseline(
    job: RLJob,
    prompts: list[PromptExample],
    step: int,
    timer: PhaseTimer,
    group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """ReMax: each prompt's baseline is the reward of its greedy answer (one more rollout, one sample per
    prompt, scored as the samples are), repeated for its rollout.n rows."""
    cfg = job.cfg
    with timer("rollout"):
        greedy = greedy_rollout(job.rollout, prompts, cfg.rollout.stop, cfg.data.max_response_length, step)
    with timer("reward"):
        baseline = score(cfg.reward, job.reward_fn, job.tokenizer, prompts, greedy)
        if job.model_rewards is not None:  # the same reward as the samples'
            baseline = job.model_rewards(baseline, step, record=False)
    check_reward_errors(
        reward_settings(cfg), baseline.rewards, step, job.device, group, what="greedy ReMax baselines"
    )
    return baseline.scores_B.repeat_interleave(cfg.rollout.n)


def experience(job: RLJob, s: Step, batch: PolicyBatch, group: dist.ProcessGroup | None = None) -> None:
    """The rows the update trains on, in verl's order, from the step's samples as rows (each one's reward
    at its last token): the old logprobs (a pass of their own only when something needs them) and the
    reference's; the KL folded into the reward and the rollout correction (whose rejection edits the
    response mask); then the advantages on the edited mask. A rank holds whole groups, so only batch-wide
    statistics (whitening, GPG's scale) are summed over the actor's ranks. parallel.balance_tokens moves
    rows among ``group`` only after that (the advantages needed whole groups).

    parallel.teacher_ranks (the teacher on ranks of its own): first every rank's rows go to the teacher's
    ranks and its logprobs come back, then the rows go to the actor's ranks (:func:`teacher_first`); a
    teacher's rank has nothing more to do in the step (``s.batch`` stays unset there)."""
    cfg = job.cfg
    components_BK = gdpo_reward_components(cfg.algorithm, cfg.reward, s.samples.rewards)
    if job.placement.teacher_apart:
        moved = teacher_first(job, s, batch, components_BK)
        if moved is None:
            return
        batch, components_BK = moved
        group = job.actor_group
    with s.timer("experience"):
        rows = plan_rows(cfg.parallel.balance_tokens, job.placement, job.rl, batch, job.device, group=group)
    sampled_mask_BT = batch.response_mask_BT  # the mismatch metric reads every sampled token
    # Timed only when a pass runs: an on-policy step without a reference or a teacher runs none.
    colocated_teacher = None if job.placement.teacher_apart else job.teacher
    with s.timer.maybe("old_ref", job.recompute_old or job.ref is not None or colocated_teacher is not None):
        batch = old_and_ref_logprobs(
            job.update_settings,
            job.rl,
            job.trained("actor").model,
            job.ref,
            batch,
            job.actor_group,
            recompute_old=job.recompute_old,
            teacher=colocated_teacher,
        )
    with s.timer("experience"):  # the advantages (ReMax's baseline, gdpo's components where they apply)
        batch, metrics = batch_advantages(
            cfg.algorithm,
            cfg.rollout.n,
            batch,
            s.baseline_B,
            job.kl_ctrl,
            job.device,
            job.actor_group,
            components_BK,
            cfg.teacher,
        )
    s.metrics.update(metrics)
    with s.timer.maybe("exchange", rows.moves):
        s.batch, s.sampled_mask_BT = rows.balance_colocated(batch, sampled_mask_BT)  # type: ignore[assignment]
    s.metrics.update(rows.metrics)


def teacher_first(
    job: RLJob, s: Step, batch: PolicyBatch, components_BK: torch.Tensor | None
) -> tuple[PolicyBatch, torch.Tensor | None] | None:
    """parallel.teacher_ranks, on every rank: this rank's rows to the teacher's own ranks, scored there, the
    logprobs back (timed as old_ref), then the rows with them, ReMax's baselines (``s.baseline_B``, replaced)
    and gdpo's components to the actor's ranks (timed as exchange). The actor's rows and components, or
    None on a rank of the teacher's, which keeps none."""
    with s.timer("old_ref"):
        teacher_BT = teacher_logprobs_apart(
            job.update_settings,
            job.rl,
            job.teacher,
            batch,
            job.placement,
            job.meshes.group("teacher"),
            job.device,
        )
    columns = {}
    if s.baseline_B is not None:
        columns["baseline_B"] = s.baseline_B.to(job.device, torch.float32).view(-1, 1)
    if components_BK is not None:
        columns["components_BK"] = components_BK.to(job.device)
    with s.timer("exchange"):
        moved = to_actor_ranks(
            job.placement, batch.replace(teacher_logprobs_BT=teacher_BT), columns, job.device
        )
    if moved is None:
        return None
    batch, columns = moved
    # On the host, where the ranks that generated them keep them.
    if "baseline_B" in columns:
        s.baseline_B = columns["baseline_B"].view(-1).cpu()
    components = columns.get("components_BK")
    return batch, components.cpu() if components is not None else None


def update_actor(job: RLJob, batch: PolicyBatch) -> UpdateResult:
    """The actor's update on ``batch``; the learning rate steps once per RL step (optim.warmup_steps
    counts RL steps). model.offload_optimizer brings the moments back for it."""
    actor = job.trained("actor")
    with actor.offload.on_device():
        result = update_policy(
            job.update_settings, job.rl, actor.model, actor.optimizer, batch, job.actor_group
        )
    actor.scheduler.step()
    return result


def resident_gb(job: RLJob) -> float | None:
    """What is allocated on the GPU as the update starts: the trainer's (parameters, moments, the batch),
    plus the asleep engine's sleep-mode allocations, which the allocator counts though they are released."""
    return torch.cuda.memory_allocated(job.device) / 2**30 if job.device.type == "cuda" else None


def sync(job: RLJob, s: Step) -> None:
    """The new weights into the engines; the check (rollout.weight_sync_check) proves each engine now
    serves exactly them, or stops the run instead of training on stale rollouts. Its parts (wake, load,
    prefix-cache reset, check) are timed as phases of the step."""
    with s.timer("weight_sync"):
        stats = sync_actor_weights(job, check_seed=s.step)
    for phase, seconds in stats.phases().items():
        s.timer.add(phase, seconds)


def actor_metrics(job: RLJob, s: Step, group: dist.ProcessGroup | None = None) -> dict[str, float]:
    """The step's metrics (docs/metrics.md) reduced over ``group``, the ranks that hold its samples: the
    rollout's, the rewards', the timings, the trainer-vs-engine mismatch, the update's, the phases' own,
    the learning rate, and the tokens/s and MFU of the update and of the old/ref passes. On a rank of the
    teacher's own (parallel.teacher_ranks), which trains nothing, only the part reduced over ``group``
    (rank 0, which logs, is the actor's)."""
    if job.actor is None:  # the same reductions as the actor's ranks' (resident_gb too: the same keys)
        n, epochs = job.cfg.rollout.n, job.cfg.algorithm.ppo_epochs
        return step_metrics(
            n, epochs, s.samples, s.timer, job.device, None, job.actor_group, s.resident_gb, group=group
        )
    actor = job.actor
    actor_part = (s.batch, s.sampled_mask_BT, s.update.old_logprobs_BT)
    metrics = {
        **step_metrics(
            job.cfg.rollout.n,
            job.cfg.algorithm.ppo_epochs,
            s.samples,
            s.timer,
            job.device,
            actor_part,
            job.actor_group,
            s.resident_gb,
            group=group,
        ),
        **s.update.metrics,
        **s.metrics,
        "actor/lr": actor.scheduler.get_last_lr()[0],
    }
    # The teacher's pass runs on the actor's ranks unless it has ranks of its own.
    teacher_here = job.teacher is not None and not job.placement.teacher_apart
    passes = int(job.recompute_old) + int(job.ref is not None) + int(teacher_here)
    metrics.update(
        actor_perf_metrics(
            job.cfg.model,
            job.cfg.algorithm.ppo_epochs,
            actor.model,
            s.batch,
            metrics,
            forward_passes=passes,
            device=job.device,
            group=job.actor_group,
        )
    )
    return metrics
