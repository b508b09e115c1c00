"""policy_forward's LM head on response positions only (spmdrl/models/head.py), plain and fused.

On real (small, random) transformers models, one process: the gathered positions give the values of the
full-logits forward (the model's own logits over every column, then spmdrl.algos.losses) at every scored
token and 0 elsewhere; fused equals plain, padded and packed, tied and untied heads, with Gemma 2's
logit soft-capping; gradients reach the hidden states and the head weight alike. The 2-process FSDP2
test is tests/integration/test_fused_head_fsdp.py.
"""

from __future__ import annotations

import pytest
import torch
from transformers import Gemma2Config, Gemma2ForCausalLM, Qwen2Config, Qwen2ForCausalLM

from spmdrl.algos.losses import entropy_from_logits, sum_pi_squared_from_logits, token_logprobs
from spmdrl.config import FUSED_AUTO_MIN_VOCAB, ConfigError, ModelConfig, validate
from spmdrl.models.forward import policy_forward, scored_positions
from spmdrl.testing.models import SMALL_QWEN2

V = 512
LENGTHS = [17, 9, 30, 4, 23]
FIRSTS = [6, 3, 12, 30, 5]  # row 3 has no sampled token (its first column is the batch's width)
TEMPERATURE = 0.7


def _qwen2(tied: bool) -> torch.nn.Module:
    torch.manual_seed(0)
    return Qwen2ForCausalLM(
        Qwen2Config(**{**SMALL_QWEN2, "vocab_size": V, "tie_word_embeddings": tied})
    ).double()


def _gemma2() -> torch.nn.Module:
    torch.manual_seed(0)
    config = Gemma2Config(
        vocab_size=V,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        query_pre_attn_scalar=32,
        layer_types=["full_attention", "full_attention"],
        final_logit_softcapping=3.0,  # small, so that the cap bends these random logits
        attn_logit_softcapping=None,
        max_position_embeddings=64,
    )
    return Gemma2ForCausalLM(config).double()


MODELS = {"qwen2_tied": lambda: _qwen2(True), "qwen2_untied": lambda: _qwen2(False), "gemma2": _gemma2}


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    T = max(LENGTHS)
    attn = (torch.arange(T) < torch.tensor(LENGTHS)[:, None]).long()
    return torch.randint(1, V, (len(LENGTHS), T), generator=g) * attn, attn


def _full_logits_reference(model: torch.nn.Module, ids: torch.Tensor, attn: torch.Tensor):
    """The old way: the model's own logits at every column, then the losses, kept at the scored tokens."""
    z = model(input_ids=ids, attention_mask=attn).logits / TEMPERATURE
    B, T = ids.shape
    scored = torch.zeros(B * T, dtype=torch.bool)
    scored[scored_positions(T, LENGTHS, FIRSTS)] = True
    scored = scored.view(B, T)
    out = []
    for f in (lambda x: token_logprobs(x, ids[:, 1:]), entropy_from_logits, sum_pi_squared_from_logits):
        full = torch.zeros(B, T)
        full[:, 1:] = f(z[:, :-1])
        out.append(torch.where(scored, full, 0.0))
    return out, scored


def _forward(model, ids, attn, *, chunk: int, packed: bool):
    return policy_forward(
        model,
        ids,
        attn,
        temperature=TEMPERATURE,
        with_entropy=True,
        with_sum_pi_squared=True,
        pack_sequences=packed,
        first_column=min(FIRSTS),
        lengths_B=LENGTHS,
        first_columns_B=FIRSTS,
        fused_chunk_tokens=chunk,
    )


def test_scored_positions() -> None:
    # Row 0: columns 2..3 of 4; row 1: from column 1 (column 0 has no prediction) to its length 3.
    assert scored_positions(4, [4, 3, 2], [2, 0, 5]) == [2, 3, 5, 6]


@pytest.mark.parametrize("name", sorted(MODELS))
@pytest.mark.parametrize("packed", [False, True])
def test_gathered_head_equals_full_logits(name: str, packed: bool) -> None:
    """Plain and fused heads on the gathered positions give the full-logits values (float64 model:
    float32 tolerances) at the scored tokens, and exactly 0 at the prompt, the padding and row 3."""
    model = MODELS[name]()
    ids, attn = _batch()
    with torch.no_grad():
        (lp_ref, ent_ref, sps_ref), scored = _full_logits_reference(model, ids, attn)
        for chunk in (0, 7):
            out = _forward(model, ids, attn, chunk=chunk, packed=packed)
            for got, ref in (
                (out.logprobs_BT, lp_ref),
                (out.entropy_BT, ent_ref),
                (out.sum_pi_squared_BT, sps_ref),
            ):
                assert got is not None
                torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)
                assert not got[~scored].any()
    assert scored.sum() == sum(max(0, n - max(1, f)) for n, f in zip(LENGTHS, FIRSTS, strict=True))


@pytest.mark.parametrize("chunk", [0, 5])
@pytest.mark.parametrize("packed", [False, True])
def test_nothing_to_score_still_backpropagates(chunk: int, packed: bool) -> None:
    """A micro-batch whose rows are all masked out (a stale batch dropped, trainer.stale_policy=drop)
    scores no position; its outputs must still hang on the model's graph, so that its backward runs the
    model's (FSDP's) hooks like the other ranks' and leaves zero gradients, not "does not require grad"."""
    model = MODELS["qwen2_untied"]()
    ids, attn = _batch()
    out = policy_forward(
        model,
        ids,
        attn,
        with_entropy=True,
        pack_sequences=packed,
        lengths_B=LENGTHS,
        first_columns_B=LENGTHS,  # every row's first scored column is its end
        fused_chunk_tokens=chunk,
    )
    assert out.entropy_BT is not None and out.logprobs_BT.requires_grad
    assert not out.logprobs_BT.any()
    (out.logprobs_BT.sum() + out.entropy_BT.sum()).backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert grads and not any(g.any() for g in grads)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_fused_gradients_equal_plain(name: str) -> None:
    """Gradients of a loss on logprobs and entropy w.r.t. every parameter (head weight, tied or not,
    the decoder behind the hidden states): fused equals plain, padded and packed. The model is float64,
    the plain head's losses float32 (spmdrl.algos.losses), so they agree to float32 rounding of each
    gradient's scale."""
    model = MODELS[name]()
    ids, attn = _batch()
    g = torch.Generator().manual_seed(1)
    c_lp, c_ent = torch.randn(ids.shape, generator=g), torch.randn(ids.shape, generator=g)
    grads = {}
    for packed in (False, True):
        for chunk in (0, 5):
            model.zero_grad(set_to_none=True)
            out = _forward(model, ids, attn, chunk=chunk, packed=packed)
            assert out.entropy_BT is not None and out.entropy_BT.requires_grad
            ((out.logprobs_BT * c_lp).sum() + (out.entropy_BT * c_ent).sum()).backward()
            grads[packed, chunk] = {
                n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None
            }
    head = "lm_head.weight" if "lm_head.weight" in grads[False, 0] else "model.embed_tokens.weight"
    assert grads[False, 0][head].abs().sum() > 0
    for key, got in grads.items():
        assert got.keys() == grads[False, 0].keys(), key
        for n, grad in got.items():
            ref = grads[False, 0][n]
            atol = 1e-6 * float(ref.abs().max())
            torch.testing.assert_close(grad, ref, rtol=1e-5, atol=atol, msg=f"{key} {n}")


def test_entropy_bonus_gradient_reaches_hidden_states() -> None:
    """What an entropy bonus adds to d loss / d hidden states is d entropy / d hidden states, computed
    from the definition on the same hidden states (plain and fused heads)."""
    model = _qwen2(True)
    ids, attn = _batch()
    captured: list[torch.Tensor] = []

    def keep(_m: torch.nn.Module, _a: object, output: object) -> None:
        h = output.last_hidden_state  # type: ignore[attr-defined]
        h.retain_grad()
        captured.append(h)

    handle = model.get_decoder().register_forward_hook(keep)
    try:
        diffs = []
        for chunk in (0, 6):
            grads = []
            for coeff in (0.0, 0.5):
                out = _forward(model, ids, attn, chunk=chunk, packed=False)
                (out.logprobs_BT.sum() - coeff * out.entropy_BT.sum()).backward()
                grads.append(captured.pop().grad)
            diffs.append(grads[1] - grads[0])
        h = (
            model.get_decoder()(input_ids=ids, attention_mask=attn)
            .last_hidden_state.detach()
            .requires_grad_()
        )
    finally:
        handle.remove()
        model.zero_grad(set_to_none=True)
    B, T = ids.shape
    z = (model.lm_head(h) / TEMPERATURE)[:, :-1]
    flat = torch.zeros(B, T - 1, dtype=torch.bool).view(-1)
    flat[[i - 1 - i // T for i in scored_positions(T, LENGTHS, FIRSTS)]] = True  # (b, t) -> (b, t - 1)
    ent = (entropy_from_logits(z) * flat.view(B, T - 1)).sum()
    (d_ent,) = torch.autograd.grad(ent, h)
    assert d_ent.abs().max() > 0
    for diff in diffs:
        torch.testing.assert_close(diff, -0.5 * d_ent, rtol=1e-5, atol=1e-6 * float(d_ent.abs().max()))


def test_use_fused_kernels_setting() -> None:
    """auto: fused from 32k tokens on, on any device (a small vocabulary keeps the plain head, its logits
    small: on a GPU too); true / false (booleans too) force it; bad values refused."""
    cfg = ModelConfig()
    assert (
        cfg.fused_head_chunk(151936)
        == cfg.fused_head_chunk(FUSED_AUTO_MIN_VOCAB)
        == cfg.fused_chunk_tokens
        > 0
    )
    assert cfg.fused_head_chunk(FUSED_AUTO_MIN_VOCAB - 1) == cfg.fused_head_chunk(512) == 0
    for value in ("true", True, "True"):
        assert ModelConfig(use_fused_kernels=value, fused_chunk_tokens=64).fused_head_chunk(512) == 64
    for value in ("false", False):
        assert ModelConfig(use_fused_kernels=value).fused_head_chunk(151936) == 0


def test_use_fused_kernels_from_the_command_line() -> None:
    from spmdrl.config_loader import load_config

    cfg = load_config(["recipe=grpo_tiny", "model.use_fused_kernels=true", "model.fused_chunk_tokens=256"])
    assert cfg.model.fused_head_chunk(512) == 256
    with pytest.raises(
        ConfigError, match="model.use_fused_kernels='sometimes' is not one of auto, true, false"
    ):
        load_config(["recipe=grpo_tiny", "model.use_fused_kernels=sometimes"])
    cfg = load_config(["recipe=grpo_tiny"])
    cfg.model.fused_chunk_tokens = 0
    with pytest.raises(ConfigError, match="model.fused_chunk_tokens must be >= 1"):
        validate(cfg)


class _VocabMatmuls(torch.utils._python_dispatch.TorchDispatchMode):
    """The dtypes of every matrix multiplication with a vocabulary-wide operand (the LM head's GEMMs)."""

    def __init__(self) -> None:
        super().__init__()
        self.dtypes: list[torch.dtype] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if func in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default):
            operands = [a for a in args if isinstance(a, torch.Tensor)]
            if any(V in a.shape for a in operands):
                self.dtypes += [a.dtype for a in operands]
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("chunk", [0, 16])
def test_head_under_autocast_runs_bf16_gemms_in_forward_and_backward(chunk: int) -> None:
    """A bare module under bf16 autocast (model.fsdp_unit=none, spmdrl.models.parallelize.apply_autocast):
    the head's GEMMs run in bf16 in forward and in backward, plain or fused. Autocast does not reach a
    custom autograd Function's backward, so the fused head casts its own inputs; without that its
    backward would recompute the chunks' logits and their gradients in float32 (on a GPU several times
    the bf16 GEMMs' time, and not the logits the forward scored). The float32 parameters still get float32
    gradients."""
    from spmdrl.models.parallelize import apply_autocast

    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(**{**SMALL_QWEN2, "vocab_size": V})).float()
    apply_autocast(model, torch.bfloat16, "cpu")
    ids, attn = _batch()
    matmuls = _VocabMatmuls()
    with matmuls:
        out = _forward(model, ids, attn, chunk=chunk, packed=False)
    forward_dtypes, matmuls.dtypes = matmuls.dtypes, []
    with matmuls:
        out.logprobs_BT.sum().backward()
    assert forward_dtypes and set(forward_dtypes) == {torch.bfloat16}, forward_dtypes
    assert matmuls.dtypes and set(matmuls.dtypes) == {torch.bfloat16}, matmuls.dtypes
    assert model.lm_head.weight.grad is not None and model.lm_head.weight.grad.dtype == torch.float32
