"""Every verl policy loss is selectable by its name alone through the recipe's update (spmdrl/rl/update.py),
with the configured entropy / KL modes and bypass mode (one process, a small in-memory Qwen2)."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from spmdrl.algos.aggregation import Aggregation
from spmdrl.algos.kl import kl_penalty
from spmdrl.algos.policy_losses import POLICY_LOSSES, agg_mode_for
from spmdrl.config import AlgorithmConfig, Config, ConfigError, validate
from spmdrl.models.forward import policy_logprobs
from spmdrl.rl.batch import PolicyBatch
from spmdrl.rl.settings import update_settings
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


@pytest.mark.parametrize("name", sorted(POLICY_LOSSES))
def test_every_policy_loss_by_name_trains(name: str) -> None:
    cfg = _cfg(policy_loss=name, use_kl_loss=True, **NEEDS.get(name, {}))
    validate(cfg)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(**SMALL_QWEN2)).float()
    mb = _batch()
    agg = Aggregation.local(agg_mode_for(name, cfg.algorithm.loss_agg_mode), mb.response_mask_BT)
    out = micro_batch_loss(update_settings(cfg), model, mb, agg)
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
    assert loss_modes(cfg.algorithm) == (policy_mode, mode)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(**SMALL_QWEN2)).float()
    mb = _batch()
    mask_BT = mb.response_mask_BT
    agg, pg_agg = Aggregation.local(mode, mask_BT), Aggregation.local(policy_mode, mask_BT)
    out = micro_batch_loss(update_settings(cfg), model, mb, agg, pg_agg)
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


def test_bypass_mode_trains_against_the_engine_logprobs() -> None:
    # verl's apply_bypass_mode: the engine's logprobs are the old policy and the loss is bypass_mode.
    rc = dataclasses.replace(
        AlgorithmConfig().rollout_correction, bypass_mode=True, rollout_is="token", loss_type="reinforce"
    )
    cfg = _cfg(rollout_correction=rc, use_kl_loss=False)
    validate(cfg)
    assert loss_modes(cfg.algorithm) == ("token-mean", "token-mean")
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(**SMALL_QWEN2)).float()
    mb = _batch()
    mb = mb.replace(engine_logprobs_BT=mb.engine_logprobs_BT - 0.3)  # differs from old_logprobs_BT
    mask_BT = mb.response_mask_BT
    out = micro_batch_loss(update_settings(cfg), model, mb, Aggregation.local("token-mean", mask_BT))
    lp_BT, _ = policy_logprobs(model, mb.input_ids_BT, mb.attention_mask_BT, first_column=4)
    expected_kl = ((mb.engine_logprobs_BT - lp_BT.detach()) * mask_BT).sum() / mask_BT.sum()
    torch.testing.assert_close(out.stats["ppo_kl"], expected_kl)
    assert "rollout_corr/rollout_is_mean" in out.stats


def test_distillation_as_a_loss_term_is_the_teacher_estimate_added_to_the_policy_loss() -> None:
    # teacher.use_policy_gradient=false: the k3 estimate of KL(student || teacher) on the sampled tokens, its
    # own term (actor/distill_loss), weighted by distillation_loss_coef next to the task's policy loss.
    from spmdrl.algos.config import TeacherConfig

    cfg = dataclasses.replace(
        _cfg(use_kl_loss=False),
        teacher=TeacherConfig(
            path="tiny-teacher",
            loss_mode="k3",
            use_policy_gradient=False,
            use_task_rewards=True,
            distillation_loss_coef=0.5,
        ),
    )
    validate(cfg)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(**SMALL_QWEN2)).float()
    mb = _batch()
    mb = mb.replace(teacher_logprobs_BT=mb.engine_logprobs_BT - 0.7)
    mask_BT = mb.response_mask_BT
    agg = Aggregation.local("token-mean", mask_BT)
    out = micro_batch_loss(update_settings(cfg), model, mb, agg)
    lp_BT, _ = policy_logprobs(model, mb.input_ids_BT, mb.attention_mask_BT, first_column=4)
    expected = agg(kl_penalty(lp_BT.detach(), mb.teacher_logprobs_BT, "k3"), mask_BT)
    torch.testing.assert_close(out.stats["distill_loss"], expected)
    torch.testing.assert_close(out.loss.detach(), out.stats["pg_loss"] + 0.5 * expected)
