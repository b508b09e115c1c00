"""The policy forward pass RL needs: per-token logprobs (and entropy, and the sum of squared
probabilities) of the tokens in a batch."""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from spmdrl.data.vision import ImageInputs
from spmdrl.models.causal_attention import causal_key_mask, full_attention_sdpa, uses_causal_sdpa
from spmdrl.models.head import head_on_positions
from spmdrl.models.packing import Packed, pack
from spmdrl.models.router_replay import replay_layout, router_tap, valid_tokens
from spmdrl.models.varlen import uses_varlen, varlen_kwargs
from spmdrl.transfer import to_device


@dataclass
class PolicyForward:
    """What one forward gives, each (B, T) float32 at the token's own position, 0 where not scored
    (before a row's first column, and at padding when the lengths are given)."""

    logprobs_BT: torch.Tensor
    entropy_BT: torch.Tensor | None = None
    # sum_v pi_v^2 of the distribution that predicted each token (the optimal token baseline's input).
    sum_pi_squared_BT: torch.Tensor | None = None
    # A mixture of experts: transformers' load-balancing loss of this forward's routing (a scalar with the
    # routers' gradient when asked for with ``router_aux_grad``; spmdrl.models.router_replay).
    router_aux_loss: torch.Tensor | None = None


def policy_logprobs(
    model: nn.Module,
    input_ids_BT: torch.Tensor,
    attention_mask_BT: torch.Tensor,
    *,
    temperature: float = 1.0,
    with_entropy: bool = False,
    entropy_grad: bool = True,
    pack_sequences: bool = False,
    first_column: int = 1,
    lengths_B: Sequence[int] | None = None,
    first_columns_B: Sequence[int] | None = None,
    fused_chunk_tokens: int = 0,
    images: ImageInputs | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Logprob of each token given the ones before it, at the token's own position (column 0 is 0).

    Logits are divided by the sampling temperature so that the result is comparable with the
    engine's logprobs, which are reported after temperature (0 = greedy is scored at 1).
    Entropy, when asked, is the entropy of the distribution that predicted each token.

    ``entropy_grad=False`` computes the entropy as a metric only: from detached logits under
    ``torch.no_grad()``, so that autograd keeps nothing for it. With gradients, its backward keeps
    B x T x V float32 tensors (the softmax, plus a float32 copy of bf16 logits; about 15 GB at
    8 x 1536 x 151,936) until the entropy is backpropagated, or for as long as the entropy is
    referenced if it never is. The value is the same either way.

    ``first_column``: columns before it (the prompt, where nothing is trained) are left at 0 and their
    logits never computed.

    ``pack_sequences``: the rows are packed end to end first (spmdrl.models.packing), and the results
    come back in the padded layout.

    ``lengths_B``: each row's tokens, known on the host (spmdrl.rl.batch.RowLengths). With them nothing
    is read from the device: the attention mask is built here (:func:`attention_mask_for`) instead of by
    transformers, which checks the 2-D mask's values to choose its path (two syncs per forward on a GPU),
    and the LM head runs on each row's own tokens only (padding is left at 0).

    ``first_columns_B``, ``fused_chunk_tokens``: each row's first scored column, and the fused LM head's
    chunk (0: plain), see :func:`policy_forward`.
    """
    out = policy_forward(
        model,
        input_ids_BT,
        attention_mask_BT,
        temperature=temperature,
        with_entropy=with_entropy,
        entropy_grad=entropy_grad,
        pack_sequences=pack_sequences,
        first_column=first_column,
        lengths_B=lengths_B,
        first_columns_B=first_columns_B,
        fused_chunk_tokens=fused_chunk_tokens,
        images=images,
    )
    return out.logprobs_BT, out.entropy_BT


def policy_forward(
    model: nn.Module,
    input_ids_BT: torch.Tensor,
    attention_mask_BT: torch.Tensor,
    *,
    temperature: float = 1.0,
    with_entropy: bool = False,
    entropy_grad: bool = True,
    with_sum_pi_squared: bool = False,
    pack_sequences: bool = False,
    first_column: int = 1,
    lengths_B: Sequence[int] | None = None,
    first_columns_B: Sequence[int] | None = None,
    fused_chunk_tokens: int = 0,
    routed_experts_BTLK: torch.Tensor | None = None,
    router_aux_grad: bool = False,
    images: ImageInputs | None = None,
) -> PolicyForward:
    """:func:`policy_logprobs`, and with ``with_sum_pi_squared`` the sum over the vocabulary of the
    squared (temperature-scaled) probabilities of each position's distribution, computed without a
    gradient.

    The LM head runs only on the positions that predict a scored token: row b's columns from its first
    sampled one (``first_columns_B[b]``, spmdrl.rl.batch.RowLengths; ``first_column`` for every row
    without them) up to its length, padded or packed; the decoder runs without its head
    (spmdrl.models.head). Everything else is 0. ``fused_chunk_tokens`` > 0: the head is fused and
    chunked (spmdrl.models.fused_logprob; model.use_fused_kernels), memory chunk x V instead of N x V.
    Without ``lengths_B`` padded rows are scored up to column T, their padding too (nothing is read from
    the device), and packed rows' lengths are read from the mask (a sync on a GPU).

    A mixture of experts' routers are tapped (spmdrl.models.router_replay): ``routed_experts_BTLK``, the
    engine's top-k experts of each token, (B, T, layers, k), -1 where none, routes each token through
    those (router replay), and each forward's routing statistics are kept for the step's ``moe/*``.
    ``images``: a vision-language model's images of these rows, in row order (spmdrl.data.vision); not
    with packing, which would reorder the rows' image tokens.
    """
    if images is not None and pack_sequences:
        raise ValueError(
            "policy_forward: images with pack_sequences; a vision-language model's rows are not packed "
            "(docs/models.md#vision-language-models)"
        )
    B, T = input_ids_BT.shape
    device = input_ids_BT.device
    if lengths_B is not None:
        lengths = [int(n) for n in lengths_B]
    elif pack_sequences:
        lengths = [int(n) for n in attention_mask_BT.sum(dim=1).tolist()]
    else:
        lengths = [T] * B
    firsts = list(first_columns_B) if first_columns_B is not None else [first_column] * B
    # The scored tokens as flat indices into (B, T), built on the host and moved in one asynchronous copy.
    target_N = to_device(torch.tensor(scored_positions(T, lengths, firsts), dtype=torch.long), device)
    call: Any = model
    p: Packed | None = None
    if pack_sequences:
        p = pack(input_ids_BT, attention_mask_BT, lengths_B=lengths)
        # Each real token's packed position, looked up on the device (nothing is read); a token's
        # predecessor is the position before it in its packed row, as in its padded one.
        packed_of = torch.zeros(B * T, dtype=torch.long, device=device).index_put_(
            (p.padded_idx_N,), p.packed_idx_N
        )
        source_N = packed_of[target_N] - 1
        call = _Positions(model, p)
        kwargs: dict[str, Any] = {"input_ids": p.input_ids_RC, "attention_mask": None}
    else:
        source_N = target_N - 1
        mask = (
            attention_mask_for(model, attention_mask_BT, lengths_B) if attention_mask_BT is not None else None
        )
        kwargs = {"input_ids": input_ids_BT, "attention_mask": mask}
        if images is not None:
            kwargs.update(images.model_kwargs(device, model_dtype(model)))
    tap = router_tap(model)
    if routed_experts_BTLK is not None and tap is None:
        raise ValueError("policy_forward: routed_experts_BTLK given for a model without MoE routers")
    routing: Any = contextlib.nullcontext()
    if tap is not None:
        lengths_known = lengths if (lengths_B is not None or pack_sequences) else None
        if routed_experts_BTLK is not None:
            replay_NLK, valid_N = replay_layout(routed_experts_BTLK[:, :T], p, lengths_known)
        else:
            replay_NLK, valid_N = None, valid_tokens(p, lengths_known, B, T, device)
        routing = tap.forward(replay_NLK, valid_N, want_aux=router_aux_grad)
    with routing as fwd_routing:
        out = head_on_positions(
            model,
            call,
            kwargs,
            source_N,
            input_ids_BT.reshape(-1)[target_N],
            temperature=temperature,
            with_entropy=with_entropy,
            entropy_grad=entropy_grad,
            with_sum_pi_squared=with_sum_pi_squared,
            chunk_tokens=fused_chunk_tokens,
        )

    def scatter(x_N: torch.Tensor | None) -> torch.Tensor | None:
        if x_N is None:
            return None
        flat = torch.zeros(B * T, dtype=torch.float32, device=device)
        return flat.index_put((target_N,), x_N.float()).view(B, T)

    lp_BT = scatter(out.logprobs_N)
    assert lp_BT is not None
    aux = fwd_routing.aux_loss() if fwd_routing is not None else None
    return PolicyForward(lp_BT, scatter(out.entropy_N), scatter(out.sum_pi_squared_N), aux)


def model_dtype(model: nn.Module) -> torch.dtype:
    """The dtype the vision tower computes in (FSDP2's param_dtype, which casts the gathered weights)."""
    return getattr(model, "spmdrl_param_dtype", torch.float32)


def scored_positions(T: int, lengths_B: Sequence[int], first_columns_B: Sequence[int]) -> list[int]:
    """Flat indices into (B, T) of the tokens a forward scores: row b's columns from
    ``max(1, first_columns_B[b])`` (column 0 has no prediction) to its length."""
    out: list[int] = []
    for b, (n, first) in enumerate(zip(lengths_B, first_columns_B, strict=True)):
        out.extend(range(b * T + max(1, first), b * T + n))
    return out


def attention_mask_for(
    model: nn.Module, attention_mask_BT: torch.Tensor, lengths_B: Sequence[int] | None
) -> torch.Tensor | None:
    """The attention mask to call ``model`` with for right-padded rows of ``lengths_B`` tokens.

    transformers reads a 2-D mask's values to choose between SDPA's ``is_causal`` (no padding) and a
    4-D mask it builds (padding): on a GPU, two syncs per forward. With the lengths on the host there
    is nothing to read. A model switched to causal SDPA (spmdrl.models.causal_attention: the RL models
    whose layers all attend fully) gets no mask, padded or not: causal attention is exact for every real
    token of a right-padded row, and SDPA keeps its flash kernel. Another SDPA full-attention model gets
    None without padding (transformers then takes ``is_causal``) and with padding the boolean 4-D mask
    (causal, and only real keys), which transformers passes to SDPA as it is. Any other model (a
    sliding-window layer needs transformers' own mask) gets the 2-D mask, and so does a call without
    lengths.
    """
    if lengths_B is None:
        return attention_mask_BT
    if uses_causal_sdpa(model):
        return None
    T = attention_mask_BT.shape[1]
    if all(n == T for n in lengths_B):
        return None
    if not full_attention_sdpa(getattr(model, "config", None)):
        return attention_mask_BT
    return causal_key_mask(attention_mask_BT)


def packed_attention_mask(model: nn.Module, segment_ids_RC: torch.Tensor) -> torch.Tensor | None:
    """Packed rows' block-diagonal causal mask (R, 1, C, C) from their segment ids, for SDPA models whose
    layers all attend fully: the mask transformers derives from the position-id restarts, which it finds
    by reading them (a sync per forward on a GPU). None for other models: transformers then derives it.
    A varlen model (spmdrl.models.varlen) called with this mask instead of the boundaries attends with it."""
    if not (full_attention_sdpa(getattr(model, "config", None)) or uses_varlen(model)):
        return None
    C = segment_ids_RC.shape[1]
    pos_C = torch.arange(C, device=segment_ids_RC.device)
    causal_CC = pos_C[None, :] <= pos_C[:, None]
    same_RCC = segment_ids_RC[:, :, None] == segment_ids_RC[:, None, :]
    return (causal_CC[None] & same_RCC)[:, None]


class _Positions:
    """``model`` called on packed rows ``p``: their position ids, and either their segments' boundaries for
    varlen attention (a model switched to it by spmdrl.models.varlen.apply_packed_attention) or their
    block-diagonal mask; with neither, transformers reads the position-id restarts as sequence boundaries."""

    def __init__(self, model: nn.Module, p: Packed) -> None:
        self.model = model
        self.inputs: dict[str, Any] = {"position_ids": p.position_ids_RC}
        if uses_varlen(model):
            self.inputs.update(varlen_kwargs(p))
        else:
            self.inputs["attention_mask"] = packed_attention_mask(model, p.segment_ids_RC)

    def __call__(self, *, input_ids: torch.Tensor, attention_mask: None, logits_to_keep: int = 0) -> object:
        # No KV cache: transformers reads position-id restarts as sequence boundaries only without one.
        return self.model(input_ids=input_ids, use_cache=False, logits_to_keep=logits_to_keep, **self.inputs)
