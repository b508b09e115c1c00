"""A step's samples: the rollout (this rank's prompts -> rollout.n responses each, from the in-process
engine) and their rewards, as ScoredSamples; DAPO's additions to them; the samples to log; validation.

- train_sampling, score: the sampling settings of a step's generation batch, and the rewards of a batch
  of generations in the sandbox (spmdrl/rewards/sandbox.py) -> ScoredSamples.
- OverlongShaping, DynamicSampling: DAPO's overlong penalty (reward.overlong_buffer) and dynamic sampling
  (algorithm.filter_groups), which the GRPO recipe's rollout phase applies batch by batch.
- greedy_rollout: remax's baseline generations; check_reward_errors: the stop when too many samples got
  no score, or when a training reward is NaN/inf; train_samples: the samples to log; validate: greedy decoding on the held-out split.
"""

from __future__ import annotations

import dataclasses
import math
from collections import defaultdict

import torch
import torch.distributed as dist

from spmdrl.algos.config import FilterGroupsConfig
from spmdrl.algos.dapo import (
    dynamic_sampling_metrics,
    groups_with_signal,
    overlong_penalty,
    should_generate_more,
)
from spmdrl.data.prompts import PromptDataset, PromptExample
from spmdrl.distributed.reduce import all_reduce_min, all_reduce_sum
from spmdrl.logging.samples import Sample
from spmdrl.rewards.config import JudgeConfig, OverlongBufferConfig, RewardConfig, RewardModelConfig
from spmdrl.rewards.registry import RewardInput
from spmdrl.rewards.sandbox import RewardResult, score_batch
from spmdrl.rollout.agent_loop import ENV_FAILURES
from spmdrl.rollout.config import RolloutConfig
from spmdrl.rollout.engine import Generation, SamplingSpec
from spmdrl.rollout.rollout import Rollout
from spmdrl.runtime import Run


@dataclasses.dataclass
class ScoredSamples:
    """This rank's samples of a step: rollout.n per prompt, grouped by prompt, with their rewards."""

    prompts: list[PromptExample]
    gens: list[Generation]  # rollout.n per prompt, in prompt order (Generation.prompt_index)
    rewards: RewardResult  # what the reward function gave: scores, failures, extra keys
    responses: list[str]  # the decoded responses
    # The reward each sample trains on: rewards.scores_B, plus any shaping (DAPO's overlong penalty).
    scores_B: torch.Tensor
    # The rollout's metrics (tool calls, DAPO's counts), reduced over ranks; set by the rollout phase.
    metrics: dict[str, float] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class RewardSettings:
    """What the stop on a step's failed rewards reads of the config (check_reward_errors), gathered by
    spmdrl.rl.settings.reward_settings."""

    reward: RewardConfig
    reward_model: RewardModelConfig
    # model.param_dtype: the reward model runs in it (the stop on its NaN/inf scores names it).
    param_dtype: str


def train_sampling(
    rollout: RolloutConfig, max_response_length: int, step: int, gen_batch: int = 1
) -> SamplingSpec:
    """The sampling settings of the step's ``gen_batch``-th generation batch (DAPO may generate several):
    each batch of each step samples with a seed of its own."""
    seed = (rollout.seed * 1_000_003 + step) * 1_000 + gen_batch - 1
    return SamplingSpec.for_training(rollout, max_response_length, seed=seed)


def score(
    rc: RewardConfig,
    reward_fn: object,
    tokenizer: object,
    prompts: list[PromptExample],
    gens: list[Generation],
) -> ScoredSamples:
    """The reward of each generation (reward.fn, in the sandbox: timeouts and failures score
    reward.error_score and are counted)."""
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
    result = score_batch(
        reward_fn,  # type: ignore[arg-type]
        inputs,
        timeout_s=rc.timeout_s,
        error_score=rc.error_score,
        batch_timeout_s=rc.batch_timeout_s,
        memory_mb=rc.worker_memory_mb,
        file_size_mb=rc.worker_file_size_mb,
    )
    result = charge_env_failures(result, gens, rc.error_score)
    return ScoredSamples(prompts, gens, result, responses, result.scores_B)


def charge_env_failures(rewards: RewardResult, gens: list[Generation], error_score: float) -> RewardResult:
    """Samples whose multi-turn environment raised, hung or rewrote the conversation (terminate reasons
    ENV_FAILURES) as failed rewards: error_score, counted in num_errors (reward/errors, bounded by
    reward.max_error_frac, the stop naming the environment), not trained on as if the env had answered."""
    bad = [g.trajectory is not None and g.trajectory.terminate_reason in ENV_FAILURES for g in gens]
    if not any(bad):
        return rewards
    bad_B = torch.tensor(bad)
    failed_B = rewards.failed_B if rewards.failed_B is not None else torch.zeros(len(gens), dtype=torch.bool)
    newly = int((bad_B & ~failed_B).sum())  # a sample the rubric failed on too counts once
    return dataclasses.replace(
        rewards,
        scores_B=torch.where(
            bad_B, torch.tensor(error_score, dtype=rewards.scores_B.dtype), rewards.scores_B
        ),
        num_errors=rewards.num_errors + newly,
        failed_B=failed_B | bad_B,
        num_env_errors=rewards.num_env_errors + sum(bad),
    )


class OverlongShaping:
    """DAPO's overlong reward shaping (reward.overlong_buffer): a penalty growing linearly over the last
    ``len`` tokens before data.max_response_length, added to each sample's training reward. It keeps the
    penalties of every batch of the step (dropped groups too) for its metrics, reduced over ``group`` (the
    ranks that score: all of them, or the rollout ranks under parallel.placement=async)."""

    METRIC_KEYS = ("reward/overlong_penalty_mean", "reward/overlong_frac")

    def __init__(
        self,
        ob: OverlongBufferConfig,
        max_response_length: int,
        device: torch.device,
        group: dist.ProcessGroup | None = None,
    ) -> None:
        self.ob, self.max_response_length, self.device, self.group = ob, max_response_length, device, group
        self.penalties: list[float] = []

    def __call__(self, samples: ScoredSamples) -> ScoredSamples:
        ob = self.ob
        lengths_B = torch.tensor([len(g.token_ids) for g in samples.gens])
        penalty_B = overlong_penalty(lengths_B, self.max_response_length, ob.len, ob.penalty_factor)
        self.penalties += penalty_B.tolist()
        return dataclasses.replace(samples, scores_B=samples.scores_B + penalty_B)

    def metrics(self) -> dict[str, float]:
        """Over the ranks of ``group`` (every one must call it)."""
        p = self.penalties
        t = all_reduce_sum(
            {"sum": sum(p), "over": sum(x < 0 for x in p), "n": len(p)}, self.device, self.group
        )
        mean, frac = self.METRIC_KEYS
        return {mean: t["sum"] / max(t["n"], 1), frac: t["over"] / max(t["n"], 1)}


@dataclasses.dataclass
class _Group:
    """One prompt's rollout.n samples, kept by DynamicSampling."""

    prompt: PromptExample
    gens: list[Generation]
    raw_scores: list[float]
    scores: list[float]
    responses: list[str]
    extra: dict[str, list[float]]


class DynamicSampling:
    """DAPO's dynamic sampling (algorithm.filter_groups): of each generated batch, keep the prompts whose
    samples differ in the filter metric (a group whose samples all score alike has advantage 0 under
    GRPO); the rollout phase generates further batches until ``enough()``, then trains on ``kept()``, each
    rank's first prompts.

    verl pools kept groups over the whole world; here each rank must end with the same number of rows
    (the update's FSDP collectives run once per micro-batch on every rank), so the decision to generate
    more is made on the smallest per-rank count, identical on every rank (one all_reduce per batch).
    ``group``: the ranks that generate (all of them, or the rollout ranks under parallel.placement=async);
    ``n``: rollout.n, the samples of a prompt.
    """

    METRIC_KEYS = tuple(
        f"rollout/{k}"
        for k in ("num_gen_batches", "num_kept_groups", "num_dropped_groups", "kept_group_fraction")
    )

    def __init__(
        self,
        filter_groups: FilterGroupsConfig,
        n: int,
        step: int,
        device: torch.device,
        group: dist.ProcessGroup | None = None,
    ) -> None:
        self.filter_groups, self.n = filter_groups, n
        self.step, self.device, self.group = step, device, group
        self.target = 0  # this rank's prompts per step
        self.batches = self.generated = self.dropped = self.errors = self.timeouts = 0
        self.judge_errors = self.judge_only = self.rm_nonfinite = self.rm_only = self.env_errors = 0
        self._kept: list[_Group] = []

    def add(self, samples: ScoredSamples) -> None:
        """One generation batch: keeps its groups with signal."""
        n = self.n
        self.target = len(samples.prompts)
        self.batches += 1
        self.generated += len(samples.prompts)
        self.errors += samples.rewards.num_errors
        self.timeouts += samples.rewards.num_timeouts
        self.judge_errors += samples.rewards.num_judge_errors
        self.judge_only += samples.rewards.num_judge_only
        self.rm_nonfinite += samples.rewards.num_rm_nonfinite
        self.rm_only += samples.rewards.num_rm_only
        self.env_errors += samples.rewards.num_env_errors
        raw_B, scores_B = samples.rewards.scores_B, samples.scores_B
        metric_B = {
            "reward": scores_B,
            "acc": (raw_B >= 1.0).float(),
            "score": raw_B,
            "seq_final_reward": scores_B,
        }[self.filter_groups.metric]
        keep_B = groups_with_signal(metric_B, torch.arange(len(samples.prompts)).repeat_interleave(n))
        for i, p in enumerate(samples.prompts):
            if not keep_B[i * n]:
                self.dropped += 1
                continue
            rows = range(i * n, (i + 1) * n)
            self._kept.append(
                _Group(
                    p,
                    [samples.gens[r] for r in rows],
                    [float(raw_B[r]) for r in rows],
                    [float(scores_B[r]) for r in rows],
                    [samples.responses[r] for r in rows],
                    {k: [v[r] for r in rows] for k, v in samples.rewards.extra.items()},
                )
            )

    def enough(self) -> bool:
        """Whether every rank has kept a step's worth of groups (the same answer on every rank); raises
        when algorithm.filter_groups.max_num_gen_batches batches did not give them."""
        fewest = int(all_reduce_min({"kept": len(self._kept)}, self.device, self.group)["kept"])
        try:
            return not should_generate_more(
                fewest, self.target, self.batches, self.filter_groups.max_num_gen_batches
            )
        except ValueError as e:
            raise RuntimeError(f"step {self.step}: {e}") from None

    def kept(self) -> ScoredSamples:
        """This rank's first ``target`` kept groups; the failure counts are the whole step's."""
        n, kept = self.n, self._kept[: self.target]
        gens = [dataclasses.replace(g, prompt_index=i) for i, k in enumerate(kept) for g in k.gens]
        # Extra reward keys (gdpo's components) follow their rows; NaN where a batch's samples had none.
        keys = sorted({key for k in kept for key in k.extra})
        extra = {key: [v for k in kept for v in k.extra.get(key, [float("nan")] * n)] for key in keys}
        raw_B = torch.tensor([s for k in kept for s in k.raw_scores])
        rewards = RewardResult(
            raw_B,
            self.errors,
            self.timeouts,
            extra,
            num_judge_errors=self.judge_errors,
            num_judge_only=self.judge_only,
            num_rm_nonfinite=self.rm_nonfinite,
            num_rm_only=self.rm_only,
            num_env_errors=self.env_errors,
        )
        responses = [r for k in kept for r in k.responses]
        scores_B = torch.tensor([s for k in kept for s in k.scores])
        return ScoredSamples([k.prompt for k in kept], gens, rewards, responses, scores_B)

    def metrics(self) -> dict[str, float]:
        """Over the ranks of ``group`` (every one must call it)."""
        totals = all_reduce_sum(
            {"batches": self.batches, "kept": self.generated - self.dropped, "dropped": self.dropped},
            self.device,
            self.group,
        )
        ranks = dist.get_world_size(self.group)
        dyn = dynamic_sampling_metrics(
            int(totals["batches"] / ranks), int(totals["kept"]), int(totals["dropped"])
        )
        return {f"rollout/{k}": v for k, v in dyn.items()}


def greedy_rollout(
    rollout: Rollout, prompts: list[PromptExample], stop: list[str], max_response_length: int, step: int
) -> list[Generation]:
    """One greedy completion per prompt (remax's baseline), up to ``max_response_length`` tokens or a
    string of ``stop`` (rollout.stop)."""
    spec = SamplingSpec(n=1, temperature=0.0, max_tokens=max_response_length, stop=list(stop), seed=step)
    return rollout.generate(prompts, spec)


def train_samples(step: int, tokenizer: object, samples: ScoredSamples, samples_per_log: int) -> list[Sample]:
    """The first ``samples_per_log`` (logging.samples_per_log) samples, to log with their training reward."""
    return [
        Sample(
            step,
            "train",
            tokenizer.decode(samples.prompts[g.prompt_index].prompt_ids),  # type: ignore[attr-defined]
            r,
            samples.prompts[g.prompt_index].ground_truth,
            s,
            samples.prompts[g.prompt_index].data_source,
        )
        for g, r, s in list(zip(samples.gens, samples.responses, samples.scores_B.tolist(), strict=True))[
            :samples_per_log
        ]
    ]


def validate(
    run: Run,
    rollout: Rollout,
    tokenizer: object,
    reward_fn: object,
    val_ds: PromptDataset,
    max_tokens: int,
    *,
    shard: tuple[int, int] | None = None,
    group: dist.ProcessGroup | None = None,
) -> tuple[dict[str, float], list[Sample]]:
    """Greedy decoding on the whole held-out split, sharded over ranks; accuracy = reward >= 1.
    ``shard`` (this rank's index, the number of ranks) and ``group``: when only some ranks decode
    (parallel.placement=async's rollout ranks); by default every rank of the world."""
    cfg, env = run.cfg, run.env
    index, ranks = shard if shard is not None else (env.rank, env.world_size)
    mine = [val_ds[i] for i in range(index, len(val_ds), ranks)]
    gens = rollout.generate(
        mine,
        SamplingSpec.for_validation(cfg.rollout, max_tokens, seed=cfg.rollout.seed),
        training=False,  # a validation call (a wrapper may treat it apart: never slowed, say)
    )
    tool_metrics = {f"val/{k}": v for k, v in rollout.take_metrics(env.device).items()}
    scored = score(cfg.reward, reward_fn, tokenizer, mine, gens)
    sums: dict[str, float] = defaultdict(float)
    for g, s in zip(gens, scored.scores_B.tolist(), strict=True):
        src = mine[g.prompt_index].data_source or "unknown"
        sums["n"] += 1
        sums["reward"] += s
        sums["correct"] += float(s >= 1.0)
        sums[f"n/{src}"] += 1
        sums[f"correct/{src}"] += float(s >= 1.0)
    # Every rank must reduce the same keys: gather the set of data sources first.
    sources: list[set[str]] = [set() for _ in range(ranks)]
    dist.all_gather_object(sources, {k for k in sums if k.startswith("n/")}, group=group)
    for k in set().union(*sources):
        sums.setdefault(k, 0.0)
        sums.setdefault("correct/" + k[2:], 0.0)
    total = all_reduce_sum(dict(sums), env.device, group)
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
        for g, r, s in list(zip(gens, scored.responses, scored.scores_B.tolist(), strict=True))[
            : cfg.logging.samples_per_log
        ]
    ]
    return metrics, samples


def check_reward_errors(
    settings: RewardSettings,
    rewards: RewardResult,
    step: int,
    device: torch.device,
    group: dist.ProcessGroup | None = None,
    what: str = "samples",
) -> None:
    """Stop the run, on every rank at once, when more than reward.max_error_frac of the step's samples
    failed to score: a reward function that always raises, a judge whose replies never parse, or a reward
    model that gives NaN, would otherwise train on error_score to the end. The message names each source
    with its count and fix. Also stops, whatever the limit, when a reward the step would train on
    (``rewards.scores_B``: the weighted one) is NaN or inf. ``group``: the ranks that hold the step's
    samples (default: every rank). ``what``: the samples' name in the message (ReMax's greedy baselines
    are checked too: a baseline at error_score would be a wrong advantage for every sample of its prompt)."""
    t = all_reduce_sum(
        {
            "bad": rewards.num_errors + rewards.num_timeouts,
            "timeouts": rewards.num_timeouts,
            "judge": rewards.num_judge_errors,
            "judge_only": rewards.num_judge_only,
            "rm": rewards.num_rm_nonfinite,
            "rm_only": rewards.num_rm_only,
            "env": rewards.num_env_errors,
            # Every source's failures score error_score, so this is 0 unless something slipped through.
            "nonfinite": int((~torch.isfinite(rewards.scores_B)).sum()),
            "n": len(rewards.scores_B),
        },
        device,
        group,
    )
    if t["nonfinite"]:
        raise RuntimeError(nonfinite_reward_message(settings, step, int(t["nonfinite"]), int(t["n"]), what))
    frac = t["bad"] / max(t["n"], 1)
    if frac > settings.reward.max_error_frac:
        raise RuntimeError(reward_errors_message(settings, step, {k: int(v) for k, v in t.items()}, what))


def reward_errors_message(
    settings: RewardSettings, step: int, t: dict[str, int], what: str = "samples"
) -> str:
    """The stop's message from the step's counts over ranks (check_reward_errors' keys)."""
    bad, n, timeouts, judge, rm = t["bad"], t["n"], t["timeouts"], t["judge"], t["rm"]
    fn_failed = bad - t["judge_only"] - t["rm_only"]
    head = f"step {step}: {bad} of {n} {what} ({bad / max(n, 1):.0%}) got no score"
    limit = f"above reward.max_error_frac={settings.reward.max_error_frac}"
    fn_what = (
        f"reward.fn={settings.reward.fn} ({timeouts} timed out, the rest raised or returned something that is not "
        "a finite number)"
    )
    env = t.get("env", 0)
    if env:  # env.source's multi-turn environment failed on some (multi_turn/env_errors)
        fn_what = (
            f"the environment (env.source): {env} trajectories ended when it raised, hung past "
            "rollout.multi_turn.tool_timeout_s or rewrote the conversation (multi_turn/terminate_reason/env_*), "
            f"and {timeouts} rubric calls timed out, the rest raised or returned no finite number"
        )
    if judge == 0 and rm == 0:  # reward.fn alone
        return (
            f"{head} from {fn_what}, {limit}. The first error of each rank is logged above with its traceback; "
            "fix the function (or raise reward.max_error_frac)"
        )
    # Several sources: one line each, with its count and its fix.
    lines = [f"{head}, {limit} (or raise it):"]
    if fn_failed:
        lines.append(
            f"  - {fn_failed} from {fn_what}. The first error of each rank is logged above with its traceback; "
            "fix the function."
        )
    if judge:
        lines.append(_judge_line(settings.reward_model.judge, judge, judge - t["judge_only"]))
    if rm:
        lines.append(_rm_line(settings, rm, rm - t["rm_only"]))
    return "\n".join(lines)


def _judge_line(jc: JudgeConfig, judge: int, both: int) -> str:
    return (
        f"  - {judge} judge replies that did not parse (reward_model.judge.*"
        + (f"; {both} of them on samples reward.fn failed too" if both else "")
        + f"): no match of reward_model.judge.score_regex={jc.score_regex!r} with a finite number in its first "
        "group. The first such reply of each rank is logged above; make reward_model.judge.template ask for "
        f"what score_regex reads, fix score_regex, or raise reward_model.judge.max_tokens={jc.max_tokens} if "
        "the replies stop before the score."
    )


def _rm_line(settings: RewardSettings, rm: int, overlap: int) -> str:
    rc, dtype = settings.reward_model, settings.param_dtype
    return (
        f"  - {rm} reward-model scores were NaN/inf (reward_model.path={rc.path}"
        + (f"; {overlap} of them on samples reward.fn or the judge failed too" if overlap else "")
        + "), scored reward.error_score. The first of each call is logged above; check the checkpoint (NaN "
        f"or inf in its weights, a head that is not a trained scalar head) and the dtype it runs in "
        f"(model.param_dtype={dtype}: float16 overflows where bfloat16 and float32 do not)."
    )


def nonfinite_reward_message(
    settings: RewardSettings, step: int, bad: int, n: int, what: str = "samples"
) -> str:
    """The stop when a weighted training reward is NaN or inf: names what can make one, from the config
    (each source's own failures already score reward.error_score)."""
    of = "" if what == "samples" else f" ({what})"
    head = (
        f"step {step}: {bad} of {n} training rewards{of} are NaN/inf; stopping rather than training on them"
    )
    reward, reward_model = settings.reward, settings.reward_model
    es = reward.error_score
    if not math.isfinite(es):
        return (
            f"{head}: reward.error_score={es} is what every failed sample scores (reward.fn, the judge, the "
            "reward model); set a finite one (the default is 0.0)"
        )
    weights = {"reward.rule_weight": reward.rule_weight}
    if reward_model.enable:
        weights["reward_model.weight"] = reward_model.weight
    if reward_model.judge.enable:
        weights["reward_model.judge.weight"] = reward_model.judge.weight
    odd = {k: w for k, w in weights.items() if not math.isfinite(w)}
    if odd:
        return f"{head}: {', '.join(f'{k}={w}' for k, w in odd.items())} is not a finite number; set one"
    parts = ", ".join(f"{k}={w}" for k, w in weights.items())
    return (
        f"{head}. Each part is finite (reward.fn's and the judge's scores are checked, the reward model's "
        f"NaN/inf score reward.error_score), so the weighted sum ({parts}) overflowed float32: a part's "
        "scores times its weight passed 3.4e38. Scale the weights or the scores down"
    )
