"""Every verl advantage estimator and policy loss is selectable by its name alone, through the GRPO
recipe's own functions (one process, a small in-memory Qwen2; the multi-process e2e runs a few)."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from spmdrl.algos.advantages import ADV_ESTIMATORS, adv_estimator
from spmdrl.algos.aggregation import Aggregation
from spmdrl.algos.kl import kl_penalty
from spmdrl.algos.policy_losses import POLICY_LOSSES, agg_mode_for
from spmdrl.config import AlgorithmConfig, Config, ConfigError, validate
from spmdrl.models.forward import policy_logprobs
from spmdrl.rl.batch import PolicyBatch
from spmdrl.rl.experience import advantage_estimator
from spmdrl.rl.update import loss_modes, micro_batch_loss
from spmdrl.testing.models import SMALL_QWEN2

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
        cfg,
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


@pytest.mark.parametrize("name", sorted(POLICY_LOSSES))
def test_every_policy_loss_by_name_trains(name: str) -> None:
    cfg = _cfg(policy_loss=name, use_kl_loss=True, **NEEDS.get(name, {}))
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
    with pytest.raises(ConfigError, match="algorithm.adv_estimator='ppo': unknown advantage estimator"):
        validate(_cfg(adv_estimator="ppo"))
    with pytest.raises(
        ConfigError, match="algorithm.policy_loss='ppo': unknown policy loss.*Registered: vanilla"
    ):
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


@pytest.mark.parametrize(
    ("name", "mode", "policy_mode"),
    [
        ("gspo", "token-mean", "token-mean"),  # verl 0.9.1 honours loss_agg_mode for gspo
        ("sapo", "token-mean", "seq-mean-token-mean"),  # and still forces sapo's and geo_mean's policy term
        ("geo_mean", "seq-mean-token-sum", "seq-mean-token-mean"),
        ("vanilla", "token-sum", "token-sum"),
    ],
)
def test_entropy_and_kl_terms_keep_the_configured_mode(name: str, mode: str, policy_mode: str) -> None:
    cfg = _cfg(policy_loss=name, loss_agg_mode=mode, use_kl_loss=True, kl_loss_type="k1")
    assert loss_modes(cfg) == (policy_mode, mode)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(**SMALL_QWEN2)).float()
    mb = _batch()
    mask_BT = mb.response_mask_BT
    agg, pg_agg = Aggregation.local(mode, mask_BT), Aggregation.local(policy_mode, mask_BT)
    out = micro_batch_loss(cfg, model, mb, agg, pg_agg)
    with torch.no_grad():
        lp_BT, ent_BT = policy_logprobs(
            model, mb.input_ids_BT, mb.attention_mask_BT, with_entropy=True, first_column=4
        )
    # verl's ppo_loss: agg_loss(entropy, loss_agg_mode) and agg_loss(kld, loss_agg_mode), whatever the
    # policy loss reduces its own term with.
    torch.testing.assert_close(out.stats["entropy"], agg(ent_BT, mask_BT))
    assert mb.ref_logprobs_BT is not None
    torch.testing.assert_close(
        out.stats["kl_loss"], agg(kl_penalty(lp_BT, mb.ref_logprobs_BT, "k1"), mask_BT)
    )


def _correct_rollout_on_rank(rank: int, world: int) -> dict[str, float]:
    from spmdrl.rl.experience import correct_rollout

    rc = dataclasses.replace(
        AlgorithmConfig().rollout_correction, rollout_is="token", rollout_is_threshold="10"
    )
    cfg = _cfg(rollout_correction=rc)
    mb = _batch()
    # Rank 0's weights are all 2, rank 1's all 0.5 (trainer - engine log ratio of +-log 2).
    shift = math.log(2.0) if rank == 0 else -math.log(2.0)
    assert mb.old_logprobs_BT is not None
    batch = mb.replace(engine_logprobs_BT=mb.old_logprobs_BT - shift)
    return correct_rollout(cfg, batch, torch.device("cpu"))[1]


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


def test_bypass_mode_trains_against_the_engine_logprobs() -> None:
    # verl's apply_bypass_mode: the engine's logprobs are the old policy and the loss is bypass_mode.
    rc = dataclasses.replace(
        AlgorithmConfig().rollout_correction, bypass_mode=True, rollout_is="token", loss_type="reinforce"
    )
    cfg = _cfg(rollout_correction=rc, use_kl_loss=False)
    validate(cfg)
    assert loss_modes(cfg) == ("token-mean", "token-mean")
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(**SMALL_QWEN2)).float()
    mb = _batch()
    mb = mb.replace(engine_logprobs_BT=mb.engine_logprobs_BT - 0.3)  # differs from old_logprobs_BT
    mask_BT = mb.response_mask_BT
    out = micro_batch_loss(cfg, model, mb, Aggregation.local("token-mean", mask_BT))
    lp_BT, _ = policy_logprobs(model, mb.input_ids_BT, mb.attention_mask_BT, first_column=4)
    expected_kl = ((mb.engine_logprobs_BT - lp_BT.detach()) * mask_BT).sum() / mask_BT.sum()
    torch.testing.assert_close(out.stats["ppo_kl"], expected_kl)
    assert "rollout_corr/rollout_is_mean" in out.stats


def test_which_settings_add_the_old_logprob_pass() -> None:
    from spmdrl.config import derive, derive_rl
    from spmdrl.rl.experience import needs_old_logprobs

    def needs(**algorithm: object) -> bool:
        cfg = _cfg(**algorithm)
        return needs_old_logprobs(cfg, derive_rl(cfg, derive(cfg, 1, 1000, samples_per_item=N)))

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
    torch.testing.assert_close(gdpo_reward_components(cfg, rewards), expected)
    assert gdpo_reward_components(_cfg(), rewards) is None
    with pytest.raises(RuntimeError, match=r"returned no \['length'\]"):
        gdpo_reward_components(_cfg(adv_estimator="gdpo", gdpo_reward_keys=["length"]), rewards)
