"""Small random Qwen2 checkpoints for tests and benchmarks (no tokenizer, no download)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

# Two layers, two heads of head_dim 32 (vLLM's CPU attention rejects 16), tied embeddings.
SMALL_QWEN2: dict[str, Any] = dict(
    vocab_size=64,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=32,
    tie_word_embeddings=True,
    max_position_embeddings=64,
)


def save_small_qwen2(path: Path, *, seed: int = 0, **overrides: Any) -> None:
    """Saves a deterministic random Qwen2 (``SMALL_QWEN2`` with ``overrides``) as safetensors in ``path``."""
    torch.manual_seed(seed)
    Qwen2ForCausalLM(Qwen2Config(**{**SMALL_QWEN2, **overrides})).save_pretrained(path)
