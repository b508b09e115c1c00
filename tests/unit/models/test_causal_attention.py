"""Causal SDPA for the RL models (spmdrl.models.causal_attention): the same logprobs as the masked path,
nothing read from the device, and a 2-D mask that keeps its meaning.

A real tiny Qwen2 (transformers' SDPA attention) scores right-padded rows three ways: switched to causal
SDPA with no mask, with transformers' own SDPA and the 4-D mask spmdrl built before, and each row alone
without padding. spmdrl.testing.syncs.SyncCounter counts what a GPU would wait for: transformers' SDPA
path reads the position ids once per forward to look for packed sequences (``find_packed_sequence_indices``),
the switched model reads nothing.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from spmdrl.models.causal_attention import CAUSAL_SDPA, use_causal_sdpa, uses_causal_sdpa
from spmdrl.models.forward import attention_mask_for, policy_forward
from spmdrl.testing.models import padded_rows, save_small_qwen2
from spmdrl.testing.syncs import SyncCounter


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("causal") / "m"
    save_small_qwen2(path)
    return path


def _load(path: Path, *, causal: bool) -> torch.nn.Module:
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa")
    model.config.use_cache = False
    if causal:
        assert use_causal_sdpa(model)
    return model.eval()


def _rows(seed: int) -> tuple[torch.Tensor, torch.Tensor, list[int], list[int]]:
    g = torch.Generator().manual_seed(seed)
    prompt_B, resp_B = torch.randint(2, 6, (6,), generator=g), torch.randint(1, 9, (6,), generator=g)
    ids, attn, _ = padded_rows(prompt_B, resp_B, 64, g)
    return ids, attn, [int(n) for n in attn.sum(1)], [int(p) for p in prompt_B]


def _logprobs(
    model: torch.nn.Module, ids: torch.Tensor, attn: torch.Tensor, lengths: list[int], firsts: list[int]
):
    with torch.no_grad():
        return policy_forward(
            model, ids, attn, lengths_B=lengths, first_columns_B=firsts, with_entropy=True, entropy_grad=False
        )


def test_padded_rows_score_as_with_the_mask_and_alone(model_dir: Path) -> None:
    ids, attn, lengths, firsts = _rows(0)
    assert len(set(lengths)) > 1, "the rows must be padded for this test to mean anything"
    causal, masked = _load(model_dir, causal=True), _load(model_dir, causal=False)
    assert attention_mask_for(causal, attn, lengths) is None
    assert attention_mask_for(masked, attn, lengths).dim() == 4  # the path it is compared with
    got, ref = _logprobs(causal, ids, attn, lengths, firsts), _logprobs(masked, ids, attn, lengths, firsts)
    torch.testing.assert_close(got.logprobs_BT, ref.logprobs_BT, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got.entropy_BT, ref.entropy_BT, rtol=1e-5, atol=1e-6)
    assert got.logprobs_BT.abs().sum() > 0
    for b, n in enumerate(lengths):  # each row alone, with no padding at all
        alone = _logprobs(causal, ids[b : b + 1, :n], attn[b : b + 1, :n], [n], [firsts[b]])
        torch.testing.assert_close(got.logprobs_BT[b, :n], alone.logprobs_BT[0], rtol=1e-5, atol=1e-6)
        assert (got.logprobs_BT[b, n:] == 0).all()


def test_nothing_is_read_from_the_device(model_dir: Path) -> None:
    ids, attn, _, firsts = _rows(1)
    T = ids.shape[1]
    full = [T] * ids.shape[0]  # no padding: transformers' SDPA path looks for packed sequences
    ones = torch.ones_like(attn)
    counts = {}
    for causal in (True, False):
        model = _load(model_dir, causal=causal)
        with SyncCounter() as c:
            _logprobs(model, ids, ones, full, firsts)
        counts[causal] = (c.count(), c.summary())
    assert counts[False][0] >= 1, (
        f"the baseline no longer syncs; this test checks nothing:\n{counts[False][1]}"
    )
    assert counts[True][0] == 0, f"the causal-SDPA forward read the device:\n{counts[True][1]}"


def test_a_2d_mask_keeps_its_meaning(model_dir: Path) -> None:
    """A caller that passes transformers a 2-D mask (here left padding, the side causal attention alone
    would get wrong) gets the same logits at real positions, and no NaN at padded ones."""
    ids, attn, lengths, _ = _rows(2)
    T = ids.shape[1]
    left_ids = torch.stack([torch.roll(ids[b], T - n) for b, n in enumerate(lengths)])
    left_attn = torch.stack([torch.roll(attn[b], T - n) for b, n in enumerate(lengths)])
    causal, masked = _load(model_dir, causal=True), _load(model_dir, causal=False)
    with torch.no_grad():
        got = causal(input_ids=left_ids, attention_mask=left_attn).logits
        ref = masked(input_ids=left_ids, attention_mask=left_attn).logits
    assert torch.isfinite(got).all()
    real = left_attn.bool()
    torch.testing.assert_close(got[real], ref[real], rtol=1e-5, atol=1e-5)


def test_generation_is_refused(model_dir: Path) -> None:
    model = _load(model_dir, causal=True)
    with pytest.raises(ValueError, match="use_cache=False"):
        model(input_ids=torch.tensor([[3, 4, 5]]), use_cache=True)


def test_sliding_window_models_keep_transformers_masks(tmp_path: Path) -> None:
    save_small_qwen2(tmp_path / "m", use_sliding_window=True, sliding_window=4, max_window_layers=0)
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "m", attn_implementation="sdpa")
    assert "sliding_attention" in model.config.layer_types
    assert not use_causal_sdpa(model)
    assert not uses_causal_sdpa(model)
    assert model.config._attn_implementation == "sdpa" != CAUSAL_SDPA
