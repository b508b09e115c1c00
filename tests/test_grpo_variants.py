"""Every verl advantage estimator and policy loss is selectable by its name alone, through the GRPO
recipe's own functions (one process, a small in-memory Qwen2; the multi-process e2e runs a few)."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from spmdrl.algos.advantages import ADV_ESTIMATORS, NEEDS_CRITIC
from spmdrl.algos.aggregation import Aggregation
from spmdrl.algos.batch import PolicyBatch
from spmdrl.algos.policy_losses import POLICY_LOSSES, agg_mode_for
from spmdrl.config import AlgorithmConfig, Config, ConfigError, validate
from spmdrl.recipes.grpo import advantage_estimator
from spmdrl.recipes.grpo_update import micro_batch_loss
from spmdrl.testing.models import SMALL_QWEN2

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


@pytest.mark.parametrize("name", sorted(ADV_ESTIMATORS))
def test_every_estimator_by_name(name: str) -> None:
    cfg = _cfg(adv_estimator=name)
    validate(cfg)
    mask_BT = _batch().response_mask_BT
    rewards_BT = torch.zeros(B, T)
    rewards_BT[torch.arange(B), T - 1 - mask_BT.flip(-1).int().argmax(-1)] = torch.tensor(
        [1.0, 0.0, 0.0, 1.0]
    )
    baseline_B = torch.tensor([0.5, 0.5, 0.0, 0.0]) if name == "remax" else None
    values_BT = torch.linspace(-0.5, 0.5, T).expand(B, T) * mask_BT if name in NEEDS_CRITIC else None
    adv_BT, returns_BT = advantage_estimator(cfg, B // N, baseline_B, values_BT)(rewards_BT, mask_BT)
    assert returns_BT.shape == (B, T) and torch.isfinite(returns_BT).all()
    assert adv_BT.shape == (B, T) and torch.isfinite(adv_BT).all()
    assert (adv_BT[~mask_BT] == 0).all()
    assert adv_BT[mask_BT].abs().sum() > 0  # each group has a better and a worse sample


@pytest.mark.parametrize("name", sorted(POLICY_LOSSES))
def test_every_policy_loss_by_name_trains(name: str) -> None:
    cfg = _cfg(policy_loss=name, use_kl_loss=True)
    validate(cfg)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(**SMALL_QWEN2)).float()
    mb = _batch()
    agg = Aggregation.local(agg_mode_for(name, cfg.algorithm.loss_agg_mode), mb.response_mask_BT)
    out = micro_batch_loss(cfg, model, mb, agg)
    assert math.isfinite(out.loss.item())
    out.loss.backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert grads and any(g.abs().sum() > 0 for g in grads)
    assert {"pg_loss", "kl_loss", "entropy"} <= set(out.stats)


def test_bad_names_and_critic_estimators_fail_in_validation() -> None:
    validate(_cfg(adv_estimator="gae"))  # the recipe builds a critic for it
    with pytest.raises(ConfigError, match="algorithm.adv_estimator='ppo' is not one of"):
        validate(_cfg(adv_estimator="ppo"))
    with pytest.raises(ConfigError, match="algorithm.policy_loss='ppo' is not one of vanilla"):
        validate(_cfg(policy_loss="ppo"))
    with pytest.raises(ConfigError, match="algorithm.kl_loss_type"):
        validate(_cfg(kl_loss_type="k4"))
    # 0.5_2.0 unquoted reaches the config as the number 0.52: a bound pair that would reject everything.
    bad = dataclasses.replace(
        AlgorithmConfig().rollout_correction, rollout_rs="token_k1", rollout_rs_threshold="0.52"
    )
    with pytest.raises(ConfigError, match="keeps nothing"):
        validate(_cfg(rollout_correction=bad))
    with pytest.raises(ConfigError, match="clip_ratio_c must be > 1"):
        validate(_cfg(clip_ratio_c=1.0))
