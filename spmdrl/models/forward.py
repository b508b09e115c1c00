"""The policy forward pass RL needs: per-token logprobs (and entropy, and the sum of squared
probabilities) of the tokens in a batch."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from spmdrl.algos.losses import entropy_from_logits, sum_pi_squared_from_logits, token_logprobs
from spmdrl.models.packing import pack


@dataclass
class PolicyForward:
    """What one forward gives, each (B, T) float32 at the token's own position, 0 before first_column."""

    logprobs_BT: torch.Tensor
    entropy_BT: torch.Tensor | None = None
    # sum_v pi_v^2 of the distribution that predicted each token (the optimal token baseline's input).
    sum_pi_squared_BT: torch.Tensor | None = None


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
    transformers, which checks the 2-D mask's values to choose its path (two syncs per forward on a GPU).
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
) -> PolicyForward:
    """:func:`policy_logprobs`, and with ``with_sum_pi_squared`` the sum over the vocabulary of the
    squared (temperature-scaled) probabilities of each position's distribution, computed without a
    gradient."""
    if pack_sequences:
        p = pack(input_ids_BT, attention_mask_BT, lengths_B=lengths_B)
        packed = policy_forward(
            _Positions(model, p.position_ids_RC, packed_attention_mask(model, p.segment_ids_RC)),
            p.input_ids_RC,
            None,  # type: ignore[arg-type]
            temperature=temperature,
            with_entropy=with_entropy,
            entropy_grad=entropy_grad,
            with_sum_pi_squared=with_sum_pi_squared,
        )

        def unpack(x_RC: torch.Tensor | None) -> torch.Tensor | None:
            if x_RC is None:
                return None
            # A sequence's first token has no prediction (packed, it reads the previous sequence's).
            x_BT = p.unpack(x_RC)
            x_BT[:, 0] = 0.0
            return x_BT

        lp_BT = unpack(packed.logprobs_BT)
        assert lp_BT is not None
        return PolicyForward(lp_BT, unpack(packed.entropy_BT), unpack(packed.sum_pi_squared_BT))
    B, T = input_ids_BT.shape
    # Only columns >= first_column are needed: the LM head (and the log-softmax over the vocabulary) runs
    # on the positions that predict them, not on the prompt (transformers' logits_to_keep, as TRL does).
    first = max(1, min(first_column, T))
    mask = attention_mask_for(model, attention_mask_BT, lengths_B) if attention_mask_BT is not None else None
    out = model(input_ids=input_ids_BT, attention_mask=mask, logits_to_keep=T - first + 1)
    logits_BKV = out.logits  # positions first-1 .. T-1
    if temperature > 0 and temperature != 1.0:
        logits_BKV = logits_BKV / temperature
    lp_BT = torch.zeros((B, T), dtype=torch.float32, device=input_ids_BT.device)
    lp_BT[:, first:] = token_logprobs(logits_BKV[:, :-1], input_ids_BT[:, first:])
    ent_BT = None
    if with_entropy:
        ent_BT = torch.zeros((B, T), dtype=torch.float32, device=input_ids_BT.device)
        if entropy_grad:
            ent_BT[:, first:] = entropy_from_logits(logits_BKV[:, :-1])
        else:
            with torch.no_grad():
                ent_BT[:, first:] = entropy_from_logits(logits_BKV[:, :-1].detach())
    sps_BT = None
    if with_sum_pi_squared:
        sps_BT = torch.zeros((B, T), dtype=torch.float32, device=input_ids_BT.device)
        with torch.no_grad():
            sps_BT[:, first:] = sum_pi_squared_from_logits(logits_BKV[:, :-1].detach())
    return PolicyForward(lp_BT, ent_BT, sps_BT)


def attention_mask_for(
    model: nn.Module, attention_mask_BT: torch.Tensor, lengths_B: Sequence[int] | None
) -> torch.Tensor | None:
    """The attention mask to call ``model`` with for right-padded rows of ``lengths_B`` tokens.

    transformers reads a 2-D mask's values to choose between SDPA's ``is_causal`` (no padding) and a
    4-D mask it builds (padding): on a GPU, two syncs per forward. With the lengths on the host there
    is nothing to read: no padding is no mask (transformers then takes ``is_causal``, as it would have),
    padding is the same boolean 4-D mask built here (causal, and only real keys), which transformers
    passes to SDPA as it is. Only for SDPA models whose layers all attend fully (a sliding-window layer
    needs transformers' own mask): any other model gets the 2-D mask, and so does a call without lengths.
    """
    if lengths_B is None:
        return attention_mask_BT
    T = attention_mask_BT.shape[1]
    if all(n == T for n in lengths_B):
        return None
    if not _sdpa_full_attention(model):
        return attention_mask_BT
    device = attention_mask_BT.device
    pos_T = torch.arange(T, device=device)
    causal_TT = pos_T[None, :] <= pos_T[:, None]  # key <= query
    return causal_TT[None, None] & attention_mask_BT.bool()[:, None, None, :]


def packed_attention_mask(model: nn.Module, segment_ids_RC: torch.Tensor) -> torch.Tensor | None:
    """Packed rows' block-diagonal causal mask (R, 1, C, C) from their segment ids, for SDPA models whose
    layers all attend fully: the mask transformers derives from the position-id restarts, which it finds
    by reading them (a sync per forward on a GPU). None for other models: transformers then derives it."""
    if not _sdpa_full_attention(model):
        return None
    C = segment_ids_RC.shape[1]
    pos_C = torch.arange(C, device=segment_ids_RC.device)
    causal_CC = pos_C[None, :] <= pos_C[:, None]
    same_RCC = segment_ids_RC[:, :, None] == segment_ids_RC[:, None, :]
    return (causal_CC[None] & same_RCC)[:, None]


def _sdpa_full_attention(model: nn.Module) -> bool:
    config = getattr(model, "config", None)
    if config is None or getattr(config, "_attn_implementation", None) != "sdpa":
        return False
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        return all(t == "full_attention" for t in layer_types)
    return (
        getattr(config, "sliding_window", None) is None
        and getattr(config, "attention_chunk_size", None) is None
    )


class _Positions:
    """``model`` called with the packed rows' position ids and, when given, their block-diagonal
    mask; with none, transformers reads the position-id restarts as sequence boundaries."""

    def __init__(self, model: nn.Module, position_ids_RC: torch.Tensor, mask: torch.Tensor | None) -> None:
        self.model, self.position_ids_RC, self.mask = model, position_ids_RC, mask

    def __call__(self, *, input_ids: torch.Tensor, attention_mask: None, logits_to_keep: int = 0) -> object:
        # No KV cache: transformers reads position-id restarts as sequence boundaries only without one.
        return self.model(
            input_ids=input_ids,
            position_ids=self.position_ids_RC,
            attention_mask=self.mask,
            use_cache=False,
            logits_to_keep=logits_to_keep,
        )
