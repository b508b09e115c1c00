"""The memory model behind the automatic token budgets (spmdrl/models/memory_model.py), against numbers
worked out by hand here for the Qwen2.5 decoder shapes (their config.json values), term by term in the
order the module docstring lists them, not through the module's own grouping. The free GPU memory cannot
be measured on CPU: the budget tests pass a free-memory figure in, as spmdrl/rl/token_budgets.py does with
torch.cuda.mem_get_info's on a GPU."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from spmdrl.errors import ConfigError
from spmdrl.models.memory_model import (
    DecoderShape,
    MemoryInputs,
    check_bare_module,
    gathered_param_bytes,
    layer_bytes_per_token,
    mlp_bytes_per_token,
    model_state_bytes,
    no_grad_bytes_per_token,
    token_budget,
    token_budgets,
    train_bytes_per_token,
    whole_model_unit,
)

GIB = 2**30
# Qwen2.5-{0.5B,1.5B,7B}-Instruct config.json: hidden, intermediate, layers, heads, kv heads, vocab, tied.
QWEN_05B = DecoderShape(896, 4864, 24, 14, 2, 151936, tied_embeddings=True)
QWEN_15B = DecoderShape(1536, 8960, 28, 12, 2, 151936, tied_embeddings=True)
QWEN_7B = DecoderShape(3584, 18944, 28, 28, 4, 152064, tied_embeddings=False)


def _by_hand(h: int, i: int, layers: int, kv: int, vocab: int, heads: int) -> dict[str, int]:
    """bf16 (2 bytes) per-token bytes, each saved tensor written out."""
    norm = 4 * h + 4 + 2 * h + 2 * h  # float32 input, float32 1/rms, bf16 normed, bf16 times the weight
    attention = norm + 2 * (h + kv + kv) + 2 * h + 4 * heads  # q, k, v; the output; float32 logsumexp
    mlp = norm + 2 * i * 4  # gate, up, silu(gate), their product
    layer = attention + mlp
    final_norm = norm
    # float32 copy kept by logsumexp, logits, scaled copy; the scored positions' hidden states
    head_train = 4 * vocab + 2 * vocab + 2 * vocab + 2 * h
    head_no_grad = 2 * vocab + 2 * vocab  # logits, scaled copy
    return {
        "layer": layer,
        "train": layers * layer + final_norm + head_train,
        "train_ac": layers * 2 * h + layer + final_norm + head_train,  # layer inputs + one recomputed
        "no_grad": layer + head_no_grad,
        # Fused head: the hidden states and their float32 gradient instead of the vocabulary term.
        "train_fused": layers * layer + final_norm + (2 + 4) * h,
        "no_grad_fused": layer,
    }


@pytest.mark.parametrize(
    ("shape", "kv", "expected", "params"),
    [
        # layer = 20h + 4kv + 8i + 4 heads + 8; e.g. 0.5B: 17920 + 512 + 38912 + 56 + 8.
        (
            QWEN_05B,
            2 * 64,
            {"layer": 57_408, "train": 2_602_244, "train_ac": 1_324_868, "no_grad": 665_152},
            494_032_768,
        ),
        (
            QWEN_15B,
            2 * 128,
            {"layer": 103_480, "train": 4_128_292, "train_ac": 1_420_348, "no_grad": 711_224},
            1_543_714_304,
        ),
        (
            QWEN_7B,
            4 * 128,
            {"layer": 225_400, "train": 7_563_556, "train_ac": 1_678_460, "no_grad": 833_656},
            7_615_616_512,
        ),
    ],
    ids=["0.5B", "1.5B", "7B"],
)
def test_bytes_per_token_match_the_hand_computation(
    shape: DecoderShape, kv: int, expected: dict[str, int], params: int
) -> None:
    hand = _by_hand(shape.hidden, shape.intermediate, shape.layers, kv, shape.vocab, shape.heads)
    assert {k: hand[k] for k in expected} == expected  # the hand computation, checked against literals
    assert shape.kv_width == kv
    # The published parameter counts of these models: the state and the gathered parameters start here.
    assert shape.params == params

    plain = MemoryInputs(shape)
    assert layer_bytes_per_token(plain) == hand["layer"]
    assert train_bytes_per_token(plain) == hand["train"]
    assert no_grad_bytes_per_token(plain) == hand["no_grad"]
    assert train_bytes_per_token(MemoryInputs(shape, activation_checkpointing="full")) == hand["train_ac"]
    fused = MemoryInputs(shape, fused_chunk_tokens=512)
    assert train_bytes_per_token(fused) == hand["train_fused"]
    assert no_grad_bytes_per_token(fused) == hand["no_grad_fused"]
    # A no-grad pass keeps one layer's working set, never the stack: well under the update's per token.
    assert no_grad_bytes_per_token(plain) < train_bytes_per_token(
        MemoryInputs(shape, activation_checkpointing="full")
    )


def test_checkpointing_every_other_layer_and_mlp_only() -> None:
    h, i, L, kv = 896, 4864, 24, 128
    hand = _by_hand(h, i, L, kv, 151936, 14)
    head_and_norm = (8 * h + 4) + 8 * 151936 + 2 * h
    every2 = MemoryInputs(QWEN_05B, activation_checkpointing="full", checkpoint_every=2)
    # 12 checkpointed layers keep their input, 12 keep everything, one is recomputed at a time.
    assert train_bytes_per_token(every2) == 12 * 2 * h + 12 * hand["layer"] + hand["layer"] + head_and_norm
    mlp = MemoryInputs(QWEN_05B, activation_checkpointing="mlp")
    attention = (8 * h + 4) + 2 * (h + 2 * kv) + 2 * h + 4 * 14
    mlp_saved = (8 * h + 4) + 8 * i
    # Every layer keeps its attention and the MLP's input; one MLP is recomputed at a time.
    assert train_bytes_per_token(mlp) == L * (attention + 2 * h) + mlp_saved + head_and_norm


def test_budget_for_a_given_free_memory_7b_on_8_gpus() -> None:
    """Qwen2.5-7B, actor + reference sharded over 8 GPUs, 78 GiB free (an 80 GB card, engine asleep),
    4 GiB reserve, activation checkpointing, plain head, varlen attention."""
    free, reserve, max_len = 78 * GIB, 4 * GIB, 1536
    P = 7_615_616_512
    state = 16 * P // 8 + 2 * P // 8  # actor: params 4 + grads 4 + moments 8; reference: bf16 params 2
    layer_params = 3584 * (3584 + 2 * 512) + 3584 * 3584 + (3584 + 2 * 512) + 3 * 3584 * 18944 + 2 * 3584
    root_params = 2 * 152064 * 3584 + 3584  # embeddings, untied LM head, final norm
    gathered_train = (2 * layer_params + root_params) * (2 + 4)  # bf16 params + float32 grads
    gathered_no_grad = (2 * layer_params + root_params) * 2
    # Modelled bytes per token x 1.6 (HEADROOM: what the model does not count), rounded up.
    train_tokens = (free - state - reserve - gathered_train) // 2_685_536 // 256 * 256
    no_grad_tokens = (free - state - reserve - gathered_no_grad) // 1_333_850 // 256 * 256
    assert (train_tokens, no_grad_tokens) == (19_712, 44_288)

    m = MemoryInputs(QWEN_7B, activation_checkpointing="full")
    assert model_state_bytes(P, P, 4, 8) + model_state_bytes(P, 0, 2, 8) == state
    assert gathered_param_bytes(m, grad=True) == gathered_train
    b = token_budgets(m, free_bytes=free, state_bytes=state, reserve_bytes=reserve, max_len=max_len)
    assert (b.train, b.no_grad) == (train_tokens, no_grad_tokens)
    assert b.no_grad > 2 * b.train  # the no-grad passes' budget is the larger one


def test_budget_is_a_multiple_of_256_and_at_least_one_longest_sequence() -> None:
    assert token_budget(1000 * 1000, 1000, 512) == 768  # 1000 tokens fit -> 768
    assert token_budget(10 * 1000, 1000, 1536) == 1536  # too little memory: one longest sequence
    assert token_budget(-5, 1000, 1536) == 1536
    m = MemoryInputs(QWEN_7B)
    tight = token_budgets(m, free_bytes=20 * GIB, state_bytes=19 * GIB, reserve_bytes=4 * GIB, max_len=2048)
    assert (tight.train, tight.no_grad) == (2048, 2048)


def test_attention_masks_cost_per_token_padded_and_quadratically_packed() -> None:
    # x tokens with x * 1000 + 3 * x^2 bytes: at 10240 tokens exactly 324,812,800 bytes.
    exact = 10240 * 1000 + 3 * 10240**2
    assert token_budget(exact, 1000, 256, pair_bytes=3) == 10240
    assert token_budget(exact - 1, 1000, 256, pair_bytes=3) == 9984
    free, max_len = 60 * GIB, 1536
    kwargs = {"free_bytes": free, "state_bytes": 0, "reserve_bytes": 0, "max_len": max_len}
    varlen = token_budgets(MemoryInputs(QWEN_05B, attention="varlen"), **kwargs)
    padded = token_budgets(MemoryInputs(QWEN_05B, attention="padded"), **kwargs)
    packed = token_budgets(MemoryInputs(QWEN_05B, attention="packed_mask"), **kwargs)
    # Padded rows: a boolean mask row and SDPA's bf16 copy of max_len keys per token.
    assert padded.train_bytes_per_token == varlen.train_bytes_per_token + 3 * max_len
    assert varlen.no_grad > padded.no_grad > packed.no_grad


def _saved_bytes_per_token(layers: int, tokens: tuple[int, int]) -> float:
    """Bytes of the tensors autograd saves in a bf16 Qwen2 body's forward (parameters excluded; each
    storage once), per token."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        num_hidden_layers=layers,
        hidden_size=64,
        intermediate_size=192,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=1000,
        tie_word_embeddings=True,
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config).to(torch.bfloat16)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        s = t.untyped_storage()
        if s.data_ptr() not in params:
            saved[s.data_ptr()] = s.nbytes()
        return t

    ids = torch.randint(0, 1000, tokens)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model.model(input_ids=ids, use_cache=False)
    return sum(saved.values()) / (tokens[0] * tokens[1])


def test_layer_term_is_what_autograd_saves_in_a_real_qwen2_layer() -> None:
    """The per-layer term counted on transformers' Qwen2 decoder layer in bf16 through SDPA (on CPU: the
    same tensors are saved on a GPU, whose SDPA kernels also keep q, k, v, the output and a logsumexp):
    the difference between 3 and 1 layers, per layer and token."""
    per_layer = (_saved_bytes_per_token(3, (2, 32)) - _saved_bytes_per_token(1, (2, 32))) / 2
    shape = DecoderShape(64, 192, 1, 4, 2, 1000, tied_embeddings=True)
    assert per_layer == layer_bytes_per_token(MemoryInputs(shape)) == 20 * 64 + 4 * 32 + 8 * 192 + 4 * 4 + 8


H100 = 80 * 10**9  # an 80 GB card's total bytes


@pytest.mark.parametrize(
    ("mode", "ranks", "params", "total", "expected"),
    [
        ("auto", 1, 494_032_768, H100, True),  # 0.5B: 6 B/param unsharded = 3.0 GB <= 10 GB
        ("auto", 1, 1_543_714_304, H100, True),  # 1.5B: 9.3 GB <= 10 GB
        ("auto", 1, 7_615_616_512, H100, False),  # 7B: 45.7 GB > 10 GB
        ("auto", 2, 494_032_768, H100, False),  # two ranks: the gathers overlap compute per layer
        ("auto", 1, 7_615_616_512, None, True),  # a CPU: no card to fit
        ("layer", 1, 494_032_768, None, False),
        ("model", 8, 7_615_616_512, H100, True),  # asked for: taken as asked
        ("none", 1, 7_615_616_512, H100, True),  # no FSDP2: the whole model's compute copy, as asked
    ],
)
def test_whole_model_unit_rule(mode: str, ranks: int, params: int, total: int | None, expected: bool) -> None:
    got = whole_model_unit(
        mode, mesh_ranks=ranks, params=params, compute_bytes=2, trained=True, total_bytes=total
    )
    assert got is expected


def test_whole_model_unit_frozen_counts_no_gradients_and_rejects_typos() -> None:
    # A frozen model has no gradients: 2 B/param; 7B (14 GB) is over an 80 GB card's eighth, 4B (8 GB) not.
    assert not whole_model_unit(
        "auto", mesh_ranks=1, params=7 * 10**9, compute_bytes=2, trained=False, total_bytes=H100
    )
    assert whole_model_unit(
        "auto", mesh_ranks=1, params=4 * 10**9, compute_bytes=2, trained=False, total_bytes=H100
    )
    with pytest.raises(ConfigError, match="model.fsdp_unit='layers' is not one of auto, layer, model, none"):
        whole_model_unit("layers", mesh_ranks=1, params=1, compute_bytes=2, trained=True, total_bytes=None)


def test_no_fsdp2_needs_one_rank_per_model() -> None:
    """model.fsdp_unit=none on a mesh of several ranks would train a copy per rank, its gradients never
    reduced: refused, naming the roles and the fix (the RL job asks before any model: check_bare_module)."""
    with pytest.raises(
        ConfigError, match=r"needs a one-rank mesh for every model, got this model on 2 ranks"
    ):
        whole_model_unit("none", mesh_ranks=2, params=1, compute_bytes=2, trained=True, total_bytes=None)
    with pytest.raises(
        ConfigError, match=r"got critic on 4 ranks: run on one process per model .*fsdp_unit=auto"
    ):
        check_bare_module({"actor": 1, "ref": 1, "critic": 4})
    check_bare_module({"actor": 1, "ref": 1})  # one rank each: nothing to say


def test_whole_model_unit_gathers_every_parameter() -> None:
    """The fixed bytes of a pass: the whole model unsharded instead of two layers and the root."""
    s = QWEN_05B
    per_layer = MemoryInputs(s)
    whole = MemoryInputs(s, whole_model=True)
    assert gathered_param_bytes(per_layer, grad=True) == (2 * s.layer_params + s.root_params) * 6
    assert gathered_param_bytes(whole, grad=True) == s.params * 6
    assert gathered_param_bytes(whole, grad=False) == s.params * 2
    free = 78 * GIB
    b_layer = token_budgets(per_layer, free_bytes=free, state_bytes=0, reserve_bytes=0, max_len=1024)
    b_whole = token_budgets(whole, free_bytes=free, state_bytes=0, reserve_bytes=0, max_len=1024)
    assert b_whole.train < b_layer.train and b_whole.no_grad <= b_layer.no_grad


def test_a_mixture_of_experts_counts_every_experts_weights(tmp_path) -> None:  # noqa: ANN001
    """tiny-moe's config: the weights are every expert's and the routers' (what FSDP2 shards and the sync
    sends), counted as the built model counts them; activations are those of the experts a token uses."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from spmdrl.models.tiny import TINY_MOE, ensure_tiny_model

    config = AutoConfig.from_pretrained(ensure_tiny_model(tmp_path, TINY_MOE))
    shape = DecoderShape.from_hf(config)
    assert (shape.intermediate, shape.experts, shape.experts_per_token) == (128, 4, 2)
    built = sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())
    # (Qwen3's q_norm and k_norm, head_dim each per layer, are left out, as for the dense Qwen3.)
    assert shape.params + shape.layers * 2 * shape.head_dim == built
    dense = dataclasses.replace(shape, experts=1, experts_per_token=1)
    grow = mlp_bytes_per_token(MemoryInputs(shape)) - mlp_bytes_per_token(MemoryInputs(dense))
    assert grow == 4 * 2 * 128 * (2 - 1)  # bf16: the second expert's gate, up, silu and product
