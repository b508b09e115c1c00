"""PPO with a critic as one SPMD program: GRPO's step (recipes/grpo.py) plus a value model. Read it top to
bottom.

    torchrun --nproc_per_node=2 -m spmdrl.train recipe=ppo_tiny

The critic is a value head on the actor's backbone (or critic.model_path), trained towards the returns;
the advantage is GAE over its values (algorithm.adv_estimator=gae; gamma = lambda = 1 is the Monte-Carlo
return minus the value). Every rank, every step, one function per phase:

  rollout_and_score  this rank's prompts -> rollout.n samples each from the in-process engine, scored
  make_experience    the samples as rows, on each role's ranks; old and reference logprobs on the
                     actor's, values on the critic's; the values to the actor, where the KL in the reward,
                     the rollout correction and GAE run; the returns back to the critic
  update             the critic's clipped value loss and the actor's policy loss: one after the other
                     when colocated, at the same time on their own ranks when split; during the first
                     critic.warmup_steps steps only the critic trains
  sync               the actor's weights into every rank's engine (split: the critic's ranks too), checked
  log, checkpoint    as GRPO's, with the critic's metrics and state

parallel.placement=split puts the critic on ranks of its own (parallel.critic_ranks): spmdrl/rl/role_rows.py
lays the rows out for each role's ranks (balanced by tokens with parallel.balance_tokens), and the moves
between them are this file's (to_role, values_to_actor, returns_to_critic). Only the first actor rank's
copy of the actor's weights reaches the critic's engines (a broadcast, docs/architecture.md).

Deliberately simple: the critic scores every token of the response (no per-turn values); DAPO's dynamic
sampling and ReMax's baseline are GRPO's (entry: grpo); this file imports nothing from recipes/.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

import spmdrl.rl.job as rl
from spmdrl.algos.advantages import adv_estimator
from spmdrl.config import Config
from spmdrl.distributed.env import broadcast_object
from spmdrl.errors import ConfigError
from spmdrl.models.head import fused_chunk_for
from spmdrl.rl import phases
from spmdrl.rl.batch import PolicyBatch
from spmdrl.rl.experience import batch_advantages, old_and_ref_logprobs, policy_batch
from spmdrl.rl.metrics import step_metrics
from spmdrl.rl.perf import actor_perf_metrics, critic_perf_metrics
from spmdrl.rl.plan import check_val_only
from spmdrl.rl.role_rows import RowPlan, fit_width, plan_rows
from spmdrl.rl.update import (
    UpdateResult,
    logprobs_of,
    micro_rows,
    update_critic,
    values_of,
)


@dataclass
class Step(phases.Step):
    """GRPO's step (spmdrl/rl/phases.py) and the critic's. Under a split placement a rank holds one role:
    the actor's fields are None on the critic's ranks, the critic's on the actor's."""

    batch: PolicyBatch | None = None  # type: ignore[assignment]  # the actor's rows, values, advantages
    sampled_mask_BT: torch.Tensor | None = None  # type: ignore[assignment]
    update: UpdateResult | None = None  # type: ignore[assignment]  # the actor's
    critic_batch: PolicyBatch | None = None  # make_experience: the critic's rows, values, returns
    critic_metrics: dict[str, float] = field(default_factory=dict)  # update: the critic's


# The roles beyond the actor, the reference and the engines: a critic (--check --world-size N plans them).
ROLES = rl.Roles(critic=True)


def check_config(cfg: Config) -> None:
    """Settings this recipe would not run fail at config load (spmdrl.config_loader calls this)."""
    check_val_only(cfg)  # trainer.val_only needs data.val_files
    a = cfg.algorithm
    if not adv_estimator(a.adv_estimator).needs_critic:
        raise ConfigError(
            f"this recipe ({cfg.entry}) trains a critic for a critic-based algorithm.adv_estimator (gae), "
            f"got {a.adv_estimator!r} (recipe {cfg.name!r}): set algorithm.adv_estimator=gae, or entry: grpo "
            f"for {a.adv_estimator}"
        )
    if cfg.teacher.enabled:
        raise ConfigError(
            f"teacher.path={cfg.teacher.path} (on-policy distillation) runs in entry: grpo (recipes/grpo.py, as "
            f"in recipe=opd_tiny), not in this recipe ({cfg.entry}, recipe {cfg.name!r}): remove teacher.path, "
            "or use entry: grpo"
        )
    if a.filter_groups.enable:
        raise ConfigError(
            f"algorithm.filter_groups.enable=true (DAPO's dynamic sampling) runs in entry: grpo (recipes/grpo.py), "
            f"not in this recipe ({cfg.entry}, recipe {cfg.name!r}): turn it off, or use entry: grpo"
        )


def main(cfg: Config) -> None:
    job = rl.build_job(cfg, ROLES)  # checks, data, warm-start, models, engine; resumed if saved
    for s in phases.steps(job, step_type=Step):  # each role saves from its own ranks
        phases.rollout_and_score(job, s)  # GRPO's, with DAPO's overlong penalty
        make_experience(job, s)
        update(job, s)
        phases.sync(job, s)  # split: the critic's ranks' engines from the first actor rank
        log(job, s)


def make_experience(job: rl.RLJob, s: Step) -> None:
    """The rows each role trains on. Old and reference logprobs on the actor's ranks and the values on the
    critic's (at the same time, when split); GAE on the actor's ranks, after the KL in the reward and the
    rollout correction (verl's order), so the returns and the final response mask go back to the critic."""
    cfg = job.cfg
    with s.timer("engine_sleep"):  # generation is over (CUDA: the next engine call is the sync)
        job.engine.sleep(keep_weights=False)
    with s.timer("experience"):  # the rows on the device, and where each role's go
        local = policy_batch(s.samples, job.tokenizer.pad_token_id, job.device)
        rows = plan_rows(
            cfg.parallel.balance_tokens, job.placement, job.rl, local, job.device, job.plan.rl_critic
        )
    with s.timer.maybe("exchange", rows.moves):
        batch, critic_batch = to_role(rows, local, "actor"), to_role(rows, local, "critic")
    sampled_mask_BT = batch.response_mask_BT if batch is not None else None  # the mismatch metric's
    if job.actor is not None and batch is not None:
        # Timed only when a pass runs (the old logprobs, the reference's): an on-policy step without a
        # reference runs neither, and logs no timing/old_ref_s.
        with s.timer.maybe("old_ref", job.recompute_old or job.ref is not None):
            batch = old_and_ref_logprobs(
                job.update_settings,
                job.rl,
                job.actor.model,
                job.ref,
                batch,
                job.actor_group,
                recompute_old=job.recompute_old,
            )
    if job.critic is not None and critic_batch is not None:
        with s.timer("values"):
            parts = micro_rows(cfg.trainer, job.critic.rl, critic_batch, job.critic_group)
            values_BT = values_of(job.critic.model, critic_batch, parts, cfg.trainer.pack_sequences)
            critic_batch = critic_batch.replace(values_BT=values_BT)
    with s.timer.maybe("exchange", rows.moves):
        batch = values_to_actor(rows, critic_batch, batch)
    if batch is not None:
        with s.timer("experience"):  # GAE
            batch, s.metrics = batch_advantages(
                cfg.algorithm, cfg.rollout.n, batch, None, job.kl_ctrl, job.device, job.actor_group
            )
    with s.timer.maybe("exchange", rows.moves):
        critic_batch = returns_to_critic(rows, batch, critic_batch)
        # parallel.balance_tokens, colocated: the rows move only now, as GAE's whitening is batch-wide.
        batch, sampled_mask_BT = rows.balance_colocated(batch, sampled_mask_BT)
    # Colocated, the critic trains on the actor's rows: the same returns and (rejection-edited) mask.
    s.critic_batch = critic_batch if job.placement.is_split else batch
    s.batch, s.sampled_mask_BT = batch, sampled_mask_BT
    s.metrics.update(rows.metrics)


def update(job: rl.RLJob, s: Step) -> None:
    """The critic's update, then the actor's (colocated), or both at once on their own ranks (split)."""
    cfg = job.cfg
    s.resident_gb = phases.resident_gb(job)  # the engine is asleep: this is the trainer's
    with s.timer("update"):
        if job.critic is not None and s.critic_batch is not None:
            with s.timer("critic_update"), job.critic.offload.on_device():
                s.critic_metrics = update_critic(
                    job.update_settings,
                    cfg.critic,
                    job.critic.rl,
                    job.critic,
                    s.critic_batch,
                    job.critic_group,
                )
        if s.batch is not None:
            with s.timer("actor_update"):
                waits = s.step <= cfg.critic.warmup_steps
                s.update = actor_waits(job, s.batch) if waits else phases.update_actor(job, s.batch)


def actor_waits(job: rl.RLJob, batch: PolicyBatch) -> UpdateResult:
    """critic.warmup_steps (verl's critic_warmup): the actor waits for values that mean something. Its
    logprobs are still computed, for the trainer-vs-engine metrics."""
    cfg, actor = job.cfg, job.trained("actor")
    old_BT = batch.old_logprobs_BT
    if old_BT is None:
        parts = micro_rows(cfg.trainer, job.rl, batch, job.actor_group)
        fused = fused_chunk_for(cfg.model, actor.model)
        old_BT = logprobs_of(
            actor.model, batch, parts, cfg.rollout.temperature, cfg.trainer.pack_sequences, fused
        )
    return UpdateResult({}, old_BT)


def log(job: rl.RLJob, s: Step) -> None:
    """The step's metrics (each role's reduced over its own ranks), samples and validation; a row every
    trainer.log_every steps, at validations and at the last."""
    cfg, step = job.cfg, s.step
    actor_part = None
    if s.batch is not None:
        assert s.update is not None and s.sampled_mask_BT is not None
        actor_part = (s.batch, s.sampled_mask_BT, s.update.old_logprobs_BT)
    # Every rank: the step's timings, the slowest rank's (each role's phases are 0 on the other's ranks).
    base = step_metrics(
        cfg.rollout.n,
        cfg.algorithm.ppo_epochs,
        s.samples,
        s.timer,
        job.device,
        actor_part,
        job.actor_group,
        s.resident_gb,
    )
    # Tokens/s and MFU of each role's update and no-grad passes (spmdrl/rl/perf.py), reduced over the role's
    # own ranks; the critic's travel to rank 0 with its other metrics.
    actor_perf: dict[str, float] = {}
    if job.actor is not None and s.batch is not None:
        passes = int(job.recompute_old) + int(job.ref is not None)  # the values pass is the critic's
        actor_perf = actor_perf_metrics(
            cfg.model,
            cfg.algorithm.ppo_epochs,
            job.actor.model,
            s.batch,
            base,
            forward_passes=passes,
            device=job.device,
            group=job.actor_group,
            trained=s.step > cfg.critic.warmup_steps,
        )
    critic_metrics = s.critic_metrics
    if job.critic is not None and s.critic_batch is not None:
        critic_metrics = {
            **critic_metrics,
            **critic_perf_metrics(
                cfg.model,
                cfg.algorithm.ppo_epochs,
                job.critic.model,
                s.critic_batch,
                base,
                device=job.device,
                group=job.critic_group,
            ),
        }
    if job.placement.is_split:  # the first critic rank tells rank 0, which logs
        critic_metrics = broadcast_object(critic_metrics, src=job.placement.role("critic").first_rank)
    metrics = {
        **base,
        **(s.update.metrics if s.update is not None else {}),
        **critic_metrics,
        **actor_perf,
        **s.metrics,
    }
    if job.actor is not None:
        metrics["actor/lr"] = job.actor.scheduler.get_last_lr()[0]
    rl.log_step(job, step, metrics, s.samples, s.timer)


# ------------------------------------------------------------ split placement: rows between the roles
def to_role(rows: RowPlan, local: PolicyBatch, role: str) -> PolicyBatch | None:
    """Split: ``role``'s rows on its ranks, from the ranks that generated them (None on the other role's
    ranks). Colocated, every rank keeps the rows it generated."""
    if not rows.placement.is_split:
        return local
    assert rows.world is not None and rows.actor is not None and rows.critic is not None
    out = rows.move(
        local.tensors(), local.field_spec(), rows.world, rows.actor if role == "actor" else rows.critic
    )
    return None if out is None else PolicyBatch.from_tensors(out)


def values_to_actor(
    rows: RowPlan, critic_batch: PolicyBatch | None, batch: PolicyBatch | None
) -> PolicyBatch | None:
    """The critic's values onto the actor's rows (GAE runs on the actor's ranks)."""
    if not rows.placement.is_split:
        assert batch is not None and critic_batch is not None
        return batch.replace(values_BT=critic_batch.values_BT)
    assert rows.critic is not None and rows.actor is not None
    fields = None if critic_batch is None else {"values_BT": critic_batch.values_BT}
    out = rows.move(fields, {"values_BT": torch.float32}, rows.critic, rows.actor)  # type: ignore[arg-type]
    if batch is None or out is None:
        return batch
    return batch.replace(values_BT=fit_width(out["values_BT"], batch.response_mask_BT.shape[1]))


def returns_to_critic(
    rows: RowPlan, batch: PolicyBatch | None, critic_batch: PolicyBatch | None
) -> PolicyBatch | None:
    """The returns and the response mask (after any rejection) from the actor's ranks to the critic's."""
    if not rows.placement.is_split:
        return critic_batch
    assert rows.critic is not None and rows.actor is not None
    spec = {"returns_BT": torch.float32, "response_mask_BT": torch.bool}
    fields = None if batch is None else {k: getattr(batch, k) for k in spec}
    out = rows.move(fields, spec, rows.actor, rows.critic)
    if critic_batch is None or out is None:
        return critic_batch
    width = critic_batch.response_mask_BT.shape[1]
    return critic_batch.replace(**{k: fit_width(v, width) for k, v in out.items()})


if __name__ == "__main__":
    # A forked copy runs as a script: torchrun --nproc_per_node=2 my_ppo.py recipe=ppo_tiny ...
    from spmdrl.train import run_recipe

    run_recipe(main)
