"""Model FLOPs utilization (MFU): the dense-matmul FLOPs of a decoder's passes, and the device's peak.

What is counted, per sequence of ``L`` real tokens (padding is not work the model needs) of which ``R``
go through the LM head, forward, 2 FLOPs per multiply-add, with ``h`` hidden, ``I`` intermediate,
``n_q`` / ``n_kv`` query / key-value heads of ``d`` each (GQA), ``V`` vocabulary, ``n`` layers::

    dense     = n * L * 2 * (h * (n_q + 2 n_kv) d      q, k, v projections
                             + n_q d * h               output projection
                             + 3 h I)                  gated MLP: gate, up, down
    attention = n * 2 * n_q * d * L (L + 1)            Q K^T and the values, causal half (see below)
    lm_head   = 2 * h * V * R                          only the positions whose logprob is needed
    forward   = dense + attention + lm_head

- Attention: query ``i`` (0-based) attends to ``i + 1`` keys, so the score and value matmuls do
  ``2 * 2 * n_q * d * sum_i (i + 1) = 2 n_q d L (L + 1)`` FLOPs per layer: the causal half (exactly, with
  the diagonal). torchtitan (``12 * n * h * L`` per token, "we do not account for sparsity in causal
  attention") and PaLM (``6N + 12 n H Q T``) count the full ``L x L`` square, about twice this term.
  ``causal=False`` gives their count.
- The LM head runs only where a logprob is needed (spmdrl's forward skips the prompt's positions:
  ``R`` = the response tokens). The embedding is a lookup, not a matmul; biases, norms, rotary, softmax
  and the loss are elementwise: none counted. Sliding-window layers (Mistral, Gemma) are counted as full
  causal attention.
- Training (model FLOPs) = 3 x forward: the backward computes the gradients of both the activations and
  the weights, twice the forward's matmuls. Activation checkpointing recomputes a checkpointed decoder
  layer's forward in the backward (``full``: its ``dense + attention`` share; ``mlp``: its MLP's
  ``2 * 3 h I`` per token): hardware FLOPs = model FLOPs + that. MFU uses model FLOPs (the work the result
  needs, whatever the implementation), HFU hardware FLOPs.
- MFU = FLOPs / (seconds x devices x the device's peak): the dense bf16 tensor-core peak from
  ``PEAK_BF16_DENSE`` (no sparsity), whatever the training dtype. A device not in the table, or a CPU,
  has no peak: :func:`device_peak_flops` is None and no MFU is reported (not 0).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class DecoderShape:
    """What the FLOPs count depends on, read from a transformers decoder config."""

    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int

    @classmethod
    def from_hf_config(cls, config: Any) -> DecoderShape:
        """From an HF config (a multimodal one's text config); ``head_dim`` is hidden / heads where the
        config has none (Qwen2, Llama), its own where it has one (Qwen3, Gemma)."""
        if hasattr(config, "get_text_config"):
            config = config.get_text_config()
        heads = int(config.num_attention_heads)
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        return cls(
            layers=int(config.num_hidden_layers),
            hidden=int(config.hidden_size),
            intermediate=int(config.intermediate_size),
            heads=heads,
            kv_heads=int(getattr(config, "num_key_value_heads", None) or heads),
            head_dim=int(head_dim),
            vocab=int(config.vocab_size),
        )

    def dense_per_token(self) -> int:
        """Forward FLOPs of every decoder layer's projections and MLP, for one token."""
        h, d = self.hidden, self.head_dim
        qkv = h * (self.heads + 2 * self.kv_heads) * d
        out = self.heads * d * h
        mlp = 3 * h * self.intermediate
        return self.layers * 2 * (qkv + out + mlp)

    def attention(self, length: int, causal: bool = True) -> int:
        """Forward FLOPs of the score and value matmuls of one sequence of ``length`` tokens, all layers."""
        pairs2 = length * (length + 1) if causal else 2 * length * length  # 2 x (query, key) pairs
        return self.layers * 2 * self.heads * self.head_dim * pairs2

    def lm_head(self, positions: int) -> int:
        """Forward FLOPs of the LM head over ``positions`` positions."""
        return 2 * self.hidden * self.vocab * positions


@dataclass(frozen=True)
class PassFlops:
    """One pass's FLOPs: ``model`` (MFU's numerator) and ``hardware`` (with recomputation; HFU's)."""

    model: float
    hardware: float

    def __add__(self, other: PassFlops) -> PassFlops:
        return PassFlops(self.model + other.model, self.hardware + other.hardware)

    def __mul__(self, k: float) -> PassFlops:
        return PassFlops(self.model * k, self.hardware * k)


def _layers_and_head(
    shape: DecoderShape, tokens_B: Sequence[int], lm_positions_B: Sequence[int], causal: bool
) -> tuple[int, int]:
    if len(tokens_B) != len(lm_positions_B):
        raise ValueError(f"{len(tokens_B)} sequences' tokens but {len(lm_positions_B)} LM-head counts")
    layers = sum(shape.dense_per_token() * n + shape.attention(n, causal) for n in tokens_B)
    return layers, shape.lm_head(sum(lm_positions_B))


def forward_flops(
    shape: DecoderShape, tokens_B: Sequence[int], lm_positions_B: Sequence[int], causal: bool = True
) -> PassFlops:
    """A no-grad forward over sequences of ``tokens_B`` real tokens, the LM head on ``lm_positions_B``
    positions of each (their response tokens)."""
    layers, head = _layers_and_head(shape, tokens_B, lm_positions_B, causal)
    return PassFlops(layers + head, layers + head)


def training_flops(
    shape: DecoderShape,
    tokens_B: Sequence[int],
    lm_positions_B: Sequence[int],
    *,
    recompute: str = "off",
    every: int = 1,
    causal: bool = True,
) -> PassFlops:
    """Forward + backward (3 x the forward). Activation checkpointing (``recompute``: off, full, mlp, on
    every ``every``-th decoder layer, as spmdrl.models.parallelize.apply_ac chooses them) adds what it
    recomputes to the hardware count only: a whole layer's forward (full) or its MLP's (mlp)."""
    if recompute not in ("off", "full", "mlp") or every < 1:
        raise ValueError(f"recompute must be off, full or mlp and every >= 1, got {recompute!r}, {every}")
    layers, head = _layers_and_head(shape, tokens_B, lm_positions_B, causal)
    model = 3 * (layers + head)
    chosen = shape.layers // every  # layers every, 2 x every, ...
    extra = 0
    if recompute == "full":
        extra = layers // shape.layers * chosen  # every layer's FLOPs are the same
    elif recompute == "mlp":
        extra = 2 * 3 * shape.hidden * shape.intermediate * sum(tokens_B) * chosen
    return PassFlops(model, model + extra)


# Dense (no 2:4 sparsity) bf16 tensor-core peak per device, FLOP/s, by the name torch.cuda.get_device_name
# reports, first match wins (the more specific names first). NVIDIA's datasheets give the sparse figure
# with a footnote; dense is half of it.
PEAK_BF16_DENSE: tuple[tuple[str, float], ...] = (
    # H100 datasheet (nvidia.com/en-us/data-center/h100): BF16 1,979 TFLOPS SXM, 1,671 NVL, 1,513 PCIe, sparse.
    (r"h100.*nvl", 835.5e12),
    (r"h100.*pcie", 756.5e12),
    (r"h100", 989.5e12),  # "NVIDIA H100 80GB HBM3" (SXM5)
    # H200 datasheet (nvidia.com/en-us/data-center/h200): BF16 1,979 TFLOPS SXM, 1,671 NVL, sparse.
    # GH200's GPU is an H100/H200 SXM-class part (GH200 datasheet: 1,979 sparse).
    (r"h200.*nvl", 835.5e12),
    (r"h200", 989.5e12),
    # HGX B200 datasheet: 36 PFLOPS FP16/BF16 sparse for 8 GPUs: 2.25 dense per GPU.
    (r"\bb200\b", 2250e12),
    # A100 datasheet (nvidia.com/en-us/data-center/a100): BF16 312 TFLOPS dense, SXM and PCIe alike.
    (r"a100", 312e12),
    # L40S datasheet: BF16 362.05 TFLOPS dense (733 sparse); L40: 181.05 dense; L4: 121 dense (242 sparse).
    (r"l40s", 362.05e12),
    (r"\bl40\b", 181.05e12),
    (r"\bl4\b", 121e12),
    # AMD Instinct MI300X data sheet: 1,307.4 TFLOPS dense BF16 (ROCm reports "AMD Instinct MI300X").
    (r"mi300x", 1307.4e12),
)


def peak_flops(device_name: str) -> float | None:
    """The dense bf16 peak (FLOP/s) of a device named as torch.cuda.get_device_name names it; None if
    not in the table."""
    name = device_name.lower()
    for pattern, flops in PEAK_BF16_DENSE:
        if re.search(pattern, name):
            return flops
    return None


def device_peak_flops(device: torch.device) -> float | None:
    """The peak of ``device``'s model; None on a CPU (no tensor-core peak to divide by) or an unknown GPU."""
    if device.type != "cuda":
        return None
    return peak_flops(torch.cuda.get_device_name(device))


def utilization(flops: float, seconds: float, devices: int, peak: float | None) -> float | None:
    """``flops / (seconds x devices x peak)``; None without a peak or a time."""
    if peak is None or seconds <= 0 or devices <= 0:
        return None
    return flops / (seconds * devices * peak)
