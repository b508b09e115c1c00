"""The GRPO recipe's rollout and reward (recipes/grpo.py, its first two steps) and its validation.

- score: rewards of a batch of generations, in the sandbox (spmdrl/rewards/sandbox.py).
- rollout_and_score -> Rollouts: a step's samples and rewards on this rank, with DAPO's dynamic sampling
  (algorithm.filter_groups) and overlong penalty (reward.overlong_buffer).
- greedy_rollout: remax's greedy baseline; check_reward_errors: the stop when too many samples got no
  score; train_samples: the samples to log; validate: greedy decoding on the held-out split.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict

import torch
import torch.distributed as dist

from spmdrl.algos.dapo import (
    dynamic_sampling_metrics,
    groups_with_signal,
    overlong_penalty,
    should_generate_more,
)
from spmdrl.config import Config
from spmdrl.data.prompts import PromptDataset, PromptExample
from spmdrl.data.sampler import DistributedSampler
from spmdrl.distributed.reduce import all_reduce_min, all_reduce_sum
from spmdrl.logging.samples import Sample
from spmdrl.logging.timer import PhaseTimer
from spmdrl.rewards.registry import RewardInput
from spmdrl.rewards.sandbox import RewardResult, score_batch
from spmdrl.rollout.engine import Generation, SamplingSpec
from spmdrl.rollout.rollout import Rollout
from spmdrl.runtime import Run


def score(
    cfg: Config, reward_fn: object, tokenizer: object, prompts: list[PromptExample], gens: list[Generation]
) -> tuple[RewardResult, list[str]]:
    responses = tokenizer.batch_decode([g.token_ids for g in gens], skip_special_tokens=True)  # type: ignore[attr-defined]
    inputs = [
        RewardInput(
            response=r,
            ground_truth=prompts[g.prompt_index].ground_truth,
            data_source=prompts[g.prompt_index].data_source,
            # A multi-turn reward also sees how the trajectory went (turns, tool calls and errors).
            extra_info=prompts[g.prompt_index].extra_info
            if g.trajectory is None
            else {**prompts[g.prompt_index].extra_info, **g.trajectory.as_extra_info()},
        )
        for r, g in zip(responses, gens, strict=True)
    ]
    rc = cfg.reward
    result = score_batch(
        reward_fn,  # type: ignore[arg-type]
        inputs,
        timeout_s=rc.timeout_s,
        error_score=rc.error_score,
        batch_timeout_s=rc.batch_timeout_s,
        memory_mb=rc.worker_memory_mb,
        file_size_mb=rc.worker_file_size_mb,
    )
    return result, responses


@dataclasses.dataclass
class Rollouts:
    """A step's samples on this rank: rollout.n per prompt, grouped by prompt, with their rewards."""

    prompts: list[PromptExample]
    gens: list[Generation]
    rewards: RewardResult
    responses: list[str]
    metrics: dict[str, float]


def rollout_and_score(
    cfg: Config,
    rollout: Rollout,
    sampler: DistributedSampler,
    train_ds: PromptDataset,
    tokenizer: object,
    reward_fn: object,
    step: int,
    timer: PhaseTimer,
    device: torch.device,
) -> Rollouts:
    """Generate and score this rank's batch; with algorithm.filter_groups (DAPO's dynamic sampling),
    keep only prompts whose samples differ in the filter metric and generate further batches until
    every rank has its share of prompts, then take each rank's first ones.

    verl pools kept groups over the whole world; here each rank must end with the same number of rows
    (the update's FSDP collectives run once per micro-batch on every rank), so the decision to generate
    more is made on the smallest per-rank count, identical on every rank (one all_reduce per batch).
    """
    fg, ob, n = cfg.algorithm.filter_groups, cfg.reward.overlong_buffer, cfg.rollout.n
    target = 0
    # Per kept prompt: the prompt, its generations, their rewards, responses and extra reward keys.
    kept: list[tuple[PromptExample, list[Generation], list[float], list[str], dict[str, list[float]]]] = []
    errors = timeouts = dropped = generated = 0
    penalties: list[float] = []
    for gen_batch in range(1, 1_000_000):
        with timer("rollout"):
            prompts = [train_ds[i] for i in sampler.next_batch()]
            seed = (cfg.rollout.seed * 1_000_003 + step) * 1_000 + gen_batch - 1
            spec = SamplingSpec.for_training(cfg.rollout, cfg.data.max_response_length, seed=seed)
            gens = rollout.generate(prompts, spec)
        with timer("reward"):
            result, responses = score(cfg, reward_fn, tokenizer, prompts, gens)
        target = len(prompts)
        scores = result.scores_B.clone()
        if ob.enable:
            lengths_B = torch.tensor([len(g.token_ids) for g in gens])
            penalty_B = overlong_penalty(lengths_B, cfg.data.max_response_length, ob.len, ob.penalty_factor)
            scores = scores + penalty_B
            penalties += penalty_B.tolist()
        errors, timeouts, generated = (
            errors + result.num_errors,
            timeouts + result.num_timeouts,
            generated + len(prompts),
        )
        group_ids_B = torch.arange(len(prompts)).repeat_interleave(n)
        keep_B = torch.ones(len(gens), dtype=torch.bool)
        if fg.enable:
            metric_B = {
                "reward": scores,
                "acc": (result.scores_B >= 1.0).float(),
                "score": result.scores_B,
                "seq_final_reward": scores,
            }[fg.metric]
            keep_B = groups_with_signal(metric_B, group_ids_B)
        for i, p in enumerate(prompts):
            if keep_B[i * n]:
                rows = range(i * n, (i + 1) * n)
                kept.append(
                    (
                        p,
                        [gens[r] for r in rows],
                        [float(scores[r]) for r in rows],
                        [responses[r] for r in rows],
                        {k: [v[r] for r in rows] for k, v in result.extra.items()},
                    )
                )
            else:
                dropped += 1
        if not fg.enable:
            break
        fewest = int(all_reduce_min({"kept": len(kept)}, device)["kept"])
        try:
            if not should_generate_more(fewest, target, gen_batch, fg.max_num_gen_batches):
                break
        except ValueError as e:
            raise RuntimeError(f"step {step}: {e}") from None
    kept = kept[:target]
    out_prompts = [k[0] for k in kept]
    out_gens = [dataclasses.replace(g, prompt_index=i) for i, k in enumerate(kept) for g in k[1]]
    # Extra reward keys (gdpo's components) follow their rows; NaN where a batch's samples had none.
    extra_keys = sorted({key for k in kept for key in k[4]})
    extra = {key: [v for k in kept for v in k[4].get(key, [float("nan")] * n)] for key in extra_keys}
    rewards = RewardResult(torch.tensor([s for k in kept for s in k[2]]), errors, timeouts, extra)
    metrics: dict[str, float] = rollout.take_metrics(device)
    if fg.enable:
        totals = all_reduce_sum(
            {"batches": gen_batch, "kept": generated - dropped, "dropped": dropped}, device
        )
        world = dist.get_world_size()
        dyn = dynamic_sampling_metrics(
            int(totals["batches"] / world), int(totals["kept"]), int(totals["dropped"])
        )
        metrics.update({f"rollout/{k}": v for k, v in dyn.items()})
    if ob.enable:
        t = all_reduce_sum(
            {"sum": sum(penalties), "over": sum(p < 0 for p in penalties), "n": len(penalties)}, device
        )
        metrics["reward/overlong_penalty_mean"] = t["sum"] / max(t["n"], 1)
        metrics["reward/overlong_frac"] = t["over"] / max(t["n"], 1)
    return Rollouts(out_prompts, out_gens, rewards, [r for k in kept for r in k[3]], metrics)


def greedy_rollout(
    rollout: Rollout, prompts: list[PromptExample], cfg: Config, step: int
) -> list[Generation]:
    """One greedy completion per prompt (remax's baseline)."""
    spec = SamplingSpec(
        n=1, temperature=0.0, max_tokens=cfg.data.max_response_length, stop=list(cfg.rollout.stop), seed=step
    )
    return rollout.generate(prompts, spec)


def train_samples(
    step: int,
    tokenizer: object,
    prompts: list[PromptExample],
    gens: list[Generation],
    responses: list[str],
    rewards: RewardResult,
    cfg: Config,
) -> list[Sample]:
    return [
        Sample(
            step,
            "train",
            tokenizer.decode(prompts[g.prompt_index].prompt_ids),  # type: ignore[attr-defined]
            r,
            prompts[g.prompt_index].ground_truth,
            s,
            prompts[g.prompt_index].data_source,
        )
        for g, r, s in list(zip(gens, responses, rewards.scores_B.tolist(), strict=True))[
            : cfg.logging.samples_per_log
        ]
    ]


def validate(
    run: Run,
    rollout: Rollout,
    tokenizer: object,
    reward_fn: object,
    val_ds: PromptDataset,
    max_tokens: int,
) -> tuple[dict[str, float], list[Sample]]:
    """Greedy decoding on the whole held-out split, sharded over ranks; accuracy = reward >= 1."""
    cfg, env = run.cfg, run.env
    mine = [val_ds[i] for i in range(env.rank, len(val_ds), env.world_size)]
    gens = rollout.generate(
        mine,
        SamplingSpec.for_validation(cfg.rollout, max_tokens, seed=cfg.rollout.seed),
    )
    tool_metrics = {f"val/{k}": v for k, v in rollout.take_metrics(env.device).items()}
    result, responses = score(cfg, reward_fn, tokenizer, mine, gens)
    sums: dict[str, float] = defaultdict(float)
    for g, s in zip(gens, result.scores_B.tolist(), strict=True):
        src = mine[g.prompt_index].data_source or "unknown"
        sums["n"] += 1
        sums["reward"] += s
        sums["correct"] += float(s >= 1.0)
        sums[f"n/{src}"] += 1
        sums[f"correct/{src}"] += float(s >= 1.0)
    # Every rank must reduce the same keys: gather the set of data sources first.
    sources: list[set[str]] = [set() for _ in range(env.world_size)]
    dist.all_gather_object(sources, {k for k in sums if k.startswith("n/")})
    for k in set().union(*sources):
        sums.setdefault(k, 0.0)
        sums.setdefault("correct/" + k[2:], 0.0)
    total = all_reduce_sum(dict(sums), env.device)
    metrics = {
        "val/accuracy": total["correct"] / max(total["n"], 1),
        "val/reward_mean": total["reward"] / max(total["n"], 1),
        **tool_metrics,
    }
    for k in total:
        if k.startswith("n/"):
            metrics[f"val/accuracy/{k[2:]}"] = total["correct/" + k[2:]] / max(total[k], 1)
    samples = [
        Sample(
            0,
            "val",
            tokenizer.decode(mine[g.prompt_index].prompt_ids),
            r,
            mine[g.prompt_index].ground_truth,
            s,
            mine[g.prompt_index].data_source,
        )  # type: ignore[attr-defined]
        for g, r, s in list(zip(gens, responses, result.scores_B.tolist(), strict=True))[
            : cfg.logging.samples_per_log
        ]
    ]
    return metrics, samples


def check_reward_errors(cfg: Config, rewards: RewardResult, step: int, device: torch.device) -> None:
    """Stop the run, on every rank at once, when more than reward.max_error_frac of the step's samples
    failed to score: a reward function that always raises would otherwise train on zeros to the end."""
    t = all_reduce_sum(
        {
            "bad": rewards.num_errors + rewards.num_timeouts,
            "timeouts": rewards.num_timeouts,
            "n": len(rewards.scores_B),
        },
        device,
    )
    frac = t["bad"] / max(t["n"], 1)
    if frac > cfg.reward.max_error_frac:
        raise RuntimeError(
            f"step {step}: {int(t['bad'])} of {int(t['n'])} samples ({frac:.0%}) got no score from reward.fn="
            f"{cfg.reward.fn} ({int(t['timeouts'])} timed out, the rest raised or returned something that is not "
            f"a finite number), above reward.max_error_frac={cfg.reward.max_error_frac}. The first error of each "
            "rank is logged above with its traceback; fix the function (or raise reward.max_error_frac)"
        )
