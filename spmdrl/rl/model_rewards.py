"""Model rewards in the RL step: the reward model's and the judge's scores of a step's samples, weighted
with the rule reward into the reward the step trains on (docs/rewards.md#reward-models).

The rollout phase calls a ModelRewards on each generation batch right after the rule reward
(spmdrl.rl.samples.score), on every rank that generates (the reward model's forwards and the judge's
generation are collectives over them): every rank when colocated, the rollout ranks only under
parallel.placement=async, where the reward model is sharded over the rollout ranks and its metrics
travel to rank 0 with the rows. Validation does not: held-out accuracy stays the rule's.
"""

from __future__ import annotations

import dataclasses
import logging
from collections import defaultdict

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from spmdrl.config import Config
from spmdrl.distributed.reduce import all_reduce_sum
from spmdrl.rewards.combine import weighted_reward
from spmdrl.rewards.config import RewardConfig, RewardModelConfig
from spmdrl.rewards.reward_model_path import check_reward_model_dir
from spmdrl.rl.judge import Judge
from spmdrl.rl.reward_model import RewardModel, build_reward_model
from spmdrl.rl.samples import ScoredSamples
from spmdrl.rollout.engine import RolloutEngine

log = logging.getLogger(__name__)


class ModelRewards:
    """The reward model and/or the judge, and their sums for the step's metrics (reward/rm_score, ...),
    reduced over ``group``: the ranks that score (None: the whole world)."""

    # Every key metrics() may return (parallel.placement=async carries them with the rows).
    METRIC_KEYS = (
        "reward/rule_score",
        "reward/rm_score",
        "reward/rm_truncated_frac",
        "reward/judge_parsed_frac",
        "reward/judge_score",
    )

    def __init__(
        self,
        reward: RewardConfig,
        reward_model: RewardModelConfig,
        seed: int,
        rm: RewardModel | None,
        judge: Judge | None,
        device: torch.device,
        group: dist.ProcessGroup | None = None,
    ) -> None:
        """``reward``, ``reward_model``: the weights and error score; ``seed``: rollout.seed, from which the
        judge's sampling seeds follow."""
        self.reward, self.reward_model, self.seed = reward, reward_model, seed
        self.rm, self.judge, self.device, self.group = rm, judge, device, group
        self._sums: dict[str, float] = defaultdict(float)
        self._calls = 0

    def __call__(self, samples: ScoredSamples, step: int, *, record: bool = True) -> ScoredSamples:
        """``samples`` with its reward replaced by the weighted sum of the rule's, the model's and the
        judge's; a judge reply that did not parse, or a reward-model score that is NaN or inf (a broken
        checkpoint, an overflow in its dtype), scores reward.error_score in its part and is counted in
        reward/errors (once per sample: not again where reward.fn, or the judge, failed on it too) and in
        the result's num_judge_errors / num_rm_nonfinite, which the stop on reward.max_error_frac names.
        ``record=False`` keeps the call out of the step's metrics (ReMax's baseline generations)."""
        gens = samples.gens
        messages = [samples.prompts[g.prompt_index].messages for g in gens]
        rule_B = samples.rewards.scores_B
        parts = {"rule": (self.reward.rule_weight, rule_B)}
        sums: dict[str, float] = self._sums if record else defaultdict(float)
        sums["n"] += len(gens)
        sums["rule"] += float(rule_B.sum())
        fn_failed_B = samples.rewards.failed_B
        if fn_failed_B is None:  # unknown: every other failure counts as a sample of its own
            fn_failed_B = torch.zeros(len(gens), dtype=torch.bool)
        judge_errors = judge_only = 0
        unparsed_B = torch.zeros(len(gens), dtype=torch.bool)
        rm_bad_B = torch.zeros(len(gens), dtype=torch.bool)
        if self.rm is not None:
            rm_B = self.rm.score(messages, samples.responses)
            # Checked here, before weighting: a NaN would otherwise reach every advantage of its group
            # (and, through whitening, the batch's), and a weight of 0 would hide it.
            rm_bad_B = ~torch.isfinite(rm_B)
            if rm_bad_B.any():
                self._warn_nonfinite(rm_B, rm_bad_B)
                rm_B = torch.where(rm_bad_B, torch.full_like(rm_B, self.reward.error_score), rm_B)
            parts["rm"] = (self.reward_model.weight, rm_B)
            sums["rm"] += float(rm_B[~rm_bad_B].sum())
            sums["rm_nonfinite"] += int(rm_bad_B.sum())
            sums["rm_truncated"] += self.rm.num_truncated
            self.rm.num_truncated = 0
        if self.judge is not None:
            truths = [samples.prompts[g.prompt_index].ground_truth for g in gens]
            # A seed per (step, call of the step): a resumed run samples the same judgements.
            self._calls += 1
            seed = (self.seed * 1_000_003 + step) * 1_000 + 500 + self._calls
            judge_B, parsed_B = self.judge.score(messages, samples.responses, truths, seed=seed)
            parts["judge"] = (self.reward_model.judge.weight, judge_B)
            unparsed_B = ~parsed_B
            judge_errors = int(unparsed_B.sum())
            judge_only = int((unparsed_B & ~fn_failed_B).sum())
            sums["judge_parsed"] += int(parsed_B.sum())
            sums["judge"] += float(judge_B[parsed_B].sum())
        # A sample counts once in num_errors: reward.fn's failure first, then the judge's, then the model's.
        rm_only = int((rm_bad_B & ~fn_failed_B & ~unparsed_B).sum())
        total_B = weighted_reward(parts)
        r = samples.rewards
        rewards = dataclasses.replace(
            r,
            scores_B=total_B,
            num_errors=r.num_errors + judge_only + rm_only,
            num_judge_errors=r.num_judge_errors + judge_errors,
            num_judge_only=r.num_judge_only + judge_only,
            num_rm_nonfinite=r.num_rm_nonfinite + int(rm_bad_B.sum()),
            num_rm_only=r.num_rm_only + rm_only,
        )
        # Any shaping already applied (none in the recipes' order) stays on top of the new reward.
        return dataclasses.replace(samples, rewards=rewards, scores_B=total_B + (samples.scores_B - rule_B))

    def _warn_nonfinite(self, rm_B: torch.Tensor, bad_B: torch.Tensor) -> None:
        """The first non-finite score of the call, logged: which value (NaN, +inf, -inf) and how many tell
        a broken checkpoint (NaN everywhere) from an overflow (inf on some samples)."""
        first = int(bad_B.nonzero()[0])
        log.warning(
            "reward model: %d of %d scores were NaN/inf (reward_model.path=%s), scored reward.error_score=%s; "
            "first: sample %d, %s",
            int(bad_B.sum()),
            len(rm_B),
            self.reward_model.path,
            self.reward.error_score,
            first,
            float(rm_B[first]),
        )

    def metrics(self) -> dict[str, float]:
        """The step's means over the scoring ranks, then reset (every rank of ``group`` must call it)."""
        t = all_reduce_sum(
            {
                k: self._sums.get(k, 0.0)
                for k in ("n", "rule", "rm", "rm_nonfinite", "rm_truncated", "judge", "judge_parsed")
            },
            self.device,
            self.group,
        )
        self._sums, self._calls = defaultdict(float), 0
        n = max(t["n"], 1.0)
        out = {"reward/rule_score": t["rule"] / n}
        if self.rm is not None:
            finite = t["n"] - t["rm_nonfinite"]
            if finite > 0:  # the mean of the finite scores (NaN/inf ones are counted in reward/errors)
                out["reward/rm_score"] = t["rm"] / finite
            out["reward/rm_truncated_frac"] = t["rm_truncated"] / n
        if self.judge is not None:
            out["reward/judge_parsed_frac"] = t["judge_parsed"] / n
            if t["judge_parsed"] > 0:
                out["reward/judge_score"] = t["judge"] / t["judge_parsed"]
        return out


def build_model_rewards(
    cfg: Config,
    mesh: DeviceMesh,
    engine: RolloutEngine,
    tokenizer: object,
    device: torch.device,
    *,
    max_model_len: int,
    group: dist.ProcessGroup | None = None,
) -> ModelRewards | None:
    """The reward model (FSDP2 on ``mesh``, whose ranks' process group is ``group``: None for the whole
    world) and the judge (on the run's ``engine``) that reward_model.* enables; None when neither is.
    Every rank of ``mesh`` calls it."""
    rm_cfg = cfg.reward_model
    if not (rm_cfg.enable or rm_cfg.judge.enable):
        return None
    rm = build_reward_model(rm_cfg, cfg.model, mesh, device, group) if rm_cfg.enable else None
    judge = (
        Judge(
            rm_cfg.judge, engine, tokenizer, max_model_len=max_model_len, error_score=cfg.reward.error_score
        )
        if rm_cfg.judge.enable
        else None
    )
    return ModelRewards(cfg.reward, rm_cfg, cfg.rollout.seed, rm, judge, device, group)


def check_model_rewards(rm_cfg: RewardModelConfig) -> None:
    """reward_model.path's files (ConfigError), before anything expensive starts."""
    if rm_cfg.enable:
        check_reward_model_dir(rm_cfg.path)
