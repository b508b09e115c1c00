"""Weight-sync naming without an engine (spmdrl/rollout/weight_sync.py): engine names, tied lm_head."""

from __future__ import annotations

import pytest

from spmdrl.rollout.weight_sync import engine_name

# Its outcome depends on the kernels the engine picks for the CPU: CI runs it as every CPU kind.
pytestmark = pytest.mark.cpu_kinds

# ---- pure functions ---------------------------------------------------------------------------------


def test_engine_name_strips_the_activation_checkpoint_wrapper() -> None:
    assert (
        engine_name("model.layers.0._checkpoint_wrapped_module.mlp.up_proj.weight")
        == "model.layers.0.mlp.up_proj.weight"
    )
    assert engine_name("model.norm.weight") == "model.norm.weight"


def test_trainer_weights_skips_tied_lm_head_and_keeps_untied() -> None:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from spmdrl.rollout.weight_sync import trainer_weights

    kw = dict(
        vocab_size=32,
        hidden_size=32,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=1,
        num_key_value_heads=1,
        head_dim=32,
    )
    tied = [n for n, _ in trainer_weights(Qwen2ForCausalLM(Qwen2Config(**kw, tie_word_embeddings=True)))]
    untied = [n for n, _ in trainer_weights(Qwen2ForCausalLM(Qwen2Config(**kw, tie_word_embeddings=False)))]
    assert "lm_head.weight" not in tied and "model.embed_tokens.weight" in tied
    assert "lm_head.weight" in untied
