"""Causal SDPA without transformers' mask building: nothing read from the device, and flash kernels for
padded rows.

For an SDPA model transformers builds each forward's mask from the call's 2-D mask and position ids, and
reads device values to do it: with no mask, whether the position ids restart
(``find_packed_sequence_indices``, an ``.all()``), with a 2-D mask whether it has padding. On a GPU each
read is a host-device sync per forward. And a padded micro-batch reaches SDPA as a boolean mask, which
rules out its flash kernel (the memory-efficient or math kernel runs instead, and the mask takes T^2
bytes per row).

spmdrl's rows are right-padded, with their lengths on the host (spmdrl.rl.batch.RowLengths). For every
real token a causal mask is exact: its keys are itself and the tokens before it, never the padding after
the row's end. So the trainer's forwards need no mask at all (:func:`spmdrl.models.forward.attention_mask_for`
gives None) and SDPA takes ``is_causal``. Padding positions attend to other padding; their outputs are
never read (the LM head runs on scored positions only).

:data:`CAUSAL_SDPA` is transformers' SDPA attention function registered under a name of its own, which
transformers' mask interface does not know: for it, transformers skips mask building altogether, passing
a 4-D mask (packed rows' block-diagonal one) through unchanged and anything else as None. A 2-D mask
would then be dropped, so :func:`use_causal_sdpa` also installs a forward pre-hook that turns one into the
4-D mask (causal, real keys only, and each position itself, so that a left-padding position attends to
something rather than giving NaN), on the device and reading nothing: a caller that passes a 2-D mask keeps
its meaning, padding on either side. Scoring passes only: a call with a KV cache (generation) is refused,
since the mask would need the cache's length. The RL models (actor, reference, critic) are switched;
SFT's model, which generates at validation, and the reward model are not.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

CAUSAL_SDPA = "spmdrl_causal_sdpa"
AttentionInterface.register(CAUSAL_SDPA, sdpa_attention_forward)


def full_attention_sdpa(config: object) -> bool:
    """Whether every layer of a model with this config attends fully (no sliding window, no chunks) with
    SDPA, transformers' own or :data:`CAUSAL_SDPA`: the models whose masks spmdrl may build itself."""
    if getattr(config, "_attn_implementation", None) not in ("sdpa", CAUSAL_SDPA):
        return False
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        return all(t == "full_attention" for t in layer_types)
    return (
        getattr(config, "sliding_window", None) is None
        and getattr(config, "attention_chunk_size", None) is None
    )


def use_causal_sdpa(model: nn.Module) -> bool:
    """Switch ``model`` (a transformers model, before or after FSDP2) to :data:`CAUSAL_SDPA` where its
    layers all attend fully with SDPA, with the pre-hook that keeps a 2-D mask's meaning. Returns whether
    it did; any other model is left as it is."""
    config = getattr(model, "config", None)
    if config is None or not full_attention_sdpa(config):
        return False
    if config._attn_implementation != CAUSAL_SDPA:
        # On the config, which every attention layer reads at each call (as spmdrl.models.varlen does).
        config._attn_implementation = CAUSAL_SDPA
        model.register_forward_pre_hook(_mask_to_4d, with_kwargs=True)
    return True


def uses_causal_sdpa(model: nn.Module) -> bool:
    return getattr(getattr(model, "config", None), "_attn_implementation", None) == CAUSAL_SDPA


def causal_key_mask(attention_mask_BT: torch.Tensor) -> torch.Tensor:
    """(B, 1, T, T) boolean: query t attends to key s when s <= t and s is a real token, and always to
    itself (a padding query with no real key before it would otherwise give NaN, which later layers would
    carry into every key that reads it through a zero weight)."""
    T = attention_mask_BT.shape[1]
    pos_T = torch.arange(T, device=attention_mask_BT.device)
    causal_TT = pos_T[None, :] <= pos_T[:, None]  # key <= query
    self_TT = pos_T[None, :] == pos_T[:, None]
    return (causal_TT[None, None] & attention_mask_BT.bool()[:, None, None, :]) | self_TT[None, None]


def _mask_to_4d(
    module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """A 2-D mask in the call becomes its 4-D causal form (which transformers passes through)."""
    if kwargs.get("past_key_values") is not None or kwargs.get("use_cache"):
        raise ValueError(
            f"{type(module).__name__} attends with {CAUSAL_SDPA} (spmdrl.models.causal_attention), which "
            "serves scoring passes only: call it without a KV cache (use_cache=False)"
        )
    if len(args) > 1 and isinstance(args[1], torch.Tensor) and args[1].dim() == 2:
        args = (args[0], causal_key_mask(args[1]), *args[2:])
    mask = kwargs.get("attention_mask")
    if isinstance(mask, torch.Tensor) and mask.dim() == 2:
        kwargs = {**kwargs, "attention_mask": causal_key_mask(mask)}
    return args, kwargs
