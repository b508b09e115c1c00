"""Packed sequences (spmdrl/models/packing.py; padding removed) give the padded computation's logprobs,
entropies and gradients."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from spmdrl.models.packing import first_fit_decreasing, pack


def test_first_fit_decreasing_fills_rows() -> None:
    bins = first_fit_decreasing([5, 3, 8, 2, 6, 1], capacity=8)
    assert sorted(i for b in bins for i in b) == list(range(6))
    lengths = [5, 3, 8, 2, 6, 1]
    assert all(sum(lengths[i] for i in b) <= 8 for b in bins)
    assert len(bins) == 4  # 25 tokens need at least 4 rows of 8


def test_pack_round_trip_and_positions() -> None:
    ids = torch.tensor([[5, 6, 7, 0, 0], [8, 9, 0, 0, 0], [1, 2, 3, 4, 5]])
    attn = (ids > 0).long()
    p = pack(ids, attn, pad_id=0)
    assert p.input_ids_RC.shape == (2, 5)  # 10 tokens in 2 rows of 5
    # Every sequence's positions restart at 0; the round trip puts every token back.
    assert torch.equal(p.unpack(p.input_ids_RC.float()).long(), ids * attn)
    assert torch.equal(p.position_ids_RC[0], torch.arange(5))
    assert p.position_ids_RC[1].tolist() == [0, 1, 2, 0, 1]
    with pytest.raises(ValueError, match="does not fit"):
        pack(ids, attn, capacity=4)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from spmdrl.models.tiny import ensure_tiny_model

    return ensure_tiny_model(tmp_path_factory.mktemp("tiny"))


def test_packed_equals_padded(model_dir: Path) -> None:
    from transformers import AutoModelForCausalLM

    from spmdrl.models.forward import policy_logprobs

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    lengths = [17, 5, 30, 9, 2, 24, 11, 30]
    T = max(lengths)
    ids = torch.randint(3, 120, (len(lengths), T))
    attn = (torch.arange(T) < torch.tensor(lengths)[:, None]).long()
    ids = ids * attn
    grads = []
    outs = []
    for packed in (False, True):
        model.zero_grad()
        lp, ent = policy_logprobs(model, ids, attn, temperature=0.7, with_entropy=True, pack_sequences=packed)
        assert ent is not None
        ((lp * attn).sum() + (ent * attn).sum() * 0.1).backward()
        outs.append((lp * attn, ent * attn))
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    (lp0, e0), (lp1, e1) = outs
    torch.testing.assert_close(lp1, lp0, atol=2e-5, rtol=0)
    torch.testing.assert_close(e1, e0, atol=2e-5, rtol=0)
    assert float(lp0[:, 1:].abs().sum()) > 0 and int((lp1[:, 0] != 0).sum()) == 0
    for n, g in grads[0].items():
        torch.testing.assert_close(grads[1][n], g, atol=1e-4, rtol=1e-4, msg=n)


def test_sum_pi_squared_packed_equals_padded_and_the_softmax(model_dir: Path) -> None:
    from transformers import AutoModelForCausalLM

    from spmdrl.models.forward import policy_forward

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    lengths = [9, 4, 12]
    T = max(lengths)
    attn = (torch.arange(T) < torch.tensor(lengths)[:, None]).long()
    ids = torch.randint(3, 120, (3, T)) * attn
    padded, packed = (
        policy_forward(model, ids, attn, temperature=0.7, with_sum_pi_squared=True, pack_sequences=p)
        for p in (False, True)
    )
    assert padded.sum_pi_squared_BT is not None and packed.sum_pi_squared_BT is not None
    torch.testing.assert_close(
        packed.sum_pi_squared_BT * attn, padded.sum_pi_squared_BT * attn, atol=2e-6, rtol=0
    )
    with torch.no_grad():  # the distribution that predicted token t, at temperature 0.7
        probs_BTV = (model(input_ids=ids, attention_mask=attn).logits / 0.7).softmax(-1)
    direct_BT = torch.zeros(3, T)
    direct_BT[:, 1:] = probs_BTV[:, :-1].square().sum(-1)
    torch.testing.assert_close(padded.sum_pi_squared_BT, direct_BT, atol=1e-6, rtol=1e-5)
