"""Rollout-correction metrics over gloo ranks: maxima and minima are the whole world's."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from spmdrl.config import AlgorithmConfig, Config
from spmdrl.rl.batch import PolicyBatch

B, T, N = 4, 12, 2  # 2 prompts x 2 samples


def _cfg(**algorithm: object) -> Config:
    cfg = Config(algorithm=AlgorithmConfig(**algorithm))  # type: ignore[arg-type]
    return dataclasses.replace(cfg, rollout=dataclasses.replace(cfg.rollout, n=N))


def _batch() -> PolicyBatch:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 64, (B, T), generator=g)
    attn = torch.ones(B, T, dtype=torch.long)
    attn[1, -3:] = 0
    resp = attn.bool().clone()
    resp[:, :4] = False
    adv_BT = torch.tensor([1.0, -1.0, 0.5, -0.5])[:, None] * resp
    old = -torch.rand(B, T, generator=g)
    return PolicyBatch(ids, attn, resp, old.clone(), adv_BT, old_logprobs_BT=old, ref_logprobs_BT=old - 0.1)


def _correct_rollout_on_rank(rank: int, world: int, threshold: str = "10") -> dict[str, float]:
    from spmdrl.rl.experience import correct_rollout

    rc = dataclasses.replace(
        AlgorithmConfig().rollout_correction, rollout_is="token", rollout_is_threshold=threshold
    )
    cfg = _cfg(rollout_correction=rc)
    mb = _batch()
    # Rank 0's weights are all 2, rank 1's all 0.5 (trainer - engine log ratio of +-log 2).
    shift = math.log(2.0) if rank == 0 else -math.log(2.0)
    assert mb.old_logprobs_BT is not None
    batch = mb.replace(engine_logprobs_BT=mb.old_logprobs_BT - shift)
    return correct_rollout(cfg.algorithm.rollout_correction, batch, torch.device("cpu"))[1]


@pytest.mark.slow
def test_rollout_correction_metrics_take_max_and_min_over_ranks() -> None:
    from spmdrl.testing.spawn import run_distributed

    per_rank = run_distributed(_correct_rollout_on_rank, 2, timeout_s=120)
    assert per_rank[0] == per_rank[1]
    m = per_rank[0]
    # As verl's, over the whole batch: the largest and smallest weight of any rank, not their mean.
    assert m["rollout_corr/rollout_is_max"] == pytest.approx(2.0)
    assert m["rollout_corr/rollout_is_min"] == pytest.approx(0.5)
    assert m["rollout_corr/rollout_is_seq_max_deviation"] == pytest.approx(1.0)
    assert m["rollout_corr/rollout_is_mean"] == pytest.approx(1.25)  # the mean of the ranks' means
    # Untruncated weights correct the whole gap: none is left on any rank.
    assert m["mismatch/corrected_logprob_abs_diff_mean"] == pytest.approx(0.0, abs=1e-6)


@pytest.mark.slow
def test_corrected_mismatch_is_the_part_above_the_cap_over_all_ranks_tokens() -> None:
    """TIS capped at 1.5: rank 0's ratios of 2 keep log(2 / 1.5) uncorrected, rank 1's of 0.5 none; the
    same number of tokens on each, so the world's mean gap is half of log(2 / 1.5)."""
    from spmdrl.testing.spawn import run_distributed

    per_rank = run_distributed(_correct_rollout_on_rank, 2, "1.5", timeout_s=120)
    assert per_rank[0] == per_rank[1]
    gap = per_rank[0]["mismatch/corrected_logprob_abs_diff_mean"]
    assert gap == pytest.approx(math.log(2.0 / 1.5) / 2, rel=1e-5)
