"""Mixture-of-experts weights: the checkpoint's per-expert layout and the trainer's fused one.

A Hugging Face MoE checkpoint (Qwen3-MoE) stores each expert's MLP as three matrices,
``mlp.experts.<e>.gate_proj.weight`` (I x H), ``up_proj.weight`` (I x H) and ``down_proj.weight`` (H x I).
transformers 5 builds the experts as two 3-D parameters per layer, ``mlp.experts.gate_up_proj`` (E x 2I x H,
each expert's gate rows above its up rows) and ``mlp.experts.down_proj`` (E x H x I), and converts between
the two when it loads and saves. spmdrl reads safetensors itself (spmdrl.models.build), syncs the engine
with the checkpoint's names and exports in the checkpoint's layout, so it converts at those three places
with the functions here. Pure tensor reshuffles: no torch.distributed, no transformers.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator

import torch

# transformers' fused parameters, by the name's tail.
FUSED_GATE_UP = "mlp.experts.gate_up_proj"
FUSED_DOWN = "mlp.experts.down_proj"
# One expert's matrix in the checkpoint: (prefix up to "mlp.experts.", expert, projection).
_PER_EXPERT = re.compile(r"^(.*mlp\.experts\.)(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


def is_fused(name: str) -> bool:
    return name.endswith((FUSED_GATE_UP, FUSED_DOWN))


def expert_of(name: str) -> tuple[int, str] | None:
    """(expert index, "gate_up" or "down") of a per-expert checkpoint name, None for any other name."""
    found = matrix_of(name)
    if found is None:
        return None
    _, e, proj = found
    return e, "down" if proj == "down_proj" else "gate_up"


def matrix_of(name: str) -> tuple[str, int, str] | None:
    """(prefix up to "mlp.experts.", expert index, "gate_proj" / "up_proj" / "down_proj") of a per-expert
    checkpoint name, None for any other name."""
    m = _PER_EXPERT.match(name)
    return None if m is None else (m.group(1), int(m.group(2)), m.group(3))


def split_fused(name: str, t: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
    """A fused expert tensor as the checkpoint's per-expert matrices (views, in expert order); any other
    tensor unchanged."""
    if name.endswith(FUSED_GATE_UP):
        prefix = name.removesuffix("gate_up_proj")
        inter = t.shape[1] // 2
        for e in range(t.shape[0]):
            yield f"{prefix}{e}.gate_proj.weight", t[e, :inter]
            yield f"{prefix}{e}.up_proj.weight", t[e, inter:]
    elif name.endswith(FUSED_DOWN):
        prefix = name.removesuffix("down_proj")
        for e in range(t.shape[0]):
            yield f"{prefix}{e}.down_proj.weight", t[e]
    else:
        yield name, t


def split_all(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """:func:`split_fused` over a stream (the weight sync's, the export's)."""
    for name, t in weights:
        yield from split_fused(name, t)


def to_checkpoint_layout(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A state dict with fused experts as the checkpoint's per-expert matrices (what transformers saves and
    loads). A state dict without fused experts comes back as is."""
    if not any(is_fused(k) for k in state):
        return state
    # Copies: a safetensors file cannot hold views of a larger tensor.
    return {k: v.contiguous() for k, v in split_all(state.items())}


def to_model_layout(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A checkpoint's per-expert matrices stacked into transformers' fused parameters; every other tensor
    (and a checkpoint that already stores fused experts) unchanged. Raises ValueError on a layer whose
    experts are incomplete (a missing index or projection), naming it."""
    per_layer: dict[str, dict[tuple[int, str], torch.Tensor]] = {}
    out: dict[str, torch.Tensor] = {}
    for k, v in state.items():
        found = matrix_of(k)
        if found is None:
            out[k] = v
        else:
            prefix, e, proj = found
            per_layer.setdefault(prefix, {})[(e, proj)] = v
    for prefix, mats in per_layer.items():
        n = 1 + max(e for e, _ in mats)
        want = {(e, p) for e in range(n) for p in ("gate_proj", "up_proj", "down_proj")}
        if missing := sorted(want - mats.keys()):
            shown = ", ".join(f"{prefix}{e}.{p}.weight" for e, p in missing[:4])
            raise ValueError(f"incomplete experts in the checkpoint: missing {shown}")
        out[prefix + "gate_up_proj"] = torch.stack(
            [torch.cat([mats[(e, "gate_proj")], mats[(e, "up_proj")]]) for e in range(n)]
        )
        out[prefix + "down_proj"] = torch.stack([mats[(e, "down_proj")] for e in range(n)])
    return out
