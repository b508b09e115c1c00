"""The weight-sync check's arithmetic (spmdrl/rollout/fingerprint.py) without an engine
(tests/integration/test_weight_sync.py runs the check against the real vLLM engine on every CPU GEMM path)."""

from __future__ import annotations

import pytest
import torch

from spmdrl.rollout.fingerprint import (
    Fingerprint,
    WeightSyncError,
    compare,
    expert_key,
    matrix_key,
    observe,
    probe_columns,
    sync_error,
    vector_key,
    whole_sums,
)
from spmdrl.rollout.weight_sync import SyncCheck

# Its outcome depends on the kernels the engine picks for the CPU: CI runs it as every CPU kind.
pytestmark = pytest.mark.cpu_kinds


def _engine_side(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, norm: torch.Tensor, seed: int, tp: int):
    """What the engine computes: q/k/v merged into one layer, split over ``tp`` ranks by output rows,
    probed with one-hot rows through a matmul, then summed over the ranks."""
    merged = torch.cat([q, k, v])
    cols = probe_columns(merged.shape[1], seed)
    total = Fingerprint()
    for shard in merged.chunk(tp):
        x = torch.zeros(len(cols), merged.shape[1], dtype=merged.dtype)
        x[range(len(cols)), cols] = 1
        part = Fingerprint()
        part.add(matrix_key("model.layers.0.self_attn.qkv_proj", merged.shape[1]), "qkv", x @ shard.T)
        for key, vals in part.values.items():
            acc = total.values.setdefault(key, [0.0, 0.0, 0.0])
            for i in range(3):
                acc[i] += vals[i]
    total.add_vector("model.layers.0.input_layernorm.weight", norm)
    return total


def _trainer_side(tensors: dict[str, torch.Tensor], seed: int) -> Fingerprint:
    fp = Fingerprint()
    assert list(observe(tensors.items(), fp, seed, {})) == list(tensors.items())  # passes them through
    return fp


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("tp", [1, 2])
def test_merged_and_split_engine_layers_match_separate_trainer_tensors(dtype: torch.dtype, tp: int) -> None:
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(n, 64, generator=g).to(dtype) for n in (64, 16, 16))
    norm = torch.randn(64, generator=g).to(dtype)
    tensors = {
        "model.layers.0.self_attn.q_proj.weight": q,
        "model.layers.0.self_attn.k_proj.weight": k,
        "model.layers.0.self_attn.v_proj.weight": v,
        "model.layers.0.input_layernorm.weight": norm,
    }
    trainer = _trainer_side(tensors, seed=3)
    assert compare(_engine_side(q, k, v, norm, seed=3, tp=tp), trainer, tol=1e-12) == []

    # A stale k_proj, one small optimizer step behind: bf16, one weight one ulp off in a probed column;
    # fp32, every weight 1e-6 off (what Adam at lr 1e-6 moves it). Caught at the default tolerance.
    stale = k.clone()
    if dtype == torch.bfloat16:
        col = probe_columns(64, 3)[0]
        stale[5, col] = torch.nextafter(stale[5, col], torch.tensor(1e9, dtype=dtype))
    else:
        stale += 1e-6 * torch.randn(stale.shape, generator=g).sign()
    assert not torch.equal(stale, k)
    divergences = compare(_engine_side(q, stale, v, norm, seed=3, tp=tp), trainer, tol=SyncCheck.tol)
    assert [d.key for d in divergences] == ["layer 0: matrices, input size 64"]
    # A norm weight changed: the layer's vectors differ.
    divergences = compare(_engine_side(q, k, v, norm * 1.01, seed=3, tp=tp), trainer, tol=1e-6)
    assert [d.key for d in divergences] == ["layer 0: vectors"]


def test_probe_columns_are_deterministic_and_vary_by_seed() -> None:
    assert probe_columns(896, 5) == probe_columns(896, 5)
    assert probe_columns(896, 5) != probe_columns(896, 6)
    assert all(0 <= c < 896 for c in probe_columns(896, 5))
    assert probe_columns(2, 1) in ([0], [1], [0, 1])  # never more columns than the input has


def test_keys_group_by_decoder_layer_and_input_size() -> None:
    assert matrix_key("model.layers.12.mlp.down_proj", 4864) == "layer 12: matrices, input size 4864"
    assert matrix_key("model.layers.12.mlp.down_proj.weight", 4864) == "layer 12: matrices, input size 4864"
    assert (
        matrix_key("lm_head", 896)
        == matrix_key("model.embed_tokens.weight", 896)
        == ("top: matrices, input size 896")
    )
    assert vector_key("model.norm.weight") == "top: vectors"
    assert vector_key("model.layers.3.self_attn.qkv_proj.bias") == "layer 3: vectors"


def test_tied_embedding_counts_once_per_engine_layer_using_it() -> None:
    emb = torch.randn(32, 16)
    once, twice = Fingerprint(), Fingerprint()
    list(observe([("model.embed_tokens.weight", emb)], once, 0, {}))
    list(observe([("model.embed_tokens.weight", emb)], twice, 0, {"model.embed_tokens.weight": 2}))
    key = "top: matrices, input size 16"
    assert twice.values[key] == pytest.approx([2 * x for x in once.values[key]])


def test_missing_group_and_error_message() -> None:
    trainer = Fingerprint()
    trainer.add_vector("model.norm.weight", torch.ones(4))
    divergences = compare(Fingerprint(), trainer, tol=1e-6)
    assert [d.key for d in divergences] == ["top: vectors"]
    err = sync_error(divergences, "at step 7")
    assert isinstance(err, WeightSyncError)
    msg = str(err)
    assert "at step 7" in msg and "model.norm.weight" in msg and "rollout.cpu_gemm=torch" in msg


def _engine_experts(w13: torch.Tensor, w2: torch.Tensor, tp: int, g: torch.Generator) -> Fingerprint:
    """The engine's expert sums as vllm_worker.fingerprint takes them: w13 / w2 split over ``tp`` ranks by
    the intermediate dimension, each rank's slice zero-padded and its elements permuted within each expert
    (as vLLM's CPU prepack does), summed whole per expert, then over the ranks."""
    total = Fingerprint()
    inter = w2.shape[2]
    for r in range(tp):
        rows = slice(r * inter // tp, (r + 1) * inter // tp)
        mine13 = torch.cat([w13[:, :inter][:, rows], w13[:, inter:][:, rows]], dim=1)
        mine2 = w2[:, :, rows]
        part = Fingerprint()
        for name, w, kind in (("w13_weight", mine13, "gate_up"), ("w2_weight", mine2, "down")):
            padded = torch.cat([w.flatten(1), torch.zeros(w.shape[0], 7, dtype=w.dtype)], dim=1)
            packed = torch.stack([e[torch.randperm(e.numel(), generator=g)] for e in padded])
            sums = whole_sums(packed, dims=(1,))
            for e in range(w.shape[0]):
                part.add_sums(expert_key("model.layers.0.mlp.experts", e, kind), name, sums[e])
        for key, vals in part.values.items():
            acc = total.values.setdefault(key, [0.0, 0.0, 0.0])
            for i in range(3):
                acc[i] += vals[i]
    return total


@pytest.mark.parametrize("tp", [1, 2])
def test_experts_are_checked_whole_whatever_order_the_engine_keeps_them_in(tp: int) -> None:
    """The trainer sends each expert's gate, up and down matrices; the engine holds them fused (w13 = gate
    above up), TP-sliced, padded and permuted: the per-expert sums agree. A corrupted element of one
    expert, or two experts swapped, is caught, naming that expert."""
    from spmdrl.models.experts import split_fused

    g = torch.Generator().manual_seed(0)
    E, inter, hidden = 3, 8, 16
    gate_up = torch.randn(E, 2 * inter, hidden, generator=g)
    down = torch.randn(E, hidden, inter, generator=g)
    sent = Fingerprint()
    stream = [
        *split_fused("model.layers.0.mlp.experts.gate_up_proj", gate_up),
        *split_fused("model.layers.0.mlp.experts.down_proj", down),
    ]
    list(observe(iter(stream), sent, seed=0, times={}))
    assert sorted(sent.values) == sorted(
        f"layer 0: expert {e} {kind}" for e in range(E) for kind in ("gate_up", "down")
    )
    assert compare(_engine_experts(gate_up, down, tp, g), sent, tol=1e-9) == []
    corrupted = gate_up.clone()
    corrupted[1, inter + 3, 5] += 1e-3  # one element of expert 1's up matrix
    bad = compare(_engine_experts(corrupted, down, tp, g), sent, tol=1e-9)
    assert [d.key for d in bad] == ["layer 0: expert 1 gate_up"]
    swapped = down[[1, 0, 2]]
    bad = compare(_engine_experts(gate_up, swapped, tp, g), sent, tol=1e-9)
    assert [d.key for d in bad] == ["layer 0: expert 0 down", "layer 0: expert 1 down"]
