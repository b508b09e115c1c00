"""The policy update keeps no entropy graph when the entropy is only a metric (entropy_coeff=0).

The recipe's own per-micro-batch loss (spmdrl/rl/update.py's micro_batch_loss), one process, CPU, on a
small Qwen2 with a 4096-token vocabulary so that a B x T x V float32 tensor dominates what autograd
saves. Saved bytes are counted with a saved-tensors pack hook, once per storage.
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from spmdrl.algos.aggregation import Aggregation
from spmdrl.algos.losses import entropy_from_logits
from spmdrl.config import AlgorithmConfig, Config
from spmdrl.models.forward import policy_logprobs
from spmdrl.rl.batch import PolicyBatch
from spmdrl.rl.settings import update_settings
from spmdrl.rl.update import MicroBatchLoss, micro_batch_loss
from spmdrl.testing.models import SMALL_QWEN2

B, T, V = 2, 48, 4096
# The entropy's graph: the float32 softmax of the T - 1 predicting positions.
# The entropy's graph covers the positions that predict response tokens (the prompt's logits are never
# computed): columns T // 4 .. T - 1 of _batch().
ENTROPY_GRAPH_BYTES = B * (T - T // 4) * V * 4


@pytest.fixture(scope="module")
def model() -> Qwen2ForCausalLM:
    torch.manual_seed(0)
    return Qwen2ForCausalLM(Qwen2Config(**{**SMALL_QWEN2, "vocab_size": V})).float()


def _batch() -> PolicyBatch:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, V, (B, T), generator=g)
    attn = torch.ones(B, T, dtype=torch.long)
    attn[1, -6:] = 0  # a shorter second row: padding the loss must ignore
    resp = attn.bool().clone()
    resp[:, : T // 4] = False  # the prompt
    ref = -torch.rand(B, T, generator=g)
    adv_BT = torch.tensor([1.0, -1.0])[:, None] * resp
    return PolicyBatch(ids, attn, resp, ref.clone(), adv_BT, ref_logprobs_BT=ref)


def _cfg(entropy_coeff: float, temperature: float) -> Config:
    cfg = Config(algorithm=AlgorithmConfig(entropy_coeff=entropy_coeff, use_kl_loss=True))
    return dataclasses.replace(cfg, rollout=dataclasses.replace(cfg.rollout, temperature=temperature))


def _agg(mb: PolicyBatch) -> Aggregation:
    return Aggregation.local("token-mean", mb.response_mask_BT)


@contextmanager
def _saved_bytes() -> Iterator[dict[int, int]]:
    """Bytes of every storage autograd saves for the backward inside the block, keyed by address."""
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        s = t.untyped_storage()
        seen[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield seen


def _run(model: torch.nn.Module, cfg: Config, mb: PolicyBatch) -> tuple[MicroBatchLoss, int]:
    """The recipe's micro-batch loss (on-policy: old = current) and the bytes its graph saves.

    Every saved storage stays alive while ``out.loss`` does, so no address in the count is reused.
    """
    with _saved_bytes() as seen:
        out = micro_batch_loss(update_settings(cfg), model, mb, _agg(mb))
    return out, sum(seen.values())


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_entropy_metric_keeps_no_graph(model: torch.nn.Module, temperature: float) -> None:
    mb = _batch()
    with _saved_bytes() as seen:  # the same forward with no entropy at all
        lp_BT, _ = policy_logprobs(model, mb.input_ids_BT, mb.attention_mask_BT, temperature=temperature)
    no_entropy = sum(seen.values())
    out0, metric_only = _run(model, _cfg(0.0, temperature), mb)
    out1, in_loss = _run(model, _cfg(0.01, temperature), mb)
    print(
        f"T={temperature}: saved bytes: no entropy {no_entropy}, coeff 0 {metric_only}, "
        f"coeff 0.01 {in_loss}; B*(T-1)*V*4 = {ENTROPY_GRAPH_BYTES}"
    )
    # The surrogate / KL / aggregation keep only a few B x T tensors on top of the forward's.
    assert metric_only - no_entropy < ENTROPY_GRAPH_BYTES // 16
    assert in_loss - metric_only >= ENTROPY_GRAPH_BYTES
    # The logged metric does not depend on whether the entropy had a gradient.
    assert float(out0.stats["entropy"]) == float(out1.stats["entropy"])
    assert float(out0.stats["pg_loss"]) == float(out1.stats["pg_loss"])
    assert 0 < float(out0.stats["entropy"]) < torch.log(torch.tensor(float(V)))
    # On the sampled tokens, the same logprobs as the full forward (the prompt's columns are not computed).
    resp = mb.response_mask_BT
    torch.testing.assert_close(out0.logprobs_BT * resp, lp_BT.detach() * resp, rtol=0, atol=0)
    assert not out0.logprobs_BT[:, : T // 4].any()


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_entropy_bonus_gets_its_gradient(model: torch.nn.Module, temperature: float) -> None:
    """d loss / d logits moves by exactly -coeff * d entropy / d logits when the bonus is on.

    The LM head runs only on the positions that predict a scored token (spmdrl.models.head): its output
    is (N, V), row n the n-th of those positions in row-major order. Without a plan every row is scored
    from the batch's first response column to T."""
    mb, coeff = _batch(), 0.5
    captured: list[torch.Tensor] = []

    def keep_logits(_m: torch.nn.Module, _args: object, output: torch.Tensor) -> None:
        if output.numel():  # the model's own head call gets an empty index (logits_to_keep): skip it
            output.retain_grad()
            captured.append(output)

    grads = []
    handle = model.get_output_embeddings().register_forward_hook(keep_logits)
    try:
        for c in (0.0, coeff):
            out = micro_batch_loss(update_settings(_cfg(c, temperature)), model, mb, _agg(mb))
            out.loss.backward()
            assert len(captured) == 1, "the head ran once on the scored positions"
            grads.append(captured.pop().grad)
    finally:
        handle.remove()
        model.zero_grad(set_to_none=True)
    # The entropy term alone, from its definition, on the full logits of the same model.
    with torch.no_grad():
        z_BTV = model(input_ids=mb.input_ids_BT, attention_mask=mb.attention_mask_BT).logits
    z_BTV.requires_grad_()
    ent_BT = torch.zeros(B, T)
    ent_BT[:, 1:] = entropy_from_logits(z_BTV[:, :-1] / temperature)
    ent = _agg(mb)(ent_BT, mb.response_mask_BT)
    (d_ent,) = torch.autograd.grad(ent, z_BTV)
    assert d_ent.abs().max() > 0
    first = mb.first_response_column()
    assert not d_ent[:, : first - 1].any()  # the prompt's positions: no entropy gradient either way
    # The head's rows: the positions first - 1 .. T - 2 of each row, which predict columns first .. T - 1.
    d_ent_NV = d_ent[:, first - 1 : T - 1].reshape(-1, V)
    assert grads[0].shape == d_ent_NV.shape
    torch.testing.assert_close(grads[1] - grads[0], -coeff * d_ent_NV, rtol=1e-4, atol=1e-7)


def test_graph_is_freed_by_backward(model: torch.nn.Module) -> None:
    """After backward nothing B x T x V survives, though the returned MicroBatchLoss is still held."""
    mb = _batch()
    big: list[weakref.ref[torch.Tensor]] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.dim() == 3 and t.shape[-1] == V:
            big.append(weakref.ref(t))
        return t

    for coeff in (0.0, 0.01):
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = micro_batch_loss(update_settings(_cfg(coeff, 1.0)), model, mb, _agg(mb))
        assert any(r() is not None for r in big), "the logprobs' graph saves B x T x V tensors"
        out.loss.backward()
        assert all(r() is None for r in big), f"coeff {coeff}: a B x T x V tensor outlived the backward"
        big.clear()
    model.zero_grad(set_to_none=True)
