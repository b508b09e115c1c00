"""LoRA: low-rank adapters on a model's linear layers, trained while the base weights stay frozen.

:func:`apply_lora` replaces each target ``nn.Linear`` of an HF model (built on the meta device, before
FSDP2 shards it) by a :class:`LoraLinear` that keeps the base layer's ``weight`` / ``bias`` under their
own names (so the base checkpoint loads unchanged) and adds ``lora_A`` (rank x in) and ``lora_B``
(out x rank), PEFT's names and shapes. The layer computes ``x W^T + b + scale * B(A(dropout(x)))`` with
``scale = alpha / rank``; B starts at zero, so the adapted model starts as the base model.

The engine never sees an adapter: the weight sync and the export send ``W + scale * B A``
(:func:`merge_weights`, :func:`merge_state_dict`), under the base model's names.

:func:`adapters_disabled` runs a model as its frozen base (every adapter off, nothing copied): under LoRA
that is the KL term's reference (spmdrl.rl.reference).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn

from spmdrl.errors import ConfigError
from spmdrl.models.config import LoraConfig

ALL_LINEAR = "all-linear"
# The parameter names an adapter adds to a target module (PEFT's, without its ".default" adapter name).
ADAPTER_SUFFIXES = (".lora_A.weight", ".lora_B.weight")
# Activation checkpointing's wrapper in parameter paths (spmdrl.models.parallelize.apply_ac).
_AC_PART = "_checkpoint_wrapped_module."


class LoraLinear(nn.Module):
    """A frozen ``nn.Linear``'s weight and bias plus a trainable low-rank update."""

    def __init__(self, base: nn.Linear, rank: int, alpha: float, dropout: float) -> None:
        super().__init__()
        self.in_features, self.out_features = base.in_features, base.out_features
        # The base layer's own Parameter objects, under the same names: the checkpoint keys do not change.
        self.weight = base.weight
        self.bias = base.bias
        device = base.weight.device
        self.lora_A = nn.Linear(base.in_features, rank, bias=False, device=device)
        self.lora_B = nn.Linear(rank, base.out_features, bias=False, device=device)
        self.scale = alpha / rank
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        # False inside adapters_disabled(): the layer is its base linear alone. A plain attribute, read at
        # each call (torch.compile guards on it), so FSDP2 and checkpoint wrappers need not know of it.
        self.adapter_on = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # The base product first and alone, as nn.Linear computes it: with the adapter off the output is
        # bitwise the base model's.
        base = F.linear(x, self.weight, self.bias)
        if not self.adapter_on:
            return base
        return base + self.lora_B(self.lora_A(self.dropout(x))) * self.scale

    def extra_repr(self) -> str:
        return (
            f"in={self.in_features}, out={self.out_features}, rank={self.lora_A.out_features}, "
            f"scale={self.scale:g}"
        )


@contextmanager
def adapters_disabled(model: nn.Module) -> Iterator[None]:
    """Every LoraLinear of ``model`` computes its base layer only inside the block: the model is its frozen
    base, with no weight copied (FSDP2 still gathers the adapters' shards with their layer; they go unused).
    Each layer's previous state comes back on leaving, an exception included. Under activation
    checkpointing the recomputation reads the state at backward time: backpropagate inside the block too
    (the reference's passes are no-grad and recompute nothing). A model without LoRA raises ValueError."""
    layers = [m for m in model.modules() if isinstance(m, LoraLinear)]
    if not layers:
        raise ValueError(f"adapters_disabled: {type(model).__name__} has no LoRA adapters")
    previous = [m.adapter_on for m in layers]
    for m in layers:
        m.adapter_on = False
    try:
        yield
    finally:
        for m, on in zip(layers, previous, strict=True):
            m.adapter_on = on


def linear_module_names(model: nn.Module) -> list[str]:
    """The distinct last names of the model's linear layers that LoRA may target (the LM head excluded)."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    names = {
        name.rsplit(".", 1)[-1]
        for name, mod in model.named_modules()
        if isinstance(mod, nn.Linear) and mod is not head and name
    }
    return sorted(names)


def _targets(model: nn.Module, target_modules: list[str]) -> list[str]:
    """Paths of the linear modules ``target_modules`` selects; an unknown name raises ConfigError."""
    available = linear_module_names(model)
    wanted = set(available) if ALL_LINEAR in target_modules else set(target_modules)
    unknown = sorted(wanted - set(available))
    if unknown:
        raise ConfigError(
            f"model.lora.target_modules: {unknown} name no linear module of {type(model).__name__}; "
            f"its linear modules are {available} (or use [{ALL_LINEAR}])"
        )
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    return [
        name
        for name, mod in model.named_modules()
        if isinstance(mod, nn.Linear) and mod is not head and name.rsplit(".", 1)[-1] in wanted
    ]


def apply_lora(model: nn.Module, cfg: LoraConfig) -> list[str]:
    """Wrap the target linears in LoraLinear and freeze everything but the adapters; returns the wrapped
    paths. Call it on the meta-device model, before activation checkpointing and FSDP2 (FSDP2 reads which
    parameters require gradients when it shards them)."""
    paths = _targets(model, list(cfg.target_modules))
    for path in paths:
        parent_path, _, attr = path.rpartition(".")
        parent = model.get_submodule(parent_path) if parent_path else model
        setattr(parent, attr, LoraLinear(getattr(parent, attr), cfg.rank, cfg.alpha, cfg.dropout))
    for name, p in model.named_parameters():
        p.requires_grad_(is_adapter_param(name))
    return paths


def is_adapter_param(name: str) -> bool:
    return name.endswith(ADAPTER_SUFFIXES)


def lora_scale(model: nn.Module) -> float | None:
    """The adapters' alpha / rank (one LoraConfig adapts a model), or None for a model without LoRA."""
    for mod in model.modules():
        if isinstance(mod, LoraLinear):
            return mod.scale
    return None


def initial_adapter_weights(model: nn.Module, seed: int) -> dict[str, torch.Tensor]:
    """Full-shape starting values of every adapter parameter, by checkpoint name: A as PEFT draws it
    (kaiming-uniform), B zero. From a generator seeded alike on every rank, so the shards each rank cuts
    out of these tensors make one consistent model."""
    gen = torch.Generator().manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    for name, p in model.named_parameters():
        if not is_adapter_param(name):
            continue
        key = name.replace(_AC_PART, "")
        if key.endswith(".lora_B.weight"):
            out[key] = torch.zeros(p.shape)
        else:  # nn.init.kaiming_uniform_(a=sqrt(5)) of an nn.Linear: U(-1/sqrt(in), 1/sqrt(in))
            bound = 1.0 / math.sqrt(p.shape[1])
            out[key] = torch.empty(p.shape).uniform_(-bound, bound, generator=gen)
    return out


def merged(weight: torch.Tensor, lora_A: torch.Tensor, lora_B: torch.Tensor, scale: float) -> torch.Tensor:
    """W + scale * B A, computed in float32 and returned in W's dtype."""
    delta = (lora_B.float() @ lora_A.float()) * scale
    return (weight.float() + delta).to(weight.dtype)


def merge_weights(
    named: Iterable[tuple[str, torch.Tensor]], adapted: set[str], scale: float
) -> Iterator[tuple[str, torch.Tensor]]:
    """A stream of full tensors with adapters -> the same stream with each adapted weight merged.

    ``adapted``: the ``<m>.weight`` names that carry an adapter (:func:`adapted_weight_names`).
    Parameters come in module order, so an adapted ``<m>.weight`` is followed by ``<m>.lora_A.weight`` and
    ``<m>.lora_B.weight``: it is held until both arrived (one module's weight at most), then sent merged
    under its own name, followed by the module's bias. Everything else passes through, so the names and
    their order are the base model's."""
    held: dict[str, torch.Tensor] = {}
    # The adapted module's other tensors (its bias), sent after the merged weight: the base model's order,
    # which a split placement's receivers expect (they know the base model only).
    after: list[tuple[str, torch.Tensor]] = []
    module = ""
    for name, t in named:
        if name in adapted:
            held[name], module = t, name.removesuffix("weight")
        elif name.endswith(".lora_A.weight"):
            held[name] = t
        elif name.endswith(".lora_B.weight"):
            m = name.removesuffix(".lora_B.weight")
            weight, lora_A = held.pop(m + ".weight"), held.pop(m + ".lora_A.weight")
            yield m + ".weight", merged(weight, lora_A, t, scale)
            yield from after
            after, module = [], ""
        elif module and name.startswith(module):
            after.append((name, t))
        else:
            yield name, t
    if held:
        raise RuntimeError(f"LoRA merge: tensors without their adapter pair: {sorted(held)[:4]}")


def adapted_weight_names(names: Iterable[str]) -> set[str]:
    """The ``<m>.weight`` names whose module carries an adapter, from a list of parameter names."""
    return {n.removesuffix(".lora_A.weight") + ".weight" for n in names if n.endswith(".lora_A.weight")}


def merge_state_dict(state: dict[str, torch.Tensor], scale: float) -> dict[str, torch.Tensor]:
    """A full state dict with adapters -> the base model's state dict with each adapted weight merged."""
    out = {k: v for k, v in state.items() if not is_adapter_param(k)}
    for w in adapted_weight_names(state):
        m = w.removesuffix(".weight")
        out[w] = merged(state[w], state[m + ".lora_A.weight"], state[m + ".lora_B.weight"], scale)
    return out


def adapter_module_names(names: Iterable[str]) -> list[str]:
    """Sorted distinct last names of the adapted modules (PEFT's target_modules)."""
    suffix = ".lora_A.weight"
    return sorted({n.removesuffix(suffix).rsplit(".", 1)[-1] for n in names if n.endswith(suffix)})
