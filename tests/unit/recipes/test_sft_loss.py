"""recipes/sft.py's loss runs the LM head on the response's positions only: on a real (small, random,
float64) Qwen2, one process, it equals the masked cross-entropy of the model's full logits, plain and fused
head alike, with the same gradients; prompt and padding positions change nothing. The fused head returns
float32 (the loss then rounds to it), so it is compared at float32's precision."""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from recipes.sft import forward_loss, num_target_tokens
from spmdrl.algos.losses import masked_cross_entropy
from spmdrl.data.sft import SFTBatch
from spmdrl.testing.models import SMALL_QWEN2

V = 300


def _batch() -> SFTBatch:
    g = torch.Generator().manual_seed(1)
    lengths, prompts = [14, 9, 11], [5, 3, 11]  # row 2 is all prompt: no target
    T = max(lengths)
    ids = torch.randint(1, V, (3, T), generator=g)
    attn = torch.zeros(3, T, dtype=torch.long)
    loss = torch.zeros(3, T, dtype=torch.long)
    for b, (n, p) in enumerate(zip(lengths, prompts, strict=True)):
        attn[b, :n] = 1
        loss[b, p:n] = 1
        ids[b, n:] = 0
    pos = (attn.cumsum(-1) - 1).clamp(min=0)
    return SFTBatch(ids, attn, loss, pos)


@pytest.mark.parametrize("chunk", [0, 7], ids=["plain", "fused"])
def test_loss_and_gradients_equal_the_full_logits(chunk: int) -> None:
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(**{**SMALL_QWEN2, "vocab_size": V})).double()
    batch = _batch()
    tokens = float(num_target_tokens(batch))
    assert tokens > 0

    logits = model(
        input_ids=batch.input_ids_BT,
        attention_mask=batch.attention_mask_BT,
        position_ids=batch.position_ids_BT,
    ).logits
    want, _ = masked_cross_entropy(logits, batch.input_ids_BT, batch.loss_mask_BT, num_global_tokens=tokens)
    want.backward()
    want_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()

    got = forward_loss(model, batch, tokens, chunk)
    got.backward()
    tol = {"rtol": 1e-10, "atol": 1e-12} if chunk == 0 else {"rtol": 1e-5, "atol": 1e-7}
    torch.testing.assert_close(got.double(), want.double(), **tol)
    for p, w in zip(model.parameters(), want_grads, strict=True):
        torch.testing.assert_close(p.grad, w, **tol)
