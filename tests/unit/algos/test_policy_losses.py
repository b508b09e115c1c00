"""Policy losses (spmdrl/algos/policy_losses.py): against values computed by hand or by loop-based
references written from the papers' / verl's formulas (not from the implementation)."""

from __future__ import annotations

import math

import pytest
import torch

from spmdrl.algos.aggregation import Aggregation
from spmdrl.algos.policy_losses import (
    POLICY_LOSSES,
    PolicyLossOutput,
    agg_mode_for,
    policy_loss,
    register_policy_loss,
    vanilla_policy_loss,
)
from spmdrl.config import AlgorithmConfig, Config, ConfigError, RolloutCorrectionConfig, validate

# The losses read their parameters from the algorithm's config section, which holds the defaults.
PARAMS = AlgorithmConfig(clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0, dro_beta=0.5)


def _logprobs(ratios_BT: torch.Tensor, base: float = 0.3) -> tuple[torch.Tensor, torch.Tensor]:
    """(new, old) log-probabilities with new / old = ratios_BT; new requires grad."""
    old_BT = torch.full(ratios_BT.shape, math.log(base))
    new_BT = (old_BT + ratios_BT.log()).requires_grad_()
    return new_BT, old_BT


def _token_mean(mask_BT: torch.Tensor) -> Aggregation:
    return Aggregation.local("token-mean", mask_BT)


# ---------------------------------------------------------------------------------------------- registry


def test_registry_has_verl_names_and_lists_them_on_error():
    assert set(POLICY_LOSSES) == {
        "vanilla",
        "gspo",
        "cispo",
        "gpg",
        "clip_cov",
        "kl_cov",
        "geo_mean",
        "sapo",
        "dppo_tv",
        "dppo_kl",
        "dro",
        "bypass_mode",
    }
    assert policy_loss("gspo") is POLICY_LOSSES["gspo"]
    with pytest.raises(ValueError, match="unknown policy loss 'ppo'.*vanilla, gspo"):
        policy_loss("ppo")
    # verl 0.9.1 reduces sapo / geo_mean with seq-mean-token-mean whatever loss_agg_mode says ...
    assert agg_mode_for("sapo", "token-mean") == "seq-mean-token-mean"
    assert agg_mode_for("geo_mean", "token-sum") == "seq-mean-token-mean"
    assert agg_mode_for("vanilla", "seq-mean-token-sum") == "seq-mean-token-sum"
    # ... and gspo with the configured mode (forced only up to verl 0.8).
    assert agg_mode_for("gspo", "token-mean") == "token-mean"
    assert agg_mode_for("gspo", "seq-mean-token-sum-norm") == "seq-mean-token-sum-norm"


def test_params_are_the_algorithm_section_and_validated_there():
    with pytest.raises(ConfigError, match="clip_ratio_c"):
        validate(Config(algorithm=AlgorithmConfig(clip_ratio_c=1.0)))
    with pytest.raises(ConfigError, match="tau_pos"):
        validate(Config(algorithm=AlgorithmConfig(tau_neg=0.0)))
    with pytest.raises(ConfigError, match="clip_cov_ratio"):
        validate(Config(algorithm=AlgorithmConfig(kl_cov_ratio=0.0)))
    with pytest.raises(ConfigError, match="clip_ratio_low"):
        validate(Config(algorithm=AlgorithmConfig(clip_ratio_low=-0.1)))
    assert AlgorithmConfig().ppo_kl_coef == 0.1  # verl's actor.yaml default


# A user's loss, as a fork would write it: registered by a decorator next to it.
def _halved_vanilla(logprobs_BT, old_logprobs_BT, advantages_BT, mask_BT, *, agg, params, is_weights_BT=None):
    out = vanilla_policy_loss(
        logprobs_BT,
        old_logprobs_BT,
        advantages_BT,
        mask_BT,
        agg=agg,
        params=params,
        is_weights_BT=is_weights_BT,
    )
    return PolicyLossOutput(0.5 * out.loss, {**out.metrics, "halved": torch.tensor(1.0)})


@pytest.fixture
def user_loss():
    register_policy_loss("spmdrl_test_halved", agg_mode="seq-mean-token-sum")(_halved_vanilla)
    yield "spmdrl_test_halved"
    POLICY_LOSSES.unregister("spmdrl_test_halved")


def test_a_decorated_loss_is_selectable_by_name_and_declares_its_mode(user_loss):
    validate(Config(algorithm=AlgorithmConfig(policy_loss=user_loss)))  # accepted at config load
    new_BT, old_BT = _logprobs(torch.tensor([[1.5, 1.0, 0.5]]))
    adv_BT, mask_BT = torch.tensor([[1.0, 1.0, -1.0]]), torch.tensor([[1, 1, 1]])
    out = policy_loss(user_loss)(new_BT, old_BT, adv_BT, mask_BT, agg=_token_mean(mask_BT), params=PARAMS)
    ref = policy_loss("vanilla")(new_BT, old_BT, adv_BT, mask_BT, agg=_token_mean(mask_BT), params=PARAMS)
    assert "halved" in out.metrics and out.loss.item() == pytest.approx(0.5 * ref.loss.item())
    # Its declared aggregation mode overrides algorithm.loss_agg_mode for its policy term.
    assert agg_mode_for(user_loss, "token-mean") == "seq-mean-token-sum"
    # A taken name cannot be registered by another function; a wrong signature fails at registration.
    with pytest.raises(ValueError, match="already registered, by .*_halved_vanilla"):
        register_policy_loss(user_loss)(lambda *a, **k: None)
    with pytest.raises(TypeError, match=r"does not take the arguments of a policy loss.*agg"):
        register_policy_loss("spmdrl_test_bad")(
            lambda logprobs_BT, old_logprobs_BT, advantages_BT, mask_BT: None
        )
    with pytest.raises(ValueError, match="unknown loss aggregation"):
        register_policy_loss("spmdrl_test_bad", agg_mode="mean")


def test_a_loss_by_import_path(tmp_path, monkeypatch):
    (tmp_path / "spmdrl_test_losses.py").write_text(
        "from spmdrl.algos.policy_losses import register_policy_loss, vanilla_policy_loss\n"
        "def plain(logprobs_BT, old_logprobs_BT, advantages_BT, mask_BT, *, agg, params, is_weights_BT=None):\n"
        "    return vanilla_policy_loss(logprobs_BT, old_logprobs_BT, advantages_BT, mask_BT, agg=agg,\n"
        "                               params=params, is_weights_BT=is_weights_BT)\n"
        "@register_policy_loss('spmdrl_test_seq_mean', agg_mode='seq-mean-token-mean')\n"
        "def seq_mean(logprobs_BT, old_logprobs_BT, advantages_BT, mask_BT, *, agg, params, is_weights_BT=None):\n"
        "    return plain(logprobs_BT, old_logprobs_BT, advantages_BT, mask_BT, agg=agg, params=params)\n"
        "def two_args(logprobs_BT, mask_BT):\n"
        "    return None\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        validate(Config(algorithm=AlgorithmConfig(policy_loss="spmdrl_test_losses:plain")))
        new_BT, old_BT = _logprobs(torch.tensor([[1.5, 1.0, 0.5]]))
        adv_BT, mask_BT = torch.tensor([[1.0, 1.0, -1.0]]), torch.tensor([[1, 1, 1]])
        agg = _token_mean(mask_BT)
        out = policy_loss("spmdrl_test_losses:plain")(new_BT, old_BT, adv_BT, mask_BT, agg=agg, params=PARAMS)
        ref = policy_loss("vanilla")(new_BT, old_BT, adv_BT, mask_BT, agg=agg, params=PARAMS)
        torch.testing.assert_close(out.loss, ref.loss)
        # By file path too; an undecorated function has the defaults, a decorated one what it declared.
        assert agg_mode_for(f"{tmp_path}/spmdrl_test_losses.py:plain", "token-sum") == "token-sum"
        assert agg_mode_for("spmdrl_test_losses:seq_mean", "token-sum") == "seq-mean-token-mean"
        with pytest.raises(
            ConfigError, match=r"algorithm.policy_loss=.*two_args does not take the arguments"
        ):
            validate(Config(algorithm=AlgorithmConfig(policy_loss="spmdrl_test_losses:two_args")))
        with pytest.raises(ConfigError, match="has no attribute 'plian'.*plain"):
            validate(Config(algorithm=AlgorithmConfig(policy_loss="spmdrl_test_losses:plian")))
    finally:
        POLICY_LOSSES.unregister("spmdrl_test_seq_mean")


@pytest.mark.parametrize("name", sorted(POLICY_LOSSES))
def test_every_loss_ignores_masked_nan_and_takes_per_sequence_advantages(name):
    torch.manual_seed(0)
    new_BT, old_BT = _logprobs(torch.tensor([[1.1, 0.9, 1.0], [1.2, 0.7, 1.0]]))
    mask_BT = torch.tensor([[1, 1, 0], [1, 1, 1]])
    adv_B = torch.tensor([1.0, -0.5])
    agg = Aggregation.local("seq-mean-token-mean", mask_BT)
    fn = policy_loss(name)
    out = fn(new_BT, old_BT, adv_B, mask_BT, agg=agg, params=PARAMS)
    poisoned_BT = torch.where(mask_BT.bool(), new_BT, torch.nan)
    torch.manual_seed(0)
    same = fn(poisoned_BT, old_BT, adv_B[:, None].expand(2, 3), mask_BT, agg=agg, params=PARAMS)
    torch.testing.assert_close(out.loss, same.loss)
    (grad_BT,) = torch.autograd.grad(same.loss, new_BT)
    assert torch.isfinite(grad_BT).all() and grad_BT[0, 2] == 0
    assert all(torch.isfinite(v) and not v.requires_grad for v in out.metrics.values())


# ---------------------------------------------------------------------------------------------- vanilla


def _vanilla_example():
    # Row 0: A = +1; row 1: A = -1, its last token with r = 4 > clip_ratio_c = 3.
    ratios_BT = torch.tensor([[1.5, 1.0, 0.5], [0.5, 1.1, 4.0]])
    new_BT, old_BT = _logprobs(ratios_BT)
    return ratios_BT, new_BT, old_BT, torch.ones(2, 3), torch.tensor([[1.0] * 3, [-1.0] * 3])


def test_vanilla_dual_clip_active_by_hand():
    ratios_BT, new_BT, old_BT, mask_BT, adv_BT = _vanilla_example()
    out = policy_loss("vanilla")(new_BT, old_BT, adv_BT, mask_BT, agg=_token_mean(mask_BT), params=PARAMS)
    # max(-A r, -A clip(r, 0.8, 1.28)); for A < 0 then min(., -A * 3):
    #   A=+1: r=1.5 -> -1.28 (clipped high), r=1 -> -1, r=0.5 -> max(-0.5, -0.8) = -0.5
    #   A=-1: r=0.5 -> max(0.5, 0.8) = 0.8 (clipped low), r=1.1 -> 1.1, r=4 -> min(max(4, 1.28), 3) = 3 (dual)
    assert out.loss.item() == pytest.approx((-1.28 - 1.0 - 0.5 + 0.8 + 1.1 + 3.0) / 6)
    assert out.metrics["pg_clipfrac"].item() == pytest.approx(2 / 6)
    assert out.metrics["pg_clipfrac_lower"].item() == pytest.approx(1 / 6)
    assert out.metrics["ppo_kl"].item() == pytest.approx(-sum(math.log(r) for r in ratios_BT.flatten()) / 6)
    out.loss.backward()
    # d(-A r)/d logp = -A r where the unclipped term is used; 0 where clipped or dual-clipped.
    torch.testing.assert_close(new_BT.grad, torch.tensor([[0.0, -1.0, -0.5], [0.0, 1.1, 0.0]]) / 6)


def test_vanilla_dual_clip_inactive_when_c_is_large():
    _, new_BT, old_BT, mask_BT, adv_BT = _vanilla_example()
    params = AlgorithmConfig(clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=5.0)
    out = policy_loss("vanilla")(new_BT, old_BT, adv_BT, mask_BT, agg=_token_mean(mask_BT), params=params)
    assert out.loss.item() == pytest.approx((-1.28 - 1.0 - 0.5 + 0.8 + 1.1 + 4.0) / 6)
    assert out.metrics["pg_clipfrac_lower"].item() == 0.0
    out.loss.backward()
    assert new_BT.grad[1, 2].item() == pytest.approx(4.0 / 6)  # the ratio's gradient is back


def test_vanilla_is_weights_and_aggregation():
    _, new_BT, old_BT, mask_BT, adv_BT = _vanilla_example()
    weights_BT = torch.tensor([[2.0] * 3, [0.5] * 3], requires_grad=True)
    agg = Aggregation.local("seq-mean-token-sum", mask_BT)
    out = policy_loss("vanilla")(
        new_BT, old_BT, adv_BT, mask_BT, agg=agg, params=PARAMS, is_weights_BT=weights_BT
    )
    assert out.loss.item() == pytest.approx((2 * (-1.28 - 1.0 - 0.5) + 0.5 * (0.8 + 1.1 + 3.0)) / 2)
    out.loss.backward()
    assert weights_BT.grad is None


# ---------------------------------------------------------------------------------------------- gspo


def test_gspo_sequence_ratio_and_gradient():
    log_ratio_BT = torch.tensor([[0.1, 0.3, -0.1], [0.5, 0.4, 9.0]])  # row 1's last token masked
    old_BT = torch.full((2, 3), -1.0)
    new_BT = (old_BT + log_ratio_BT).requires_grad_()
    mask_BT = torch.tensor([[1, 1, 1], [1, 1, 0]])
    adv_B = torch.tensor([2.0, 1.0])
    agg = Aggregation.local("seq-mean-token-mean", mask_BT)
    out = policy_loss("gspo")(new_BT, old_BT, adv_B, mask_BT, agg=agg, params=PARAMS)
    # Sequence ratios: exp(mean log r) = exp(0.1) (inside [0.8, 1.28]) and exp(0.45) = 1.568 (clipped).
    s0, s1 = math.exp(0.1), math.exp(0.45)
    seq_losses = [-2.0 * s0, max(-1.0 * s1, -1.0 * 1.28)]
    assert out.loss.item() == pytest.approx(sum(seq_losses) / 2)
    # All of a sequence's tokens share one clipping decision.
    assert out.metrics["pg_clipfrac"].item() == pytest.approx(2 / 5)
    assert out.metrics["pg_clipfrac_lower"].item() == 0.0
    assert out.metrics["ppo_kl"].item() == pytest.approx(-(0.1 + 0.3 - 0.1 + 0.5 + 0.4) / 5)
    out.loss.backward()
    # Token t of an unclipped sequence: d/dlogp_t of -A s_i (with s_i's value, the token's own gradient)
    # = -A s_i, averaged over the sequence's 3 tokens and 2 sequences. Equal for all three tokens,
    # although their token ratios differ (vanilla PPO would weight them by exp(log r_t)).
    expected = torch.tensor([[-2.0 * s0 / 3 / 2] * 3, [0.0, 0.0, 0.0]])
    torch.testing.assert_close(new_BT.grad, expected)


# ---------------------------------------------------------------------------------------------- cispo


def test_cispo_clipped_weight_with_stop_gradient():
    ratios_BT = torch.tensor([[1.5, 1.0, 0.5]])
    new_BT, old_BT = _logprobs(ratios_BT)
    mask_BT = torch.ones(1, 3)
    adv_BT = torch.tensor([[1.0, -1.0, 2.0]])
    out = policy_loss("cispo")(new_BT, old_BT, adv_BT, mask_BT, agg=_token_mean(mask_BT), params=PARAMS)
    clipped = [1.28, 1.0, 0.8]
    logp = new_BT.detach()[0].tolist()
    expected = sum(-c * a * lp for c, a, lp in zip(clipped, [1.0, -1.0, 2.0], logp, strict=True)) / 3
    assert out.loss.item() == pytest.approx(expected)
    assert out.metrics["pg_clipfrac"].item() == pytest.approx(2 / 3)
    out.loss.backward()
    # The gradient is -sg(clip(r)) A / N on every token, clipped ones included (unlike PPO).
    torch.testing.assert_close(new_BT.grad, torch.tensor([[-1.28, 1.0, -1.6]]) / 3)


# ---------------------------------------------------------------------------------------------- gpg


def test_gpg_is_reinforce():
    new_BT = torch.tensor([[-0.5, -1.0], [-2.0, -0.1]], requires_grad=True)
    mask_BT = torch.tensor([[1, 1], [1, 0]])
    adv_B = torch.tensor([1.0, -3.0])
    out = policy_loss("gpg")(
        new_BT, torch.zeros(2, 2), adv_B, mask_BT, agg=_token_mean(mask_BT), params=PARAMS
    )
    assert out.loss.item() == pytest.approx((0.5 + 1.0 - 6.0) / 3)
    assert out.metrics == {}
    out.loss.backward()
    torch.testing.assert_close(new_BT.grad, torch.tensor([[-1.0, -1.0], [3.0, 0.0]]) / 3)


# ---------------------------------------------------------------------------------------------- clip_cov / kl_cov


def _cov_reference(adv_BT, logp_BT, mask_BT):
    """(A - mean A)(logp - mean logp) over valid tokens, by loops."""
    cells = [(b, t) for b in range(mask_BT.shape[0]) for t in range(mask_BT.shape[1]) if mask_BT[b, t]]
    mean_a = sum(float(adv_BT[b, t]) for b, t in cells) / len(cells)
    mean_l = sum(float(logp_BT[b, t]) for b, t in cells) / len(cells)
    return {(b, t): (float(adv_BT[b, t]) - mean_a) * (float(logp_BT[b, t]) - mean_l) for b, t in cells}


def _cov_example():
    gen = torch.Generator().manual_seed(0)
    logp_BT = torch.randn(4, 6, generator=gen) * 2 - 2
    adv_BT = torch.randn(4, 1, generator=gen).expand(4, 6) * 2
    mask_BT = (torch.rand(4, 6, generator=gen) > 0.2).long()
    old_BT = logp_BT + torch.randn(4, 6, generator=gen) * 0.05
    return logp_BT.clone().requires_grad_(), old_BT, adv_BT.contiguous(), mask_BT


def test_clip_cov_drops_the_gradient_of_candidates_only():
    new_BT, old_BT, adv_BT, mask_BT = _cov_example()
    cov = _cov_reference(adv_BT, new_BT.detach(), mask_BT)
    log_r_BT = (new_BT - old_BT).detach()
    lo, hi = 0.5, 5.0
    candidates = set()
    for (b, t), c in cov.items():
        r = math.exp(float(log_r_BT[b, t]))
        a = float(adv_BT[b, t])
        clipped_by_ppo = -a * min(max(r, 0.8), 1.28) > -a * r
        if lo < c < hi and not clipped_by_ppo:
            candidates.add((b, t))
    assert 2 <= len(candidates) < len(cov)  # the example exercises the selection

    # A ratio of 1 draws max(int(1 * valid), 1) >= all candidates: exactly the candidates drop out.
    params = AlgorithmConfig(clip_ratio_low=0.2, clip_ratio_high=0.28, clip_cov_ratio=1.0, clip_cov_lb=lo)
    out = policy_loss("clip_cov")(new_BT, old_BT, adv_BT, mask_BT, agg=_token_mean(mask_BT), params=params)
    (grad_BT,) = torch.autograd.grad(out.loss, new_BT)
    vanilla = policy_loss("vanilla")(
        new_BT,
        old_BT,
        adv_BT,
        mask_BT,
        agg=_token_mean(mask_BT),
        params=AlgorithmConfig(clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=1e9),
    )
    (vanilla_grad_BT,) = torch.autograd.grad(vanilla.loss, new_BT)
    for b, t in cov:
        expected = 0.0 if (b, t) in candidates else vanilla_grad_BT[b, t].item()
        assert grad_BT[b, t].item() == pytest.approx(expected, abs=1e-7)
    assert out.metrics["pg_clipfrac"].item() == pytest.approx(len(candidates) / len(cov))

    # A tiny ratio draws one candidate, at random (global RNG): the same with the same seed.
    params = AlgorithmConfig(clip_ratio_low=0.2, clip_ratio_high=0.28, clip_cov_ratio=1e-4, clip_cov_lb=lo)
    dropped = []
    for _ in range(2):
        torch.manual_seed(123)
        out = policy_loss("clip_cov")(
            new_BT, old_BT, adv_BT, mask_BT, agg=_token_mean(mask_BT), params=params
        )
        (grad_BT,) = torch.autograd.grad(out.loss, new_BT)
        zero = {(b, t) for b, t in cov if grad_BT[b, t] == 0 and vanilla_grad_BT[b, t] != 0}
        assert len(zero) == 1 and zero <= candidates
        dropped.append(zero)
    assert dropped[0] == dropped[1]


def test_kl_cov_penalizes_the_top_covariance_tokens():
    new_BT, old_BT, adv_BT, mask_BT = _cov_example()
    cov = _cov_reference(adv_BT, new_BT.detach(), mask_BT)
    n_valid = len(cov)
    params = AlgorithmConfig(kl_cov_ratio=0.1, ppo_kl_coef=0.5)
    k = max(1, int(n_valid * 0.1))
    top = set(sorted(cov, key=cov.get, reverse=True)[:k])
    total = 0.0
    for b, t in cov:
        log_r = float(new_BT[b, t].detach() - old_BT[b, t])
        total += -float(adv_BT[b, t]) * math.exp(log_r) + (0.5 * abs(log_r) if (b, t) in top else 0.0)
    out = policy_loss("kl_cov")(new_BT, old_BT, adv_BT, mask_BT, agg=_token_mean(mask_BT), params=params)
    assert out.loss.item() == pytest.approx(total / n_valid, rel=1e-5)
    abs_kl = sum(abs(float(new_BT[b, t].detach() - old_BT[b, t])) for b, t in cov) / n_valid
    assert out.metrics["ppo_kl"].item() == pytest.approx(abs_kl, rel=1e-5)


# ---------------------------------------------------------------------------------------------- geo_mean


def test_geo_mean_by_loops():
    log_ratio_BT = torch.tensor([[0.5, -0.5, 0.1, 7.0], [0.5, -0.5, -0.1, 0.0]])  # (0, 3) masked
    old_BT = torch.full((2, 4), -1.0)
    new_BT = (old_BT + log_ratio_BT).requires_grad_()
    mask_BT = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]])
    adv_B = torch.tensor([1.0, -2.0])
    w_BT = torch.tensor([[1.0, 2.0, 0.5, 9.0], [1.5, 1.5, 1.5, 1.5]])
    low, high = 0.2, 0.28
    expected_seq = []
    for b in range(2):
        a = float(adv_B[b])
        terms, log_w = [], []
        for t in range(4):
            if not mask_BT[b, t]:
                continue
            d = float(log_ratio_BT[b, t])
            c = min(max(d, -low), high)
            # The pessimistic side: the smaller log ratio for A > 0, the larger for A < 0.
            terms.append(min(d, c) if a > 0 else max(d, c))
            log_w.append(math.log(float(w_BT[b, t]) + 1e-10))
        rho = math.exp(sum(terms) / len(terms))
        expected_seq.append(-a * rho * math.exp(sum(log_w) / len(log_w)))
    agg = Aggregation.local("seq-mean-token-mean", mask_BT)
    out = policy_loss("geo_mean")(new_BT, old_BT, adv_B, mask_BT, agg=agg, params=PARAMS, is_weights_BT=w_BT)
    assert out.loss.item() == pytest.approx(sum(expected_seq) / 2)
    # Clipped tokens: |d| = 0.5 in both rows; A > 0 in row 0, A < 0 in row 1.
    assert out.metrics["pg_clipfrac"].item() == pytest.approx(2 / 7)
    assert out.metrics["pg_clipfrac_lower"].item() == pytest.approx(2 / 7)
    out.loss.backward()
    # d/d logp_t of -A exp(mean m): -A rho / n where m_t = d_t (unclipped side), 0 where clipped.
    g0 = -1.0 * math.exp((-0.5 + 0.1 + 0.28) / 3) / 3 * math.exp((math.log(2.0) + math.log(0.5)) / 3) / 2
    assert new_BT.grad[0, 1].item() == pytest.approx(g0)
    assert new_BT.grad[0, 0].item() == 0.0 and new_BT.grad[0, 3].item() == 0.0


# ---------------------------------------------------------------------------------------------- sapo


def test_sapo_soft_gates():
    ratios_BT = torch.tensor([[1.0, 1.3, 1.0, 0.6]])
    new_BT, old_BT = _logprobs(ratios_BT)
    adv_BT = torch.tensor([[1.0, 1.0, -1.0, -2.0]])
    mask_BT = torch.ones(1, 4)
    params = AlgorithmConfig(tau_pos=1.0, tau_neg=1.05)

    def sig(x):
        return 1 / (1 + math.exp(-x))

    taus = [1.0, 1.0, 1.05, 1.05]
    gates = [sig(tau * (r - 1)) * 4 / tau for tau, r in zip(taus, [1.0, 1.3, 1.0, 0.6], strict=True)]
    assert gates[0] == pytest.approx(2.0)  # f(1) = 2 / tau
    out = policy_loss("sapo")(new_BT, old_BT, adv_BT, mask_BT, agg=_token_mean(mask_BT), params=params)
    expected = sum(-g * a for g, a in zip(gates, [1.0, 1.0, -1.0, -2.0], strict=True)) / 4
    assert out.loss.item() == pytest.approx(expected)
    assert out.metrics["pg_clipfrac"].item() == 0.0
    out.loss.backward()
    # d f / d logp = r * 4 * sig'(tau (r - 1)) with sig' = sig (1 - sig): the tau cancels.
    grads = [
        -a * r * 4 * sig(tau * (r - 1)) * (1 - sig(tau * (r - 1))) / 4
        for tau, r, a in zip(taus, [1.0, 1.3, 1.0, 0.6], [1.0, 1.0, -1.0, -2.0], strict=True)
    ]
    torch.testing.assert_close(new_BT.grad, torch.tensor([grads]))


# ---------------------------------------------------------------------------------------------- dppo


def _dppo_example():
    """p_old and p per valid token, advantages, and the last position masked."""
    p_old = [0.5, 0.3, 0.5, 0.1, 0.7]
    p_new = [0.6, 0.7, 0.2, 0.4, 0.2]
    adv = [1.0, 1.0, -1.0, -1.0, 1.0]
    new_BT = torch.tensor([[math.log(p) for p in p_new] + [math.log(0.9)]]).requires_grad_()
    old_BT = torch.tensor([[math.log(p) for p in p_old] + [math.log(0.1)]])
    mask_BT = torch.tensor([[1, 1, 1, 1, 1, 0]])
    return p_old, p_new, adv, new_BT, old_BT, torch.tensor([adv + [0.0]]), mask_BT


def _dppo_reference(keep: list[bool], p_old, p_new, adv, c: float) -> tuple[float, list[float]]:
    """Token-mean of -A min(r, c) logp over kept tokens, and its gradient in logp (r detached)."""
    n = len(adv)
    loss = sum(
        -a * min(q / po, c) * math.log(q) for a, q, po, k in zip(adv, p_new, p_old, keep, strict=True) if k
    )
    grad = [
        -a * min(q / po, c) / n if k else 0.0 for a, q, po, k in zip(adv, p_new, p_old, keep, strict=True)
    ]
    return loss / n, grad


@pytest.mark.parametrize("name", ["dppo_tv", "dppo_kl"])
def test_dppo_trust_region_on_the_token_probability(name):
    p_old, p_new, adv, new_BT, old_BT, adv_BT, mask_BT = _dppo_example()
    eps_l, eps_h, c = PARAMS.clip_ratio_low, PARAMS.clip_ratio_high, PARAMS.clip_ratio_c
    if name == "dppo_tv":
        # A > 0 keeps p - p_old <= 0.28, A < 0 keeps p - p_old >= -0.2: 0.1 yes, 0.4 no, -0.3 no, 0.3 yes,
        # -0.5 yes (a positive-advantage token whose probability fell is never dropped).
        keep = [
            d <= eps_h if a > 0 else d >= -eps_l
            for d, a in zip([q - po for q, po in zip(p_new, p_old, strict=True)], adv, strict=True)
        ]
        assert keep == [True, False, False, True, True]
    else:
        # Binary KL of (p_old, 1 - p_old) to (p, 1 - p): 0.020, 0.339 (p rose: dropped), 0.223 (> 0.2 and p
        # fell with A < 0: dropped), p rose with A < 0 (kept), p fell with A > 0 (kept).
        kl = [
            po * math.log(po / q) + (1 - po) * math.log((1 - po + 1e-8) / (1 - q + 1e-8))
            for po, q in zip(p_old, p_new, strict=True)
        ]
        keep = [
            (d <= eps_h or q <= po) if a > 0 else (d <= eps_l or q >= po)
            for d, q, po, a in zip(kl, p_new, p_old, adv, strict=True)
        ]
        assert keep == [True, False, False, True, True]
    out = policy_loss(name)(new_BT, old_BT, adv_BT, mask_BT, agg=_token_mean(mask_BT), params=PARAMS)
    loss, grad = _dppo_reference(keep, p_old, p_new, adv, c)
    assert out.loss.item() == pytest.approx(loss, rel=1e-5)
    (g_BT,) = torch.autograd.grad(out.loss, new_BT)
    torch.testing.assert_close(g_BT[0, :5], torch.tensor(grad))
    assert g_BT[0, 5] == 0
    assert out.metrics["pg_clipfrac"].item() == pytest.approx(2 / 5)
    # Kept tokens whose ratio exceeds c = 3: token 3 (0.4 / 0.1 = 4).
    assert out.metrics["pg_clipfrac_lower"].item() == pytest.approx(1 / 5)


def test_dro_quadratic_log_ratio_penalty():
    new_BT = torch.tensor([[math.log(0.5), math.log(0.2)]], requires_grad=True)
    old_BT = torch.tensor([[math.log(0.25), math.log(0.2)]])
    adv_BT, mask_BT = torch.tensor([[2.0, -1.0]]), torch.tensor([[1, 1]])
    params = AlgorithmConfig(dro_beta=0.5)
    out = policy_loss("dro")(new_BT, old_BT, adv_BT, mask_BT, agg=_token_mean(mask_BT), params=params)
    d = math.log(2.0)  # token 0's log ratio; token 1's is 0
    expected = (-(2.0 * math.log(0.5) - 0.25 * d * d) - (-1.0 * math.log(0.2))) / 2
    assert out.loss.item() == pytest.approx(expected)
    (g_BT,) = torch.autograd.grad(out.loss, new_BT)
    torch.testing.assert_close(g_BT, torch.tensor([[-(2.0 - 0.5 * d) / 2, 1.0 / 2]]))
    assert out.metrics["ppo_kl"].item() == pytest.approx(-d / 2)
    with pytest.raises(ValueError, match="dro_beta"):
        policy_loss("dro")(
            new_BT, old_BT, adv_BT, mask_BT, agg=_token_mean(mask_BT), params=AlgorithmConfig()
        )
    with pytest.raises(ConfigError, match="dro_beta"):
        validate(Config(algorithm=AlgorithmConfig(dro_beta=0.0)))


# ---------------------------------------------------------------------------------------------- bypass mode


def test_bypass_mode_ppo_clip_is_vanilla_against_the_rollout_on_the_kept_tokens():
    # old = the engine's logprobs (bypass). Rejection (token_k1, 0.5 <= pi / pi_rollout <= 2) drops the
    # token at ratio 2.5; PPO-clip then runs on the rest with no IS weights (the ratio is the weight).
    new_BT, rollout_BT = _logprobs(torch.tensor([[1.1, 2.5, 0.9, 1.4]]))
    adv_BT, mask_BT = torch.tensor([[1.0, 1.0, -1.0, -1.0]]), torch.tensor([[1, 1, 1, 1]])
    rc = RolloutCorrectionConfig(rollout_is="token", rollout_rs="token_k1", rollout_rs_threshold="0.5_2.0")
    params = AlgorithmConfig(rollout_correction=rc)
    agg = _token_mean(mask_BT)  # counted before rejection, as verl's batch_num_tokens
    out = policy_loss("bypass_mode")(
        new_BT, rollout_BT, adv_BT, mask_BT, agg=agg, params=params, is_weights_BT=torch.full((1, 4), 7.0)
    )
    kept_BT = torch.tensor([[1, 0, 1, 1]])
    ref = policy_loss("vanilla")(new_BT, rollout_BT, adv_BT, kept_BT, agg=agg, params=params)
    torch.testing.assert_close(out.loss, ref.loss)
    assert out.metrics["rollout_corr/rollout_rs_masked_fraction"].item() == pytest.approx(1 / 4)
    assert "rollout_corr/rollout_is_mean" in out.metrics and "pg_clipfrac" in out.metrics


def test_bypass_mode_reinforce_weights_the_policy_gradient():
    # loss_type=reinforce: -A logp w, w = min(pi / pi_rollout, 2) detached (token TIS).
    ratios = [1.5, 3.0, 0.5]
    new_BT, rollout_BT = _logprobs(torch.tensor([ratios]))
    adv_BT, mask_BT = torch.tensor([[1.0, -2.0, 0.5]]), torch.tensor([[1, 1, 1]])
    rc = RolloutCorrectionConfig(rollout_is="token", rollout_is_threshold="2.0", loss_type="reinforce")
    out = policy_loss("bypass_mode")(
        new_BT,
        rollout_BT,
        adv_BT,
        mask_BT,
        agg=_token_mean(mask_BT),
        params=AlgorithmConfig(rollout_correction=rc),
    )
    w = [min(r, 2.0) for r in ratios]
    logp = [math.log(0.3 * r) for r in ratios]
    a = [1.0, -2.0, 0.5]
    assert out.loss.item() == pytest.approx(
        sum(-ai * lp * wi for ai, lp, wi in zip(a, logp, w, strict=True)) / 3
    )
    (g_BT,) = torch.autograd.grad(out.loss, new_BT)
    torch.testing.assert_close(g_BT, torch.tensor([[-ai * wi / 3 for ai, wi in zip(a, w, strict=True)]]))
    assert out.metrics["ppo_kl"].item() == pytest.approx(-sum(math.log(r) for r in ratios) / 3, rel=1e-5)
    bad = RolloutCorrectionConfig(bypass_mode=True, loss_type="ppo")
    with pytest.raises(ConfigError, match="loss_type"):
        validate(Config(algorithm=AlgorithmConfig(rollout_correction=bad)))


def test_a_loss_that_declares_a_section_is_called_with_its_values() -> None:
    """register_policy_loss(section=...): the update passes the section's values as ``section=``, and a
    loss that cannot take them is refused at registration."""
    import dataclasses

    from spmdrl.algos.policy_losses import POLICY_LOSSES, register_policy_loss

    @dataclasses.dataclass
    class ScaleSection:
        scale: float = 1.0

    @register_policy_loss("scaled_for_test", section=ScaleSection)
    def scaled(
        logprobs_BT, old_logprobs_BT, advantages_BT, mask_BT, *, agg, params, section, is_weights_BT=None
    ):
        out = vanilla_policy_loss(
            logprobs_BT,
            old_logprobs_BT,
            advantages_BT,
            mask_BT,
            agg=agg,
            params=params,
            is_weights_BT=is_weights_BT,
        )
        out.loss = out.loss * section.scale
        return out

    try:
        assert POLICY_LOSSES.get("scaled_for_test").section is ScaleSection
        with pytest.raises(TypeError, match="as it declared, section.*unexpected keyword argument 'section'"):
            register_policy_loss("no_section_arg_for_test", section=ScaleSection)(vanilla_policy_loss)
    finally:
        POLICY_LOSSES.unregister("scaled_for_test")


# ---------------------------------------------------------------------------------------------- PPO loss


def _ppo_example():
    # Ratios per token; sequence 0 has advantage +1, sequence 1 has -1; the last token is padding.
    ratios_BT = torch.tensor([[1.5, 1.0, 0.5], [0.5, 1.1, 3.0]])
    old_BT = torch.full((2, 3), math.log(0.3))
    new_BT = (old_BT + ratios_BT.log()).requires_grad_()
    mask_BT = torch.tensor([[1, 1, 1], [1, 1, 0]])
    return ratios_BT, old_BT, new_BT, mask_BT, torch.tensor([1.0, -1.0])


def test_vanilla_policy_loss_by_hand():
    ratios_BT, old_BT, new_BT, mask_BT, adv_B = _ppo_example()
    out = vanilla_policy_loss(
        new_BT,
        old_BT,
        adv_B,
        mask_BT,
        agg=Aggregation.local("token-mean", mask_BT),
        params=AlgorithmConfig(clip_ratio_low=0.2, clip_ratio_high=0.28),
    )
    # Per-token max(-A r, -A clip(r, 0.8, 1.28)):
    #   A=+1: r=1.5 -> max(-1.5, -1.28) = -1.28 (clipped high); r=1 -> -1; r=0.5 -> max(-0.5, -0.8) = -0.5
    #   A=-1: r=0.5 -> max(0.5, 0.8) = 0.8 (clipped low); r=1.1 -> 1.1; r=3.0 masked.
    assert out.loss.item() == pytest.approx((-1.28 - 1.0 - 0.5 + 0.8 + 1.1) / 5)
    assert out.metrics["pg_clipfrac"].item() == pytest.approx(2 / 5)
    # verl's ppo_kl: the mean of -log r (k1 of old vs new).
    assert out.metrics["ppo_kl"].item() == pytest.approx(
        -sum(math.log(r) for r in (1.5, 1.0, 0.5, 0.5, 1.1)) / 5
    )
    out.loss.backward()
    # d(-A r)/d logp = -A r on unclipped tokens, 0 on clipped and masked ones; / 5 tokens.
    expected_grad = torch.tensor([[0.0, -1.0, -0.5], [0.0, 1.1, 0.0]]) / 5
    torch.testing.assert_close(new_BT.grad, expected_grad)


def test_vanilla_policy_loss_is_weights_scale_without_gradient():
    _, old_BT, new_BT, mask_BT, adv_B = _ppo_example()
    weights_BT = torch.tensor([[2.0, 2.0, 2.0], [0.5, 0.5, 0.5]], requires_grad=True)
    agg, params = Aggregation.local("token-mean", mask_BT), AlgorithmConfig(clip_ratio_high=0.28)
    out = vanilla_policy_loss(
        new_BT, old_BT, adv_B, mask_BT, agg=agg, params=params, is_weights_BT=weights_BT
    )
    assert out.loss.item() == pytest.approx((2 * (-1.28 - 1.0 - 0.5) + 0.5 * (0.8 + 1.1)) / 5)
    out.loss.backward()
    assert weights_BT.grad is None
    # Per-token advantages (B, T) are the same as broadcast per-sequence ones.
    same = vanilla_policy_loss(
        new_BT, old_BT, adv_B[:, None].expand(2, 3), mask_BT, agg=agg, params=params, is_weights_BT=weights_BT
    )
    assert same.loss.item() == pytest.approx(out.loss.item())
