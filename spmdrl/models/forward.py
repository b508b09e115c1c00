"""The policy forward pass RL needs: per-token logprobs (and entropy, and the sum of squared
probabilities) of the tokens in a batch."""

from __future__ import annotations

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
) -> PolicyForward:
    """:func:`policy_logprobs`, and with ``with_sum_pi_squared`` the sum over the vocabulary of the
    squared (temperature-scaled) probabilities of each position's distribution, computed without a
    gradient."""
    if pack_sequences:
        p = pack(input_ids_BT, attention_mask_BT)
        packed = policy_forward(
            _Positions(model, p.position_ids_RC),
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
    out = model(input_ids=input_ids_BT, attention_mask=attention_mask_BT, logits_to_keep=T - first + 1)
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


class _Positions:
    """``model`` called with the packed rows' position ids and no attention mask (transformers then
    attends within each sequence of a row)."""

    def __init__(self, model: nn.Module, position_ids_RC: torch.Tensor) -> None:
        self.model, self.position_ids_RC = model, position_ids_RC

    def __call__(self, *, input_ids: torch.Tensor, attention_mask: None, logits_to_keep: int = 0) -> object:
        # No KV cache: transformers reads position-id restarts as sequence boundaries only without one.
        return self.model(
            input_ids=input_ids,
            position_ids=self.position_ids_RC,
            use_cache=False,
            logits_to_keep=logits_to_keep,
        )
