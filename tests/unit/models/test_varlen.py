"""Varlen attention for packed rows (spmdrl/models/varlen.py): logprobs and gradients equal each sequence
run alone, for every supported family (GQA in all: 2 query heads, 1 key/value head; Mistral's sliding
window, Gemma 2's soft-capping and alternating windows, Gemma 3's scaling), and equal the mask path's.

On CPU the varlen path runs the exact reference (causal SDPA per segment) and flex attention, which
both run here. torch's varlen_attn and flash_attn are CUDA kernels that cannot run on this machine: the
kernel selection is tested as a pure function of the capabilities instead (Capabilities built by hand).
"""

from __future__ import annotations

import copy

import pytest
import torch
import transformers
from torch import nn

from spmdrl.config import ConfigError, validate
from spmdrl.models.forward import policy_logprobs
from spmdrl.models.packing import pack
from spmdrl.models.varlen import (
    VARLEN,
    Capabilities,
    Features,
    apply_packed_attention,
    choose_kernel,
    flex_varlen,
    reference_varlen,
)
from spmdrl.testing.models import _SMALL_DECODER, FAMILY_SPECS, SLIDING_WINDOW
from spmdrl.testing.syncs import SyncCounter

CPU, F32 = torch.device("cpu"), torch.float32
# Longer than the families' sliding window (32), so windowed layers differ from full attention; packed
# at capacity 40 they share rows (40 | 33+7 | 25+13 | 18+3 ...).
LENGTHS = [40, 7, 25, 13, 3, 40, 18, 33]
# float32 throughout: what is compared differs only by summation order. Gradients: within 1e-5 of each
# tensor's largest entry (the embedding's reach about 25; measured differences about 2e-5 there).
ATOL_LOGPROB, ATOL_GRAD = 1e-5, 1e-5


def _family_model(family: str) -> nn.Module:
    """``family``'s small random model (spmdrl.testing.models) with a 256-token vocabulary, attending with
    transformers' eager attention (exact, with the family's window and soft-capping)."""
    spec = FAMILY_SPECS[family]
    config = getattr(transformers, spec.config_class)(
        vocab_size=256, **_SMALL_DECODER, **spec.config, attn_implementation="eager"
    )
    torch.manual_seed(0)
    return getattr(transformers, spec.model_class)(config).to(F32)


def _rows() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    T = max(LENGTHS)
    attn = (torch.arange(T) < torch.tensor(LENGTHS)[:, None]).long()
    return torch.randint(3, 256, (len(LENGTHS), T), generator=g) * attn, attn


def _loss_and_grads(model: nn.Module, run) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:  # noqa: ANN001
    model.zero_grad()
    lp_BT, ent_BT = run(model)
    (lp_BT.sum() + 0.1 * ent_BT.sum()).backward()
    return lp_BT.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _per_sequence(model: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """Each sequence alone, unpadded: the reference."""
    ids, attn = _rows()
    lp, ent = torch.zeros(ids.shape), torch.zeros(ids.shape)
    for i, n in enumerate(LENGTHS):
        one = ids[i : i + 1, :n]
        lp_i, ent_i = policy_logprobs(model, one, torch.ones_like(one), temperature=0.7, with_entropy=True)
        lp = lp.index_put((torch.tensor([i]), torch.arange(n)), lp_i[0])
        ent = ent.index_put((torch.tensor([i]), torch.arange(n)), ent_i[0])
    return lp, ent


def _packed(model: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    ids, attn = _rows()
    lp, ent = policy_logprobs(
        model, ids, attn, temperature=0.7, with_entropy=True, pack_sequences=True, lengths_B=LENGTHS
    )
    assert ent is not None
    return lp * attn, ent * attn


@pytest.mark.parametrize("family", ["qwen2", "llama3", "mistral", "gemma2", "gemma3"])
def test_varlen_equals_each_sequence_alone_and_the_mask_path(family: str) -> None:
    model = _family_model(family)
    assert model.config.num_key_value_heads < model.config.num_attention_heads  # GQA
    assert max(LENGTHS) > SLIDING_WINDOW  # the windowed families' windows bind
    varlen = copy.deepcopy(model)
    choice = apply_packed_attention(varlen, "varlen", packed=True, device=CPU, dtype=F32)
    assert choice.kernel == "reference" and varlen.config._attn_implementation == VARLEN
    ref_lp, ref_grads = _loss_and_grads(model, _per_sequence)
    mask_lp, mask_grads = _loss_and_grads(model, _packed)  # the existing path: eager, transformers' mask
    lp, grads = _loss_and_grads(varlen, _packed)
    assert lp.abs().sum() > 0
    torch.testing.assert_close(lp, ref_lp, atol=ATOL_LOGPROB, rtol=0)
    torch.testing.assert_close(lp, mask_lp, atol=ATOL_LOGPROB, rtol=0)
    assert grads.keys() == ref_grads.keys()
    for name, g in grads.items():
        atol = ATOL_GRAD * max(1.0, ref_grads[name].abs().max().item())
        torch.testing.assert_close(g, ref_grads[name], atol=atol, rtol=0, msg=name)
        torch.testing.assert_close(g, mask_grads[name], atol=atol, rtol=0, msg=name)


def test_varlen_passes_no_mask_and_reads_nothing_more_than_the_mask_path() -> None:
    """The packed forward builds no (R, 1, C, C) mask for a varlen model, and syncs no more than the
    mask path (spmdrl.testing.syncs counts the reads a GPU would wait on)."""
    model = _family_model("qwen2")
    model.set_attn_implementation("sdpa")  # the mask path's SDPA, with its block-diagonal mask
    varlen = copy.deepcopy(model)
    apply_packed_attention(varlen, "varlen", packed=True, device=CPU, dtype=F32)
    masks: list[object] = []
    hook = varlen.model.layers[0].self_attn.register_forward_pre_hook(
        lambda mod, args, kwargs: masks.append(kwargs.get("attention_mask")), with_kwargs=True
    )
    ids, attn = _rows()
    counts = []
    for m in (model, varlen):
        with torch.no_grad(), SyncCounter() as c:
            policy_logprobs(m, ids, attn, pack_sequences=True, lengths_B=LENGTHS)
        counts.append(c.count())
    hook.remove()
    assert masks == [None]
    assert counts[1] <= counts[0], counts


def test_pack_gives_segment_boundaries() -> None:
    ids = torch.tensor([[5, 6, 7, 0, 0], [8, 9, 0, 0, 0], [1, 2, 3, 4, 5]])
    p = pack(ids, (ids > 0).long(), lengths_B=[3, 2, 5])
    # Row 0: the 5-token sequence; row 1: 3 + 2 tokens, no tail. Every segment of the rows, on both sides.
    assert p.cu_seqlens_host == (0, 5, 8, 10)
    assert p.cu_seqlens_S1.dtype == torch.int32 and p.cu_seqlens_S1.tolist() == list(p.cu_seqlens_host)
    assert p.max_seqlen == 5
    tail = pack(ids[:2], (ids[:2] > 0).long(), lengths_B=[3, 2], capacity=4)
    assert tail.cu_seqlens_host == (0, 4, 8)  # each row's tail in its (last) sequence's segment
    assert tail.max_seqlen == 4


@pytest.mark.parametrize(("window", "softcap"), [(None, None), (16, None), (None, 5.0), (16, 5.0)])
def test_flex_and_reference_kernels_agree(window: int | None, softcap: float | None) -> None:
    """flex attention (the CUDA fallback, which also runs here) equals the reference, and the window and
    soft-capping change the result (so both kernels apply them)."""
    torch.manual_seed(0)
    cu = [0, 5, 40, 47, 64, 100, 128]
    q, k, v = torch.randn(128, 4, 32), torch.randn(128, 2, 32), torch.randn(128, 2, 32)  # GQA 4 / 2
    ref = reference_varlen(q, k, v, cu, 0.2, window, softcap)
    flex = flex_varlen(q, k, v, torch.tensor(cu, dtype=torch.int32), 0.2, window, softcap)
    torch.testing.assert_close(flex, ref, atol=1e-5, rtol=1e-5)
    if window or softcap:
        assert not torch.allclose(ref, reference_varlen(q, k, v, cu, 0.2, None, None), atol=1e-3)


CUDA_ALL = Capabilities("cuda", torch_varlen=True, torch_varlen_window=True, flash_attn=True, flex=True)


@pytest.mark.parametrize(
    ("setting", "caps", "features", "kernel"),
    [
        ("auto", CUDA_ALL, Features(), "torch_varlen"),
        ("varlen", CUDA_ALL, Features(sliding_window=True), "torch_varlen"),
        # torch 2.11's varlen_attn: no window_size, so a windowed model goes on to flash_attn.
        (
            "auto",
            Capabilities("cuda", torch_varlen=True, flash_attn=True),
            Features(sliding_window=True),
            "flash_attn",
        ),
        ("auto", Capabilities("cuda", torch_varlen=True, flex=True), Features(sliding_window=True), "flex"),
        # Soft-capping (Gemma 2): flash_attn where its signature takes softcap, else flex.
        ("auto", CUDA_ALL, Features(softcap=True), "flex"),
        (
            "auto",
            Capabilities("cuda", flash_attn=True, flash_attn_softcap=True),
            Features(softcap=True),
            "flash_attn",
        ),
        # float32 compute: the flash kernels refuse it, flex takes it.
        ("auto", CUDA_ALL, Features(half_precision=False), "flex"),
        ("auto", Capabilities("cuda", torch_varlen=True), Features(half_precision=False), "mask"),
        ("auto", Capabilities("cuda"), Features(), "mask"),
        ("auto", CUDA_ALL, Features(dropout=True), "mask"),
        ("mask", CUDA_ALL, Features(), "mask"),
        ("auto", Capabilities("cpu"), Features(), "mask"),
        ("varlen", Capabilities("cpu"), Features(softcap=True, sliding_window=True), "reference"),
    ],
)
def test_choose_kernel(setting: str, caps: Capabilities, features: Features, kernel: str) -> None:
    assert choose_kernel(setting, True, caps, features).kernel == kernel
    assert choose_kernel(setting, False, caps, features).kernel == "mask"  # unpacked rows keep their mask


def test_auto_on_cpu_keeps_the_model_on_the_mask_path() -> None:
    model = _family_model("qwen2")
    assert apply_packed_attention(model, "auto", packed=True, device=CPU, dtype=F32).kernel == "mask"
    assert model.config._attn_implementation == "eager"


def test_varlen_without_packing_is_refused() -> None:
    from spmdrl.config import Config, TrainerConfig

    with pytest.raises(ConfigError, match="trainer.pack_sequences=true"):
        validate(Config(trainer=TrainerConfig(packed_attention="varlen")))
    validate(Config(trainer=TrainerConfig(packed_attention="varlen", pack_sequences=True)))


def test_torch_varlen_arguments_for_an_older_signature(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch's varlen_attn is a CUDA kernel: a fake with the older signature (no window_size, scale or
    enable_gqa; is_causal) stands in for it, computing with the reference, so what is tested is how
    _torch_varlen adapts its arguments: causal, the scale folded into the queries, the KV heads repeated."""
    import torch.nn.attention.varlen as tv

    from spmdrl.models.varlen import _torch_varlen

    def old_varlen_attn(
        query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, is_causal=False, return_aux=None
    ):  # noqa: ANN001, ANN202
        assert is_causal and key.shape[1] == query.shape[1]  # this signature has no GQA
        return reference_varlen(query, key, value, cu_seq_q.tolist(), query.shape[-1] ** -0.5, None, None)

    monkeypatch.setattr(tv, "varlen_attn", old_varlen_attn)
    torch.manual_seed(0)
    cu = [0, 5, 40, 64]
    q, k, v = torch.randn(64, 4, 32), torch.randn(64, 2, 32), torch.randn(64, 2, 32)
    out = _torch_varlen(q, k, v, torch.tensor(cu, dtype=torch.int32), 35, 0.3, None)
    torch.testing.assert_close(out, reference_varlen(q, k, v, cu, 0.3, None, None), atol=1e-5, rtol=1e-5)
