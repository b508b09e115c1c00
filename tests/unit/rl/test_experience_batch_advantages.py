"""An RL step's advantages (``batch_advantages`` in spmdrl/rl/experience.py) against verl 0.9.1's order
and scope: the KL in the reward from the trainer's old logprobs, then the rollout correction's rejection,
then the advantages on the edited mask, with batch-wide statistics over all of the actor's ranks."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from spmdrl.algos.advantages import AdvantageInputs, compute_advantages
from spmdrl.algos.correction import rollout_correction
from spmdrl.algos.kl_control import FixedKLController
from spmdrl.config import Config, RolloutCorrectionConfig, derive, derive_rl
from spmdrl.rl.batch import PolicyBatch
from spmdrl.rl.experience import batch_advantages, needs_old_logprobs
from tests.unit.rl.advantage_batches import CPU, REJECT, B, N, cfg_with_n, scored_batch


def _verl_order(cfg: Config, batch: PolicyBatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """verl's fit loop: rejection first (it edits the mask), then the estimator on the edited mask."""
    assert batch.old_logprobs_BT is not None and batch.token_rewards_BT is not None
    rc, a = cfg.algorithm.rollout_correction, cfg.algorithm
    mask_BT = rollout_correction(
        batch.old_logprobs_BT,
        batch.engine_logprobs_BT,
        batch.response_mask_BT,
        rollout_rs=rc.rollout_rs,
        rollout_rs_threshold=rc.rollout_rs_threshold,
    ).mask_BT
    inputs = AdvantageInputs(
        batch.token_rewards_BT,
        mask_BT,
        torch.arange(B) // N,
        values_BT=batch.values_BT,
        gamma=a.gamma,
        lam=a.lam,
    )
    return mask_BT, *compute_advantages(a.adv_estimator, inputs)


@pytest.mark.parametrize("name", ["gae", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "grpo"])
def test_advantages_follow_the_rejection_as_in_verl(name: str) -> None:
    cfg = cfg_with_n(adv_estimator=name, rollout_correction=REJECT, gamma=0.9, lam=0.8)
    batch = scored_batch()
    out, metrics = batch_advantages(cfg.algorithm, cfg.rollout.n, batch, None, FixedKLController(0.0), CPU)
    mask_BT, advantages_BT, returns_BT = _verl_order(cfg, batch)
    rejected = float((batch.response_mask_BT & ~mask_BT).sum() / batch.response_mask_BT.sum())
    assert 0.05 < rejected < 0.3 and metrics["rollout_corr/rollout_rs_masked_fraction"] > 0
    assert torch.equal(out.response_mask_BT, mask_BT)
    torch.testing.assert_close(out.advantages_BT, advantages_BT)
    torch.testing.assert_close(out.returns_BT, returns_BT)
    # The case has teeth: advantages on the sampled mask (rejection after them) differ on the kept
    # tokens for the batch-wide and per-token estimators; grpo's group statistics do not depend on it.
    a = cfg.algorithm
    sampled = AdvantageInputs(
        batch.token_rewards_BT,
        batch.response_mask_BT,
        torch.arange(B) // N,
        batch.values_BT,
        gamma=0.9,
        lam=0.8,
    )
    after_BT = compute_advantages(a.adv_estimator, sampled)[0] * mask_BT
    assert torch.allclose(after_BT, advantages_BT) == (name == "grpo")


def test_kl_in_reward_reads_the_trainers_old_logprobs() -> None:
    # verl's apply_kl_penalty reads old_log_probs, which it recomputes unless in bypass mode (where they
    # are the engine's): the old-logprob pass must run for it even on a single on-policy update.
    plain = cfg_with_n()
    rl = derive_rl(plain, derive(plain, 1, 64, samples_per_item=N))
    assert rl.mini_batches_per_step == 1 and plain.algorithm.ppo_epochs == 1
    assert not needs_old_logprobs(plain.algorithm, rl)
    cfg = cfg_with_n(use_kl_in_reward=True, kl_penalty="kl", adv_estimator="grpo")
    assert needs_old_logprobs(cfg.algorithm, rl)
    bypass = dataclasses.replace(cfg.algorithm, rollout_correction=RolloutCorrectionConfig(bypass_mode=True))
    assert not needs_old_logprobs(bypass, rl)

    batch = scored_batch()
    assert batch.old_logprobs_BT is not None and batch.ref_logprobs_BT is not None
    mask_BT = batch.response_mask_BT
    # k1 per token, each sequence's mean over its tokens, averaged over the sequences.
    for policy_BT, c in (
        (batch.old_logprobs_BT, cfg),
        (batch.engine_logprobs_BT, dataclasses.replace(cfg, algorithm=bypass)),
    ):
        kl_BT = (policy_BT - batch.ref_logprobs_BT) * mask_BT
        want = float((kl_BT.sum(1) / mask_BT.sum(1)).mean())
        _, metrics = batch_advantages(c.algorithm, c.rollout.n, batch, None, FixedKLController(0.1), CPU)
        assert metrics["actor/reward_kl_penalty"] == pytest.approx(want, rel=1e-5)
