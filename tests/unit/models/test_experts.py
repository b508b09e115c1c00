"""The expert layouts (spmdrl/models/experts.py) against transformers' own conversion: what its
save_pretrained writes for a Qwen3-MoE is what spmdrl exports, and what spmdrl stacks from that checkpoint
is the model's own fused parameters, bit for bit."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from spmdrl.models.experts import expert_of, split_all, to_checkpoint_layout, to_model_layout

SMALL_MOE = dict(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=64,
    moe_intermediate_size=16,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=16,
    num_experts=3,
    num_experts_per_tok=2,
)


@pytest.fixture(scope="module")
def saved(
    tmp_path_factory: pytest.TempPathFactory,
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(the model's state dict, the checkpoint transformers saved from it)."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**SMALL_MOE, tie_word_embeddings=False))
    out = tmp_path_factory.mktemp("moe")
    model.save_pretrained(out)
    return {k: v.detach() for k, v in model.state_dict().items()}, load_file(Path(out) / "model.safetensors")


def test_the_export_layout_is_what_transformers_saves(saved: tuple[dict, dict]) -> None:
    model_state, checkpoint = saved
    exported = to_checkpoint_layout(model_state)
    assert exported.keys() == checkpoint.keys()
    assert all(torch.equal(exported[k], checkpoint[k]) for k in checkpoint)
    assert "model.layers.1.mlp.experts.2.up_proj.weight" in exported  # per expert, per projection
    assert all(v.is_contiguous() for v in exported.values())  # safetensors writes no views


def test_the_checkpoint_stacks_into_the_models_fused_parameters(saved: tuple[dict, dict]) -> None:
    model_state, checkpoint = saved
    fused = to_model_layout(checkpoint)
    assert fused.keys() == model_state.keys()
    assert all(torch.equal(fused[k], model_state[k]) for k in model_state)
    # A checkpoint that already stores fused experts, and a dense one, pass unchanged.
    assert to_model_layout(model_state).keys() == model_state.keys()
    dense = {"model.layers.0.mlp.gate_proj.weight": torch.ones(2, 2)}
    assert to_model_layout(dense) is not dense and to_checkpoint_layout(dense) is dense


def test_the_sync_stream_sends_each_experts_matrices_under_the_checkpoint_names(
    saved: tuple[dict, dict],
) -> None:
    model_state, checkpoint = saved
    streamed = list(split_all(model_state.items()))
    assert dict(streamed).keys() == checkpoint.keys()
    assert all(torch.equal(t, checkpoint[n]) for n, t in streamed)
    # Views of the gathered tensor, no copies.
    gate_up = model_state["model.layers.0.mlp.experts.gate_up_proj"]
    view = dict(streamed)["model.layers.0.mlp.experts.1.up_proj.weight"]
    assert view.untyped_storage().data_ptr() == gate_up.untyped_storage().data_ptr()


def test_expert_names() -> None:
    assert expert_of("model.layers.3.mlp.experts.17.gate_proj.weight") == (17, "gate_up")
    assert expert_of("model.layers.3.mlp.experts.17.up_proj.weight") == (17, "gate_up")
    assert expert_of("model.layers.3.mlp.experts.0.down_proj.weight") == (0, "down")
    assert expert_of("model.layers.3.mlp.gate_proj.weight") is None  # a dense MLP
    assert expert_of("model.layers.3.mlp.gate.weight") is None  # the router


def test_incomplete_experts_are_refused_naming_what_is_missing(saved: tuple[dict, dict]) -> None:
    _, checkpoint = saved
    broken = {k: v for k, v in checkpoint.items() if k != "model.layers.1.mlp.experts.1.down_proj.weight"}
    with pytest.raises(ValueError, match=r"missing model\.layers\.1\.mlp\.experts\.1\.down_proj\.weight"):
        to_model_layout(broken)
