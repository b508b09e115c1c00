"""KL estimators, loss aggregation and the PPO / SFT losses, against hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from spmdrl.algos.aggregation import Aggregation, count_units, masked_mean
from spmdrl.algos.kl import k3_unclamped, kl_penalty
from spmdrl.algos.losses import (
    entropy_from_logits,
    masked_cross_entropy,
    sum_pi_squared_from_logits,
    token_logprobs,
)
from spmdrl.algos.policy_losses import vanilla_policy_loss
from spmdrl.config import AlgorithmConfig

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


# ---------------------------------------------------------------------------------------------- aggregation

LOSS_BT = torch.tensor([[1.0, 2.0, 3.0, 4.0], [5.0, 6.0, 0.0, 0.0], [7.0, 7.0, 7.0, 7.0]])
MASK_BT = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [0, 0, 0, 0]])


@pytest.mark.parametrize(
    "mode, expected",
    [
        ("token-mean", (1 + 2 + 3 + 5 + 6) / 5),
        ("token-sum", 1 + 2 + 3 + 5 + 6),  # no division (verl 0.9.1's token-sum)
        ("seq-mean-token-mean", (6 / 3 + 11 / 2) / 2),  # the empty third row is left out
        ("seq-mean-token-sum", (6 + 11) / 2),
        ("seq-mean-token-sum-norm", (6 + 11) / 4 / 2),  # each sequence's sum / L=4, over 2 sequences
    ],
)
def test_aggregate_modes_by_hand(mode, expected):
    agg = Aggregation.local(mode, MASK_BT, norm_length=4.0)
    assert agg(LOSS_BT, MASK_BT).item() == pytest.approx(expected)
    # Masked entries do not leak in, even when they are NaN.
    poisoned = torch.where(MASK_BT.bool(), LOSS_BT, torch.nan)
    assert agg(poisoned, MASK_BT).item() == pytest.approx(expected)


def test_seq_mean_counts_every_row_as_verls_global_batch_size():
    # verl's trainer divides the seq-mean modes by global_batch_size, the mini-batch's rows: the third,
    # fully masked row adds 0 to the sum and 1 to the count. Its agg_loss alone counts rows with a token.
    for mode in ("seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"):
        assert count_units(MASK_BT, mode, count_empty_rows=True) == 3
        assert count_units(MASK_BT, mode) == 2
    assert count_units(MASK_BT, "token-mean", count_empty_rows=True) == 5
    agg = Aggregation(
        "seq-mean-token-mean", count_units(MASK_BT, "seq-mean-token-mean", count_empty_rows=True)
    )
    assert agg(LOSS_BT, MASK_BT).item() == pytest.approx((6 / 3 + 11 / 2) / 3)


def test_token_sum_norm_default_divisor_is_the_mask_width():
    # verl's agg_loss without loss_scale_factor divides by loss_mask.shape[-1] (4 here), not by 1.
    agg = Aggregation.local("seq-mean-token-sum-norm", MASK_BT)
    assert agg(LOSS_BT, MASK_BT).item() == pytest.approx((6 + 11) / 4 / 2)
    wide_BT = torch.nn.functional.pad(MASK_BT, (0, 4))  # the same tokens in a mask twice as wide
    assert agg(torch.nn.functional.pad(LOSS_BT, (0, 4)), wide_BT).item() == pytest.approx((6 + 11) / 8 / 2)


def test_aggregation_counts_and_argument_errors():
    assert count_units(MASK_BT, "token-mean") == 5
    assert count_units(MASK_BT, "seq-mean-token-mean") == 2
    assert count_units(MASK_BT, "seq-mean-token-sum-norm") == 2
    with pytest.raises(ValueError, match="unknown loss aggregation 'mean'"):
        Aggregation("mean", 1.0)
    with pytest.raises(ValueError, match="norm_length must be > 0"):
        Aggregation("seq-mean-token-sum-norm", 1.0, norm_length=0.0)
    # Nothing valid anywhere: loss 0, not a division by zero.
    assert Aggregation("token-mean", 0.0)(LOSS_BT, torch.zeros_like(MASK_BT)).item() == 0.0


@pytest.mark.parametrize(
    "mode",
    ["token-mean", "token-sum", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"],
)
def test_global_normalization_matches_whole_batch(mode):
    """2 ranks x 2 micro-batches, gradients summed over micro-batches and ranks (FSDP with divide
    factor 1) == the whole batch at once, with no world size anywhere in the loss."""
    gen = torch.Generator().manual_seed(0)
    x_BT = torch.randn(4, 5, generator=gen).requires_grad_()
    mask_BT = torch.tensor([[1, 1, 1, 1, 1], [1, 0, 0, 0, 0], [1, 1, 1, 0, 0], [0, 1, 1, 0, 0]])

    def per_token(x):
        return x.square() + x

    whole = Aggregation.local(mode, mask_BT, norm_length=5.0)(per_token(x_BT), mask_BT)
    (grad_whole,) = torch.autograd.grad(whole, x_BT)

    agg = Aggregation(mode, float(count_units(mask_BT, mode)), norm_length=5.0)
    rank_losses, rank_grads = [], []
    for rank in range(2):
        total = 0.0
        for row in (2 * rank, 2 * rank + 1):  # one sequence per micro-batch
            total = total + agg(per_token(x_BT[row : row + 1]), mask_BT[row : row + 1])
        rank_losses.append(total)
        rank_grads.append(torch.autograd.grad(total, x_BT)[0])
    torch.testing.assert_close(sum(rank_losses), whole)
    torch.testing.assert_close(sum(rank_grads), grad_whole)

    if mode == "token-mean":
        # Normalizing each micro-batch by its own count instead gives a different loss: the test
        # above would catch a regression to it.
        naive = (
            sum(
                Aggregation.local(mode, mask_BT[r : r + 1])(per_token(x_BT[r : r + 1]), mask_BT[r : r + 1])
                for r in range(4)
            )
            / 4
        )
        assert not torch.allclose(naive, whole)


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


def test_token_logprobs_matches_log_softmax_across_chunks():
    gen = torch.Generator().manual_seed(1)
    # T = 600 with B = 2 spans two chunks of positions.
    logits = torch.randn(2, 600, 7, generator=gen, requires_grad=True)
    targets = torch.randint(0, 7, (2, 600), generator=gen)
    ours = token_logprobs(logits, targets)
    ref = logits.log_softmax(-1).gather(-1, targets[..., None]).squeeze(-1)
    torch.testing.assert_close(ours, ref)
    (g_ours,) = torch.autograd.grad(ours.sum(), logits)
    (g_ref,) = torch.autograd.grad(ref.sum(), logits)
    torch.testing.assert_close(g_ours, g_ref)
    bf16 = logits.detach().bfloat16()
    out = token_logprobs(bf16, targets)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, bf16.float().log_softmax(-1).gather(-1, targets[..., None]).squeeze(-1))


def test_entropy_matches_direct_formula_and_is_stable():
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(3, 4, 9, generator=gen)
    p = logits.softmax(-1)
    torch.testing.assert_close(entropy_from_logits(logits), -(p * p.log()).sum(-1))
    assert entropy_from_logits(torch.zeros(1, 1, 9)).item() == pytest.approx(math.log(9))
    # A probability that underflows to 0 makes -sum(p log p) NaN (0 * -inf); ours stays finite.
    extreme = torch.tensor([[[1000.0, 0.0, -1000.0]]])
    assert entropy_from_logits(extreme).item() == pytest.approx(0.0, abs=1e-6)


def test_sum_pi_squared_matches_direct_formula_and_is_stable():
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(2, 5, 11, generator=gen)
    torch.testing.assert_close(sum_pi_squared_from_logits(logits), logits.softmax(-1).square().sum(-1))
    assert sum_pi_squared_from_logits(torch.zeros(1, 1, 8)).item() == pytest.approx(1 / 8)  # uniform
    # A near one-hot distribution: sum pi^2 -> 1, with no overflow from exp(2 z).
    assert sum_pi_squared_from_logits(torch.tensor([[[1000.0, 0.0, -1000.0]]])).item() == pytest.approx(1.0)


def test_masked_mean_empty_is_zero():
    assert masked_mean(torch.tensor([1.0, torch.nan]), torch.tensor([0, 0])).item() == 0.0
    assert masked_mean(torch.tensor([1.0, 3.0, 100.0]), torch.tensor([1, 1, 0])).item() == 2.0


def test_masked_cross_entropy_matches_torch_on_unmasked_positions():
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(2, 6, 11, generator=gen)
    ids = torch.randint(0, 11, (2, 6), generator=gen)
    loss_mask = torch.tensor([[0, 0, 1, 1, 1, 0], [0, 1, 1, 0, 1, 1]])
    n_global = int(loss_mask[:, 1:].sum())
    loss, n_local = masked_cross_entropy(logits, ids, loss_mask, num_global_tokens=n_global)
    # logits[:, t] predicts ids[:, t + 1], counted where loss_mask[:, t + 1] == 1.
    valid = loss_mask[:, 1:].bool()
    expected = F.cross_entropy(logits[:, :-1][valid], ids[:, 1:][valid])
    assert n_local == 7
    torch.testing.assert_close(loss, expected)

    # Two micro-batches (one row each) divided by the global count sum to the whole-batch mean.
    parts = [
        masked_cross_entropy(
            logits[r : r + 1], ids[r : r + 1], loss_mask[r : r + 1], num_global_tokens=n_global
        )
        for r in range(2)
    ]
    torch.testing.assert_close(parts[0][0] + parts[1][0], expected)
    assert parts[0][1] + parts[1][1] == n_global
