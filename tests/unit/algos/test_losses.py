"""Token logprobs, entropy, sum of squared probabilities and the SFT cross-entropy (spmdrl/algos/losses.py)
against direct formulas."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from spmdrl.algos.losses import (
    entropy_from_logits,
    masked_cross_entropy,
    sum_pi_squared_from_logits,
    token_logprobs,
)


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
