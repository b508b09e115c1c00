"""Every verl advantage estimator is selectable by its name alone through the RL step's experience
functions (spmdrl/rl/experience.py), which settings add the old-logprob pass, GDPO's reward components."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from spmdrl.algos.advantages import ADV_ESTIMATORS, adv_estimator
from spmdrl.config import AlgorithmConfig, Config, validate
from spmdrl.rl.batch import PolicyBatch
from spmdrl.rl.experience import advantage_estimator

B, T, N = 4, 12, 2  # 2 prompts x 2 samples


# What a name needs besides itself (verl's names for the settings).
NEEDS = {"gdpo": {"gdpo_reward_keys": ["format", "accuracy"]}, "dro": {"dro_beta": 0.1}}


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


@pytest.mark.parametrize("name", sorted(ADV_ESTIMATORS))
def test_every_estimator_by_name(name: str) -> None:
    cfg = _cfg(adv_estimator=name, **NEEDS.get(name, {}))
    validate(cfg)
    mask_BT = _batch().response_mask_BT
    rewards_BT = torch.zeros(B, T)
    rewards_BT[torch.arange(B), T - 1 - mask_BT.flip(-1).int().argmax(-1)] = torch.tensor(
        [1.0, 0.0, 0.0, 1.0]
    )
    baseline_B = torch.tensor([0.5, 0.5, 0.0, 0.0]) if name == "remax" else None
    values_BT = (
        torch.linspace(-0.5, 0.5, T).expand(B, T) * mask_BT if adv_estimator(name).needs_critic else None
    )
    otb = adv_estimator(name).needs_sum_pi_squared
    adv_BT, returns_BT = advantage_estimator(
        cfg.algorithm,
        N,
        B // N,
        baseline_B,
        values_BT,
        old_logprobs_BT=_batch().old_logprobs_BT if otb else None,
        sum_pi_squared_BT=torch.full((B, T), 0.3) if otb else None,
        reward_components_BK=torch.tensor([[1.0, 0.0], [0.0, 0.0], [0.0, 1.0], [1.0, 1.0]]),
    )(rewards_BT, mask_BT)
    assert returns_BT.shape == (B, T) and torch.isfinite(returns_BT).all()
    assert adv_BT.shape == (B, T) and torch.isfinite(adv_BT).all()
    assert (adv_BT[~mask_BT] == 0).all()
    assert adv_BT[mask_BT].abs().sum() > 0  # each group has a better and a worse sample


def test_which_settings_add_the_old_logprob_pass() -> None:
    from spmdrl.config import derive, derive_rl
    from spmdrl.rl.experience import needs_old_logprobs

    def needs(**algorithm: object) -> bool:
        cfg = _cfg(**algorithm)
        return needs_old_logprobs(cfg.algorithm, derive_rl(cfg, derive(cfg, 1, 1000, samples_per_item=N)))

    assert not needs()
    # The optimal token baseline reads the old policy's logprobs and sum of squared probabilities.
    assert needs(adv_estimator="optimal_token_baseline") and needs(adv_estimator="tir_optimal_token_baseline")
    # Bypass mode never recomputes them: the engine's are the old ones, whatever else asks.
    bypass = dataclasses.replace(AlgorithmConfig().rollout_correction, bypass_mode=True, rollout_is="token")
    assert not needs(rollout_correction=bypass, ppo_epochs=2)


def test_gdpo_reward_components_from_the_reward_functions_dict() -> None:
    from spmdrl.rewards.sandbox import RewardResult
    from spmdrl.rl.experience import gdpo_reward_components

    nan = float("nan")
    rewards = RewardResult(
        torch.tensor([1.0, 0.0, 0.5]), 1, 0, {"format": [1.0, 0.0, nan], "accuracy": [0.0, 1.0, nan]}
    )
    cfg = _cfg(adv_estimator="gdpo", gdpo_reward_keys=["accuracy", "format"])
    # One column per key, in the keys' order; a failed sample (NaN) scores reward.error_score in each.
    expected = torch.tensor([[0.0, 1.0], [1.0, 0.0], [0.0, 0.0]])
    torch.testing.assert_close(gdpo_reward_components(cfg.algorithm, cfg.reward, rewards), expected)
    assert gdpo_reward_components(_cfg().algorithm, cfg.reward, rewards) is None
    with pytest.raises(RuntimeError, match=r"returned no \['length'\]"):
        gdpo_reward_components(
            _cfg(adv_estimator="gdpo", gdpo_reward_keys=["length"]).algorithm, cfg.reward, rewards
        )
