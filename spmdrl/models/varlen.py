"""Varlen attention for packed rows: each sequence attends within its own segment, with no (R, 1, C, C) mask.

Packed rows (spmdrl/models/packing.py) attend by default through a dense block-diagonal mask passed to
SDPA: C^2 memory per row, and on a GPU no flash kernel (SDPA's flash path takes no mask). With
``trainer.packed_attention`` resolved to varlen, the trainer's models run :func:`varlen_attention_forward`,
registered in transformers' AttentionInterface as :data:`VARLEN`: the packed forward passes the segments'
boundaries (``Packed.cu_seqlens_S1``, built on the host by ``pack``: nothing is read from the device) as
transformers' FlashAttentionKwargs, and the function runs one kernel over the flattened R * C tokens.

Which kernel (:func:`choose_kernel`, a pure function of :class:`Capabilities` and :class:`Features`):

- CUDA: ``torch.nn.attention.varlen.varlen_attn`` where the installed torch has it and the model needs
  nothing it lacks (soft-capping; a sliding window when it takes no ``window_size``); else flash_attn's
  ``flash_attn_varlen_func`` if it imports; else flex attention with a block mask from the segments;
  else the mask path.
- CPU (and other devices), only when asked for (``varlen``): an exact reference, causal SDPA per segment
  (an eager softmax where the scores are soft-capped), which costs the sum of n_i^2 instead of C^2.
- Attention dropout (every kernel here is dropout-free): the mask path.

The mask path is the model's own attention implementation, left as it was; the reason is logged once.
Called without boundaries (a padded forward, the critic's packed forward with its mask), the function
attends with the mask it is given, or causally without one (exact for right-padded rows' real tokens).
"""

from __future__ import annotations

import importlib
import inspect
import logging
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache
from typing import Any

import torch
from torch import nn
from transformers import AttentionInterface

from spmdrl.models.packing import Packed

log = logging.getLogger("spmdrl")

# The name the trainer's models carry as their attention implementation when packed rows attend varlen.
VARLEN = "spmdrl_varlen"

KERNELS = ("torch_varlen", "flash_attn", "flex", "reference", "mask")


@dataclass(frozen=True)
class Capabilities:
    """What the process can run (:func:`capabilities` detects it; tests build it by hand)."""

    device_type: str
    # torch.nn.attention.varlen.varlen_attn imports, and whether it takes a window_size (sliding windows).
    torch_varlen: bool = False
    torch_varlen_window: bool = False
    flash_attn: bool = False
    flash_attn_softcap: bool = False
    flex: bool = False


@dataclass(frozen=True)
class Features:
    """What a model's attention needs beyond causal attention. GQA and the scale are not listed: every
    kernel here takes them (fewer key/value heads, or heads repeated; a scale argument)."""

    sliding_window: bool = False
    softcap: bool = False
    dropout: bool = False
    # The compute dtype is float16/bfloat16 (the flash kernels take nothing else).
    half_precision: bool = True


@dataclass(frozen=True)
class Choice:
    kernel: str  # one of KERNELS
    reason: str


def choose_kernel(setting: str, packed: bool, caps: Capabilities, features: Features) -> Choice:
    """The kernel packed rows attend with under ``trainer.packed_attention=setting``; "mask" keeps the
    model's own attention and its block-diagonal mask."""
    if setting == "mask" or not packed:
        return Choice("mask", "trainer.packed_attention=mask" if packed else "trainer.pack_sequences=false")
    if features.dropout:
        return Choice("mask", "the model's attention_dropout > 0 and no varlen kernel here applies dropout")
    if caps.device_type != "cuda":
        if setting == "varlen":
            return Choice("reference", f"on {caps.device_type}: exact causal attention per segment")
        return Choice("mask", f"auto on {caps.device_type}: varlen kernels are CUDA's")
    window_ok = not features.sliding_window or caps.torch_varlen_window
    if caps.torch_varlen and features.half_precision and not features.softcap and window_ok:
        return Choice("torch_varlen", "torch.nn.attention.varlen.varlen_attn")
    if caps.flash_attn and features.half_precision and (caps.flash_attn_softcap or not features.softcap):
        return Choice("flash_attn", "flash_attn.flash_attn_varlen_func")
    if caps.flex:
        return Choice("flex", "flex attention with a block mask from the segments")
    return Choice("mask", "no varlen kernel on CUDA for this model (torch's varlen_attn, flash_attn, flex)")


@cache
def capabilities(device_type: str) -> Capabilities:
    """What this process's torch (and flash_attn, if installed) offers on ``device_type``: detected, never
    assumed from a version (torch 2.11's varlen_attn takes fewer arguments than later releases')."""
    if device_type != "cuda":
        return Capabilities(device_type)
    params = _signature("torch.nn.attention.varlen", "varlen_attn")
    fa_params = _signature("flash_attn", "flash_attn_varlen_func")
    flex = _signature("torch.nn.attention.flex_attention", "flex_attention") is not None
    # A varlen_attn that can be told neither is_causal nor a window would attend both ways: not usable.
    causal = params is not None and ("window_size" in params or "is_causal" in params)
    return Capabilities(
        device_type,
        torch_varlen=causal,
        torch_varlen_window=params is not None and "window_size" in params,
        flash_attn=fa_params is not None,
        flash_attn_softcap=fa_params is not None and "softcap" in fa_params,
        flex=flex,
    )


def _signature(module: str, name: str) -> Sequence[str] | None:
    """The parameter names of ``module.name``, or None where it does not import (flash_attn built for
    another torch raises more than ImportError)."""
    try:
        fn = getattr(importlib.import_module(module), name)
    except Exception:  # noqa: BLE001 - any failure to import means the kernel is not there
        return None
    return tuple(inspect.signature(fn).parameters)


def features_of(config: Any, dtype: torch.dtype) -> Features:
    """:class:`Features` of a transformers config, computing in ``dtype``."""
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        sliding = any(t != "full_attention" for t in layer_types)
    else:
        sliding = getattr(config, "sliding_window", None) is not None
    return Features(
        sliding_window=sliding,
        softcap=getattr(config, "attn_logit_softcapping", None) is not None,
        dropout=float(getattr(config, "attention_dropout", 0.0) or 0.0) > 0.0,
        half_precision=dtype in (torch.float16, torch.bfloat16),
    )


def apply_packed_attention(
    model: nn.Module, setting: str, *, packed: bool, device: torch.device, dtype: torch.dtype
) -> Choice:
    """Switch ``model`` to :data:`VARLEN` attention where :func:`choose_kernel` picks a varlen kernel;
    logs the choice (and why, when it stays on the mask path). ``dtype``: the compute dtype."""
    choice = choose_kernel(setting, packed, capabilities(device.type), features_of(model.config, dtype))
    if choice.kernel != "mask":
        # On the config, which every attention layer reads at each call: transformers' own
        # set_attn_implementation refuses a class it cannot find the source of (FSDP2's wrapper classes).
        model.config._attn_implementation = VARLEN
    if packed:
        log.info("packed rows attend with %s (%s)", choice.kernel, choice.reason)
    return choice


def uses_varlen(model: nn.Module) -> bool:
    config = getattr(model, "config", None)
    return getattr(config, "_attn_implementation", None) == VARLEN


def varlen_kwargs(p: Packed) -> dict[str, Any]:
    """The model call's keyword arguments that carry ``p``'s segments to :func:`varlen_attention_forward`
    (transformers forwards them to the attention function, through activation checkpointing's recompute)."""
    return {
        "cu_seq_lens_q": p.cu_seqlens_S1,
        "cu_seq_lens_k": p.cu_seqlens_S1,
        "max_length_q": p.max_seqlen,
        "max_length_k": p.max_seqlen,
        "cu_seqlens_host": p.cu_seqlens_host,
    }


def varlen_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    cu_seq_lens_q: torch.Tensor | None = None,
    max_length_q: int | None = None,
    cu_seqlens_host: Sequence[int] | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention function signature: query (R, Hq, C, D), key and value (R, Hkv, C, D);
    returns (R, C, Hq, D). With ``cu_seq_lens_q`` the R * C tokens attend within their segments."""
    if dropout:
        raise ValueError(
            "varlen attention applies no dropout (spmdrl.models.varlen.choose_kernel refuses it)"
        )
    R, Hq, C, D = query.shape
    scale = D**-0.5 if scaling is None else scaling
    if cu_seq_lens_q is None:
        out = masked_attention(query, key, value, attention_mask, scale, sliding_window, softcap)
        return out.transpose(1, 2).contiguous(), None
    q, k, v = (t.transpose(1, 2).reshape(R * C, t.shape[1], D) for t in (query, key, value))
    features = features_of(module.config, query.dtype)
    kernel = choose_kernel("varlen", True, capabilities(query.device.type), features).kernel
    cu, max_len = cu_seq_lens_q, int(max_length_q or C)
    if kernel == "torch_varlen":
        out = _torch_varlen(q, k, v, cu, max_len, scale, sliding_window)
    elif kernel == "flash_attn":
        from flash_attn import flash_attn_varlen_func

        out = flash_attn_varlen_func(
            q,
            k,
            v,
            cu,
            cu,
            max_len,
            max_len,
            softmax_scale=scale,
            causal=True,
            window_size=(sliding_window - 1, 0) if sliding_window else (-1, -1),
            **({"softcap": softcap} if softcap else {}),
        )
    elif kernel == "flex":
        out = flex_varlen(q, k, v, cu, scale, sliding_window, softcap)
    else:
        host = list(cu_seqlens_host) if cu_seqlens_host is not None else cu.tolist()
        out = reference_varlen(q, k, v, host, scale, sliding_window, softcap)
    return out.view(R, C, Hq, D), None


AttentionInterface.register(VARLEN, varlen_attention_forward)


def _torch_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu: torch.Tensor,
    max_len: int,
    scale: float,
    window: int | None,
) -> torch.Tensor:
    """torch's varlen_attn, with the arguments this torch's signature takes (2.11's has no window_size,
    scale or enable_gqa: causal by is_causal, the scale folded into the queries, the heads repeated)."""
    from torch.nn.attention.varlen import varlen_attn

    params = inspect.signature(varlen_attn).parameters
    kw: dict[str, Any] = {}
    if "window_size" in params:
        kw["window_size"] = (window - 1, 0) if window else (-1, 0)
    else:
        kw["is_causal"] = True
    if "scale" in params:
        kw["scale"] = scale
    else:
        q = q * (scale * q.shape[-1] ** 0.5)
    if k.shape[1] != q.shape[1]:
        if "enable_gqa" in params:
            kw["enable_gqa"] = True
        else:
            k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
    return varlen_attn(q, k, v, cu, cu, max_len, max_len, **kw)


def flex_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu: torch.Tensor,
    scale: float,
    window: int | None,
    softcap: float | None,
) -> torch.Tensor:
    """Flex attention over the flattened tokens (T, H, D) with a block mask from the segments of ``cu``
    (each token's segment found on the device: no read). On CUDA compiled: uncompiled, flex materializes
    the whole T x T score matrix (as on CPU, where the tests run it)."""
    from torch.nn.attention.flex_attention import flex_attention

    def score_mod(score: Any, b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return softcap * torch.tanh(score / softcap)

    attend = _compiled_flex() if q.is_cuda else flex_attention
    out = attend(
        *(t.transpose(0, 1)[None] for t in (q, k, v)),
        score_mod=score_mod if softcap else None,
        block_mask=_segment_block_mask(cu, q.shape[0], window),
        scale=scale,
        enable_gqa=k.shape[1] != q.shape[1],
    )
    return out[0].transpose(0, 1)


@cache
def _compiled_flex() -> Any:
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=True)


# The last block mask built, for the same boundaries: every layer of one forward (and its recompute under
# activation checkpointing) gets the same ``cu`` object, a new micro-batch a new one (hence a weak
# reference to the object, never its address).
_last_mask: tuple[weakref.ref, int, int | None, Any] | None = None


def _segment_block_mask(cu: torch.Tensor, T: int, window: int | None) -> Any:
    global _last_mask
    from torch.nn.attention.flex_attention import create_block_mask

    if _last_mask is not None and _last_mask[0]() is cu and _last_mask[1:3] == (T, window):
        return _last_mask[3]
    seg_T = torch.searchsorted(cu[1:], torch.arange(T, device=cu.device, dtype=cu.dtype), right=True)

    def mask_mod(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        m = (seg_T[q_idx] == seg_T[kv_idx]) & (kv_idx <= q_idx)
        return m & (q_idx - kv_idx < window) if window else m

    block_mask = create_block_mask(mask_mod, None, None, T, T, device=cu.device, _compile=cu.is_cuda)
    _last_mask = (weakref.ref(cu), T, window, block_mask)
    return block_mask


def reference_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu: Sequence[int],
    scale: float,
    window: int | None,
    softcap: float | None,
) -> torch.Tensor:
    """Exact: each segment of the flattened tokens (T, H, D) attends causally on its own (sum of n_i^2),
    segments of one length in one batched call (a micro-batch of rows holding one sequence each is one
    call per layer). Split and unbound, not sliced: a slice's backward writes zeros of the whole input."""
    sizes = [b - a for a, b in zip(cu[:-1], cu[1:], strict=True)]
    pieces = [t.split(sizes) for t in (q, k, v)]
    by_length: dict[int, list[int]] = {}
    for i, n in enumerate(sizes):
        if n > 0:
            by_length.setdefault(n, []).append(i)
    outs: dict[int, torch.Tensor] = {}
    for idx in by_length.values():
        q_G, k_G, v_G = (torch.stack([p[i] for i in idx]).transpose(1, 2) for p in pieces)  # (G, H, n, D)
        out_G = masked_attention(q_G, k_G, v_G, None, scale, window, softcap)
        outs.update(zip(idx, out_G.unbind(0), strict=True))
    return torch.cat([outs[i] for i in sorted(outs)], dim=1).transpose(0, 1)


def masked_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    window: int | None,
    softcap: float | None,
) -> torch.Tensor:
    """(B, Hq, S, D) attention under a 4-D mask (boolean or additive), causal without one, with the sliding
    window and soft-capping transformers' eager attention applies: SDPA where it can (no soft-capping)."""
    S = query.shape[2]
    n_rep = query.shape[1] // key.shape[1]
    if mask is None and (not window or window >= S) and softcap is None:
        return nn.functional.scaled_dot_product_attention(
            query, key, value, is_causal=True, scale=scale, enable_gqa=n_rep > 1
        )
    pos = torch.arange(S, device=query.device)
    allowed = pos[None, :] <= pos[:, None]
    if window:
        allowed = allowed & (pos[:, None] - pos[None, :] < window)
    bias = torch.zeros((S, S), dtype=query.dtype, device=query.device)
    if mask is not None and mask.dtype == torch.bool:
        allowed = allowed & mask
    elif mask is not None:
        bias = mask
    if softcap is None:
        bias = bias.masked_fill(~allowed, float("-inf"))
        return nn.functional.scaled_dot_product_attention(
            query, key, value, attn_mask=bias, scale=scale, enable_gqa=n_rep > 1
        )
    key, value = (t.repeat_interleave(n_rep, dim=1) for t in (key, value))
    scores = torch.matmul(query, key.transpose(2, 3)) * scale
    scores = softcap * torch.tanh(scores / softcap) + bias
    scores = scores.masked_fill(~allowed, float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    return torch.matmul(probs, value)
