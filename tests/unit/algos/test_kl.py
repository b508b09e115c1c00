"""KL estimators (spmdrl/algos/kl.py) against hand-computed values, verl's aliases and registered kinds."""

from __future__ import annotations

import math

import pytest
import torch

from spmdrl.algos.kl import KL_ESTIMATORS, k3_unclamped, kl_penalty, register_kl_estimator
from spmdrl.config import AlgorithmConfig, Config, ConfigError, validate

# ---------------------------------------------------------------------------------------------- KL


def test_kl_estimators_on_numbers():
    logp = torch.tensor([[math.log(0.5)]])
    ref = torch.tensor([[math.log(0.25)]])
    # d = ref - logp = log(0.5)
    assert kl_penalty(logp, ref, "k1").item() == pytest.approx(math.log(2))
    assert kl_penalty(logp, ref, "k2").item() == pytest.approx(0.5 * math.log(2) ** 2)
    assert kl_penalty(logp, ref, "k3").item() == pytest.approx(0.5 + math.log(2) - 1)
    assert kl_penalty(logp, ref, "low_var_kl").item() == pytest.approx(0.5 + math.log(2) - 1)


def test_low_var_kl_clamps_with_finite_gradient():
    logp = torch.tensor([[0.0, -100.0]], requires_grad=True)
    ref = torch.tensor([[100.0, 0.0]])
    kl = kl_penalty(logp, ref, "low_var_kl")
    # exp(100) overflows float32; the estimate is clamped to 10 and the gradient stays finite
    # (clamp()'s zero gradient times an infinite exp() gradient would be NaN).
    assert kl.tolist() == [[10.0, 10.0]]
    kl.sum().backward()
    assert torch.isfinite(logp.grad).all()
    # verl 0.9.1's kl_penalty_forward: "k3" is low_var_kl, clamped the same way.
    assert kl_penalty(logp, ref, "k3").tolist() == [[10.0, 10.0]]
    # The plain estimator, for diagnostics, is not clamped.
    assert k3_unclamped(logp, ref)[0, 0].item() == float("inf")


def test_kl_unknown_kind_lists_kinds():
    with pytest.raises(
        ValueError, match=r"unknown KL estimator 'k4'\. Registered: k1, kl, abs, k2, mse, k3, low_var_kl"
    ):
        kl_penalty(torch.zeros(1, 1), torch.zeros(1, 1), "k4")


# ---------------------------------------------------------------------------------------------- KL


def test_kl_kinds_by_hand_with_verl_aliases():
    logp = torch.tensor([[math.log(0.5)]])
    ref = torch.tensor([[math.log(0.25)]])
    d = math.log(0.5)  # ref - logp
    expected = {"kl": -d, "k1": -d, "abs": abs(d), "mse": 0.5 * d * d, "k2": 0.5 * d * d}
    expected.update({"k3": math.exp(d) - d - 1, "low_var_kl": math.exp(d) - d - 1})
    for kind, value in expected.items():
        assert kl_penalty(logp, ref, kind).item() == pytest.approx(value), kind
        assert kl_penalty(logp, ref, kind + "+").item() == pytest.approx(value), kind + "+"
    with pytest.raises(ValueError, match="unknown KL estimator 'full'"):
        kl_penalty(logp, ref, "full")
    assert {"k3", "low_var_kl", "k1", "kl", "k2", "mse", "abs"} == set(KL_ESTIMATORS)


def test_a_decorated_kl_estimator_by_name_and_with_plus(tmp_path):
    @register_kl_estimator("spmdrl_test_sq")
    def squared(logprobs_BT, ref_logprobs_BT):
        return (logprobs_BT - ref_logprobs_BT).square()

    try:
        for key in ("kl_loss_type", "kl_penalty"):
            validate(Config(algorithm=AlgorithmConfig(**{key: "spmdrl_test_sq+"})))
        logp = torch.tensor([[-1.0, -0.2]], requires_grad=True)
        ref = torch.tensor([[-1.5, -0.1]])
        torch.testing.assert_close(kl_penalty(logp, ref, "spmdrl_test_sq"), torch.tensor([[0.25, 0.01]]))
        # "+": its value, k2's gradient (logp - ref).
        value = kl_penalty(logp, ref, "spmdrl_test_sq+")
        torch.testing.assert_close(value, torch.tensor([[0.25, 0.01]]))
        (g,) = torch.autograd.grad(value.sum(), logp)
        torch.testing.assert_close(g, torch.tensor([[0.5, -0.1]]))
    finally:
        KL_ESTIMATORS.unregister("spmdrl_test_sq")
    # By file path, with the straight-through suffix after it.
    (tmp_path / "my_kl.py").write_text(
        "def half_abs(logprobs_BT, ref_logprobs_BT):\n    return 0.5 * (logprobs_BT - ref_logprobs_BT).abs()\n"
    )
    validate(Config(algorithm=AlgorithmConfig(kl_loss_type=f"{tmp_path}/my_kl.py:half_abs+")))
    torch.testing.assert_close(
        kl_penalty(logp, ref, f"{tmp_path}/my_kl.py:half_abs"), torch.tensor([[0.25, 0.05]])
    )
    with pytest.raises(
        ConfigError,
        match=r"algorithm.kl_penalty='low_var_k1': unknown KL estimator\. Did you mean 'low_var_kl'",
    ):
        validate(Config(algorithm=AlgorithmConfig(kl_penalty="low_var_k1")))


@pytest.mark.parametrize("kind", ["k1+", "kl+", "abs+", "k3+", "low_var_kl+", "k2+", "mse+"])
def test_straight_through_kinds_have_k2_gradient(kind):
    logp = torch.tensor([[-1.0, -0.2, -3.0]], requires_grad=True)
    ref = torch.tensor([[-1.5, -0.1, -1.0]], requires_grad=True)
    value = kl_penalty(logp, ref, kind)
    torch.testing.assert_close(value, kl_penalty(logp, ref, kind[:-1]))
    g_logp, g_ref = torch.autograd.grad(value.sum(), (logp, ref))
    # k2 = (logp - ref)^2 / 2: d/dlogp = logp - ref, d/dref = ref - logp.
    torch.testing.assert_close(g_logp, (logp - ref).detach())
    torch.testing.assert_close(g_ref, (ref - logp).detach())


def test_k3_plus_value_is_verls_clamped_k3():
    logp = torch.tensor([[0.0]], requires_grad=True)
    ref = torch.tensor([[100.0]])
    assert kl_penalty(logp, ref, "k3+").item() == 10.0  # verl: k3 is low_var_kl, clamped to 10
    (g,) = torch.autograd.grad(kl_penalty(logp, ref, "k3+").sum(), logp)
    assert g.item() == pytest.approx(-100.0)
