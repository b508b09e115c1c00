"""Decoder shapes the benchmarks build random models of (Qwen2 configs' fields), named as their --shape."""

from __future__ import annotations

from typing import Any

from spmdrl.testing.models import QWEN2_5_0_5B

SHAPES: dict[str, dict[str, Any]] = {
    # A CPU's: train_step.py's tiny shape (~0.3M parameters without the embeddings), GQA 4/2 like Qwen2.5.
    "tiny": dict(
        hidden_size=128,
        intermediate_size=352,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=512,
        tie_word_embeddings=True,
    ),
    # lora.py's: between the CPU and GPU sizes (~27M parameters).
    "small": dict(
        hidden_size=512,
        intermediate_size=1408,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=2,
        vocab_size=8192,
    ),
    # Qwen2.5-0.5B / 1.5B / 7B config.json (hub model cards).
    "qwen2.5-0.5b": dict(QWEN2_5_0_5B),  # the numbers the memory model's tests use too
    "qwen2.5-1.5b": dict(
        hidden_size=1536,
        intermediate_size=8960,
        num_hidden_layers=28,
        num_attention_heads=12,
        num_key_value_heads=2,
        vocab_size=151936,
        tie_word_embeddings=True,
    ),
    "qwen2.5-7b": dict(
        hidden_size=3584,
        intermediate_size=18944,
        num_hidden_layers=28,
        num_attention_heads=28,
        num_key_value_heads=4,
        vocab_size=152064,
        tie_word_embeddings=False,
    ),
}
# Qwen2.5-0.5B's 24 layers at the tiny width: the host's work per layer (module hooks, FSDP2's units, op
# dispatch) with little compute, a CPU's proxy for a GPU step the host bounds.
SHAPES["deep-narrow"] = {**SHAPES["tiny"], "num_hidden_layers": 24}
