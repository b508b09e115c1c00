"""The fused, chunked LM head (spmdrl/models/fused_logprob.py) gives the plain head's logprobs, entropy,
sum of squared probabilities and gradients, and keeps chunk-sized tensors for backward, not N x V."""

from __future__ import annotations

import pytest
import torch

from spmdrl.algos.losses import entropy_from_logits, token_logprobs
from spmdrl.models.fused_logprob import fused_head

N, D, V = 37, 16, 101  # N is not a multiple of any chunk below


def _plain(h, w, b, target, temperature, softcap):
    """The unfused reference in the inputs' dtype: the (N, V) logits and their log-softmax. (The
    float32 spmdrl.algos.losses functions are compared with at the policy_forward level.)"""
    z = torch.nn.functional.linear(h, w, b)
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    if temperature > 0 and temperature != 1.0:
        z = z / temperature
    logp = torch.log_softmax(z, dim=-1)
    p = logp.exp()
    return logp.gather(-1, target[:, None])[:, 0], -(p * logp).sum(-1), (p * p).sum(-1).detach()


def _inputs(tied: bool, bias: bool, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    emb = torch.nn.Parameter(torch.randn(V, D, generator=g, dtype=torch.float64))
    w = emb if tied else torch.nn.Parameter(torch.randn(V, D, generator=g, dtype=torch.float64))
    b = torch.nn.Parameter(torch.randn(V, generator=g, dtype=torch.float64)) if bias else None
    ids = torch.randint(0, V, (N,), generator=g)
    # Tied: the hidden states come from the same table (as an embedding lookup would), so the weight's
    # gradient gets both contributions.
    h = (emb[ids] * 0.3 + torch.randn(N, D, generator=g, dtype=torch.float64)) if tied else None
    if h is None:
        h = torch.randn(N, D, generator=g, dtype=torch.float64, requires_grad=True)
    target = torch.randint(0, V, (N,), generator=g)
    return emb, w, b, h, target


@pytest.mark.parametrize(
    ("tied", "bias", "temperature", "softcap", "chunk"),
    [
        (True, False, 1.0, None, 8),
        (False, False, 0.7, None, 5),
        (False, True, 1.3, None, 64),
        (True, False, 0.6, 3.0, 10),  # Gemma 2's soft-capping
        (False, False, 0.0, None, 1000),  # greedy is scored at 1; one chunk larger than N
    ],
)
def test_fused_equals_plain_float64(tied, bias, temperature, softcap, chunk) -> None:
    results = []
    for fused in (False, True):
        emb, w, b, h, target = _inputs(tied, bias)
        if fused:
            out = fused_head(
                h, w, target, bias_V=b, temperature=temperature, softcap=softcap, chunk_tokens=chunk,
                with_entropy=True, with_sum_pi_squared=True,
            )  # fmt: skip
            lp, ent, sps = out.logprobs_N, out.entropy_N, out.sum_pi_squared_N
        else:
            lp, ent, sps = _plain(h, w, b, target, temperature, softcap)
        assert sps is not None and not sps.requires_grad
        g = torch.Generator().manual_seed(1)
        c_lp, c_ent = torch.randn(N, generator=g, dtype=lp.dtype), torch.randn(N, generator=g, dtype=lp.dtype)
        ((lp * c_lp).sum() + (ent * c_ent).sum()).backward()
        leaf_h = emb if tied else h
        grads = [leaf_h.grad, w.grad] + ([b.grad] if b is not None else [])
        results.append((lp.detach(), ent.detach(), sps, [x.clone() for x in grads]))
    (lp0, ent0, sps0, g0), (lp1, ent1, sps1, g1) = results
    assert lp1.dtype == torch.float64
    torch.testing.assert_close(lp1, lp0, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(ent1, ent0, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(sps1, sps0, rtol=1e-12, atol=1e-12)
    for a, e in zip(g1, g0, strict=True):
        torch.testing.assert_close(a, e, rtol=1e-10, atol=1e-12)


def test_entropy_without_grad_is_a_metric() -> None:
    """entropy_grad=False: the same entropy, no gradient through it, and the logprobs' gradient unchanged."""
    _, w, _, h, target = _inputs(tied=False, bias=False)
    grads = []
    for entropy_grad in (True, False):
        h.grad = w.grad = None
        out = fused_head(h, w, target, chunk_tokens=7, with_entropy=True, entropy_grad=entropy_grad)
        assert out.entropy_N is not None
        assert out.entropy_N.requires_grad is entropy_grad
        out.logprobs_N.sum().backward()
        grads.append((h.grad.clone(), w.grad.clone(), out.entropy_N.detach()))
    for a, e in zip(grads[1], grads[0], strict=True):
        torch.testing.assert_close(a, e, rtol=1e-12, atol=1e-12)


def test_float32_matches_float64() -> None:
    """float32 inputs: the chunked float32 arithmetic stays within float32 rounding of the exact values."""
    _, w, _, h, target = _inputs(tied=False, bias=False)
    exact = fused_head(h, w, target, with_entropy=True).logprobs_N
    got = fused_head(h.detach().float(), w.detach().float(), target, chunk_tokens=9).logprobs_N
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), exact.detach(), rtol=1e-5, atol=1e-5)


def _saved_numel(fn) -> int:
    """Elements of the tensors autograd keeps for backward while ``fn`` runs, parameters excluded
    (saved by reference, no new memory)."""
    total = 0
    params: set[int] = set()

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal total
        if not isinstance(t, torch.nn.Parameter) and t.untyped_storage().data_ptr() not in params:
            total += t.numel()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(params)
    return total


@pytest.mark.parametrize("with_entropy", [False, True])
def test_saved_memory_is_chunk_sized(with_entropy: bool) -> None:
    """What autograd keeps for the fused head stays below 2 x chunk x V floats however many positions;
    the plain head keeps more than N x V (the logits), so the measure tells the two apart."""
    n, d, v, chunk = 2048, 8, 512, 32
    g = torch.Generator().manual_seed(0)
    w = torch.nn.Parameter(torch.randn(v, d, generator=g))
    target = torch.randint(0, v, (n,), generator=g)

    def run(fused: bool):
        def fn(params: set[int]) -> None:
            params.add(w.untyped_storage().data_ptr())
            h = torch.randn(n, d, generator=g).requires_grad_()
            if fused:
                out = fused_head(h, w, target, chunk_tokens=chunk, with_entropy=with_entropy)
                loss = out.logprobs_N.sum() + (out.entropy_N.sum() if with_entropy else 0)
            else:
                z = torch.nn.functional.linear(h, w)[None]
                loss = token_logprobs(z, target[None]).sum()
                if with_entropy:
                    loss = loss + entropy_from_logits(z).sum()
            loss.backward()

        return fn

    fused = _saved_numel(run(True))
    plain = _saved_numel(run(False))
    assert fused < 2 * chunk * v, fused
    assert plain > n * v, plain
