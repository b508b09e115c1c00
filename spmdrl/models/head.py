"""A causal LM's head run on chosen positions only, inside the model's own forward.

:func:`head_on_positions` calls the model so that its decoder gives the last hidden states, takes the
rows of the positions asked for, and runs the LM head (and the log-softmax, entropy, sum of squared
probabilities) on them alone; the model's own head computes nothing (``logits_to_keep`` is an empty
index). The head runs in a forward hook on the decoder, that is inside the root module's forward:
under FSDP2 the root unit (embeddings, final norm, LM head; tied weights stay one parameter) is
all-gathered by the root's pre-forward hook, so the head reads the full weight, and its gradient reaches
the unsharded parameter, which the root's post-backward reduce-scatters like any other. The root is not
resharded after forward (spmdrl.models.parallelize.apply_fsdp), so the weight a chunked backward
recomputes from is still there.

Plain (``chunk_tokens`` 0): the N x V logits at once, then spmdrl.algos.losses; fused: spmdrl.models.
fused_logprob. Gemma's final logit soft-capping is applied as transformers applies it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from spmdrl.algos.losses import entropy_from_logits, sum_pi_squared_from_logits, token_logprobs
from spmdrl.models.config import ModelConfig
from spmdrl.models.fused_logprob import HeadOut, fused_head
from spmdrl.models.parallelize import through_outputs

# A vision-language model's image tokens (spmdrl.data.vision.image_token_ids), which the engine never
# samples (its allowed tokens leave them out, and its logprobs are of that distribution): a LongTensor set on
# the model where it is built (spmdrl.models.build), whose logits the head sets to BANNED_LOGIT, so that the
# trainer scores the same distribution. Finite, not -inf: an entropy's p log p is then 0, not nan.
BANNED_TOKENS = "spmdrl_banned_token_ids"
BANNED_LOGIT = -1.0e9


def fused_chunk_for(cfg: ModelConfig, model: nn.Module) -> int:
    """policy_forward's ``fused_chunk_tokens`` for ``model`` under model.use_fused_kernels
    (ModelConfig.fused_head_chunk, from its vocabulary): 0 for the plain head."""
    # (A vision-language model's vocabulary is its decoder's: the text config.)
    return cfg.fused_head_chunk(int(model.config.get_text_config().vocab_size))


def head_on_positions(
    model: nn.Module,
    call: Callable[..., Any],
    call_kwargs: dict[str, Any],
    source_N: torch.Tensor,
    target_ids_N: torch.Tensor,
    *,
    temperature: float,
    with_entropy: bool,
    entropy_grad: bool,
    with_sum_pi_squared: bool,
    chunk_tokens: int,
) -> HeadOut:
    """``call(**call_kwargs, logits_to_keep=<none>)`` (``model`` itself, or a wrapper that calls it), and the
    head on the decoder's last hidden states at the flat positions ``source_N`` (into its (R, C) output)
    scoring ``target_ids_N``: float32 per position (N,)."""
    found: list[HeadOut] = []

    def on_decoder_output(_module: nn.Module, _args: Any, output: Any) -> None:
        h = output.last_hidden_state if hasattr(output, "last_hidden_state") else output[0]
        h_ND = h.reshape(-1, h.shape[-1])[source_N]
        found.append(
            _head(
                model,
                h_ND,
                target_ids_N,
                temperature,
                with_entropy,
                entropy_grad,
                with_sum_pi_squared,
                chunk_tokens,
            )
        )

    handle = model.get_decoder().register_forward_hook(on_decoder_output)
    try:
        no_logits = torch.empty(0, dtype=torch.long, device=source_N.device)
        result = call(**call_kwargs, logits_to_keep=no_logits)
    finally:
        handle.remove()
    if len(found) != 1:
        raise RuntimeError(
            f"{type(model).__name__}'s decoder ran {len(found)} times in one forward, expected once"
        )
    # The head's results leave the forward through the hook, not the model's outputs (see through_outputs).
    out = found[0]
    out.logprobs_N = through_outputs(out.logprobs_N, result)
    return out


def _head(
    model: nn.Module,
    h_ND: torch.Tensor,
    ids_N: torch.Tensor,
    temperature: float,
    with_entropy: bool,
    entropy_grad: bool,
    with_sum_pi_squared: bool,
    chunk_tokens: int,
) -> HeadOut:
    lm_head = model.get_output_embeddings()
    softcap = getattr(model.config, "final_logit_softcapping", None)
    banned = getattr(model, BANNED_TOKENS, None)
    if chunk_tokens > 0:
        weight_VD, bias_V = lm_head.weight, lm_head.bias
        if banned is not None:  # as a bias: the fused head's logsumexp then leaves them out too
            mask_V = torch.zeros(weight_VD.shape[0], dtype=weight_VD.dtype, device=weight_VD.device)
            mask_V[banned.to(mask_V.device)] = BANNED_LOGIT
            bias_V = mask_V if bias_V is None else bias_V + mask_V
        device_type = h_ND.device.type
        autocast = torch.is_autocast_enabled(device_type)
        if autocast:
            # A bare module under autocast (model.fsdp_unit=none): autocast reaches the fused head's forward
            # but not its backward, whose recomputed logits would then be float32 where the forward's were
            # not. Cast its inputs to autocast's dtype here (autograd casts the gradients back to the float32
            # parameters) and run it outside autocast, as FSDP2's compute-dtype parameters run it.
            dtype = torch.get_autocast_dtype(device_type)
            h_ND, weight_VD = h_ND.to(dtype), weight_VD.to(dtype)
            bias_V = bias_V.to(dtype) if bias_V is not None else None
        with torch.autocast(device_type, enabled=False) if autocast else contextlib.nullcontext():
            return fused_head(
                h_ND,
                weight_VD,
                ids_N,
                bias_V=bias_V,
                temperature=temperature,
                softcap=softcap,
                chunk_tokens=chunk_tokens,
                with_entropy=with_entropy,
                entropy_grad=entropy_grad,
                with_sum_pi_squared=with_sum_pi_squared,
            )
    z_NV = lm_head(h_ND)
    if softcap is not None:  # as transformers' Gemma2/3 ForCausalLM, in the same order
        z_NV = torch.tanh(z_NV / softcap) * softcap
    if banned is not None:
        z_NV = z_NV.index_fill(1, banned.to(z_NV.device), BANNED_LOGIT)
    if temperature > 0 and temperature != 1.0:
        z_NV = z_NV / temperature
    z_1NV = z_NV[None]
    out = HeadOut(token_logprobs(z_1NV, ids_N[None])[0])
    if with_entropy:
        if entropy_grad:
            out.entropy_N = entropy_from_logits(z_1NV)[0]
        else:
            with torch.no_grad():
                out.entropy_N = entropy_from_logits(z_1NV.detach())[0]
    if with_sum_pi_squared:
        with torch.no_grad():
            out.sum_pi_squared_N = sum_pi_squared_from_logits(z_1NV.detach())[0]
    return out
