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


def padded_rows(
    prompt_len_B: torch.Tensor, resp_len_B: torch.Tensor, vocab: int, g: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random right-padded prompt + response rows for update tests: ``(ids_BT, attention_BT, response_BT)``.

    Token ids are drawn from ``g`` (pad positions are 0); the response mask marks each row's response.
    """
    B = prompt_len_B.shape[0]
    T = int((prompt_len_B + resp_len_B).max())
    ids = torch.randint(0, vocab, (B, T), generator=g)
    attn = torch.zeros(B, T, dtype=torch.long)
    resp = torch.zeros(B, T, dtype=torch.bool)
    for i in range(B):
        p, r = int(prompt_len_B[i]), int(resp_len_B[i])
        attn[i, : p + r] = 1
        resp[i, p : p + r] = True
    return torch.where(attn.bool(), ids, 0), attn, resp
