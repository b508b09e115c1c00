"""GRPO as one SPMD program: a step of named phases over one state carrier. Read it top to bottom.

    torchrun --nproc_per_node=2 -m spmdrl.train recipe=grpo_tiny

Every rank, every step, one phase after another (a fork replaces any one of them on its own):

  rollout_and_score  this rank's prompts -> rollout.n samples each from the in-process vLLM engine, scored
                     by reward.fn in the sandbox; DAPO adds its overlong penalty and dynamic sampling here
  greedy_baseline    adv_estimator=remax only: each prompt's greedy answer, scored, is its baseline
  make_experience    the samples as rows; the old logprobs (when needed) and the reference's; the KL in
                     the reward and the rollout correction, then the advantages (algorithm.adv_estimator)
  update             policy loss (algorithm.policy_loss) + KL loss, PPO epochs x mini-batches x
                     micro-batches; every term is sum / (the mini-batch's global count), FSDP sums the
                     gradients (spmdrl/algos/aggregation.py)
  sync               the actor's FSDP2 shards -> full tensors per bucket -> the engine, in place, checked
  log                metrics reduced over ranks, samples, validation, curves
  (checkpoint)       phases.steps saves every trainer.save_every steps and after the last; a run resumes
                     from the newest complete one in its output directory (trainer.resume=auto), exactly

What each phase does is the library's, written once for every schedule (spmdrl/rl/phases.py; job.py
builds what the phases work with): this file is the schedule. It imports nothing from recipes/: a copy of
it, alone, anywhere, is a fork, and a fork that changes the algorithm registers its advantage estimator
and its policy loss in the copy (docs/forking.md).

Deliberately simple: no critic (PPO is recipes/ppo.py), so every rank holds every role and trains on the
samples it generated (parallel.balance_tokens aside; with a distillation teacher on ranks of its own,
parallel.teacher_ranks, those ranks generate and score and the others train, phases.experience moves the rows); the phases run one after another (generation
never overlaps training); a step is exactly trainer.global_batch_size prompts, whatever DAPO drops;
rewards are computed on the CPU of the rank that generated the samples.
"""

from __future__ import annotations

import spmdrl.rl.job as rl
from spmdrl.algos.advantages import adv_estimator
from spmdrl.config import Config
from spmdrl.errors import ConfigError
from spmdrl.rl import phases
from spmdrl.rl.experience import policy_batch
from spmdrl.rl.phases import Step
from spmdrl.rl.plan import check_val_only

# The actor, the reference and the engines on every rank, no critic (--check --world-size N plans them).
ROLES = rl.Roles()


def check_config(cfg: Config) -> None:
    """Settings this recipe would not run fail at config load (spmdrl.config_loader calls this)."""
    check_val_only(cfg)  # trainer.val_only needs data.val_files
    a = cfg.algorithm
    if adv_estimator(a.adv_estimator).needs_critic:
        raise ConfigError(
            f"algorithm.adv_estimator={a.adv_estimator} needs a critic, and this recipe ({cfg.entry}) trains "
            f"none (recipe {cfg.name!r}): set entry: ppo, the PPO recipe with a critic (recipes/ppo.py, as in "
            "recipe=ppo_tiny), or choose a critic-free algorithm.adv_estimator such as grpo"
        )


def main(cfg: Config) -> None:
    job = rl.build_job(
        cfg, ROLES
    )  # checks, data, warm-start, models, engine; resumed from the newest checkpoint
    for s in phases.steps(job):  # validation at 0, each step profiled, checkpoints when due
        phases.rollout_and_score(job, s)  # with DAPO's overlong penalty and dynamic sampling
        if adv_estimator(cfg.algorithm.adv_estimator).needs_baseline:  # ReMax
            s.baseline_B = phases.greedy_baseline(job, s.samples.prompts, s.step, s.timer)
        make_experience(job, s)
        update(job, s)
        phases.sync(job, s)  # the actor's weights into the engine, checked
        rl.log_step(job, s.step, phases.actor_metrics(job, s), s.samples, s.timer)


def make_experience(job: rl.RLJob, s: Step) -> None:
    """Generation is over: the engine sleeps, the samples become rows, then the library's experience (old
    and reference logprobs, KL in the reward, rollout correction, advantages, parallel.balance_tokens)."""
    with s.timer("engine_sleep"):  # CUDA: the next engine call is the sync
        job.engine.sleep(keep_weights=False)
    with s.timer("experience"):
        batch = policy_batch(s.samples, job.tokenizer.pad_token_id, job.device)
    phases.experience(job, s, batch)


def update(job: rl.RLJob, s: Step) -> None:
    """The actor's update (algorithm.policy_loss + the KL loss; PPO epochs x mini-batches x micro-batches;
    every term is sum / the mini-batch's global count, FSDP sums the gradients)."""
    s.resident_gb = phases.resident_gb(job)  # the engine is asleep: this is the trainer's
    if job.actor is None:  # a rank of the teacher's own (parallel.teacher_ranks) trains nothing
        return
    with s.timer("update"), s.timer("actor_update"):
        s.update = phases.update_actor(job, s.batch)


if __name__ == "__main__":
    # A forked copy runs as a script: torchrun --nproc_per_node=2 my_grpo.py recipe=grpo_tiny ...
    from spmdrl.train import run_recipe

    run_recipe(main)
