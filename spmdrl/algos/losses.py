"""The per-token quantities losses need (logprobs, entropy, chunked in float32) and the SFT loss.

Policy losses live in :mod:`spmdrl.algos.policy_losses`, their normalization in
:mod:`spmdrl.algos.aggregation`.
"""

from __future__ import annotations

import torch

from spmdrl.algos.aggregation import Aggregation

# Rows of (batch x vocab) logits converted to float32 at a time: bounds the temporary float32 copy
# (and logsumexp's buffer) to about chunk x V x 4 bytes instead of B x T x V x 4.
_CHUNK_TOKENS = 1024


def token_logprobs(logits_BTV: torch.Tensor, target_ids_BT: torch.Tensor) -> torch.Tensor:
    """``log_softmax(logits)[target]`` per token, float32, shape (B, T).

    Computed as ``logit[target] - logsumexp(logits)`` over chunks of positions in float32: the full
    (B, T, V) log-softmax is never materialized, and the float32 temporaries are bounded per chunk.
    (Under autograd, logsumexp keeps its float32 input for the backward; for float32 logits that is
    the logits themselves, no copy.) ``target_ids_BT`` must hold valid vocabulary ids everywhere,
    masked positions included (use the pad id, not -100).
    """
    B, T, _ = logits_BTV.shape
    if tuple(target_ids_BT.shape) != (B, T):
        raise ValueError(
            f"target_ids_BT {tuple(target_ids_BT.shape)} does not match logits_BTV {tuple(logits_BTV.shape)}"
        )
    parts = []
    for t0, t1 in _chunks(B, T):
        z_BCV = logits_BTV[:, t0:t1].float()
        target_BC1 = target_ids_BT[:, t0:t1].long().unsqueeze(-1)
        parts.append(z_BCV.gather(-1, target_BC1).squeeze(-1) - torch.logsumexp(z_BCV, dim=-1))
    return torch.cat(parts, dim=1) if parts else _no_positions(logits_BTV)


def entropy_from_logits(logits_BTV: torch.Tensor) -> torch.Tensor:
    """Entropy of the softmax per position, float32, shape (B, T).

    ``logsumexp(z) - sum(softmax(z) * z)``: the same as ``-sum(p log p)`` but it never takes the log
    of a probability that underflowed to 0. Chunked in float32 like :func:`token_logprobs`.
    """
    B, T, _ = logits_BTV.shape
    parts = []
    for t0, t1 in _chunks(B, T):
        z_BCV = logits_BTV[:, t0:t1].float()
        parts.append(torch.logsumexp(z_BCV, dim=-1) - (torch.softmax(z_BCV, dim=-1) * z_BCV).sum(-1))
    return torch.cat(parts, dim=1) if parts else _no_positions(logits_BTV)


def sum_pi_squared_from_logits(logits_BTV: torch.Tensor) -> torch.Tensor:
    """``sum_v softmax(z)_v^2`` per position, float32, shape (B, T): the squared norm of the next-token
    distribution, which the optimal token baseline's path variance ``1 - 2 pi_t + sum pi^2`` reads.

    ``exp(logsumexp(2 z) - 2 logsumexp(z))`` (verl's ``calculate_sum_pi_squared_from_logits``): no
    probability is squared after it underflowed. Chunked in float32 like :func:`token_logprobs`.
    """
    B, T, _ = logits_BTV.shape
    parts = []
    for t0, t1 in _chunks(B, T):
        z_BCV = logits_BTV[:, t0:t1].float()
        parts.append(torch.exp(torch.logsumexp(2.0 * z_BCV, dim=-1) - 2.0 * torch.logsumexp(z_BCV, dim=-1)))
    return torch.cat(parts, dim=1) if parts else _no_positions(logits_BTV)


def _no_positions(logits_BTV: torch.Tensor) -> torch.Tensor:
    """The (B, 0) result for logits of no position, still attached to the logits' graph: a micro-batch
    with nothing to score (every row masked out) then backpropagates zeros through the model, so its
    FSDP hooks run and reduce-scatter with the other ranks' like any other micro-batch."""
    return logits_BTV[:, :, 0].float()


def _chunks(B: int, T: int) -> list[tuple[int, int]]:
    step = max(1, _CHUNK_TOKENS // max(B, 1))
    return [(t0, min(T, t0 + step)) for t0 in range(0, T, step)]


def masked_cross_entropy(
    logits_BTV: torch.Tensor,
    input_ids_BT: torch.Tensor,
    loss_mask_BT: torch.Tensor,
    *,
    num_global_tokens: float,
) -> tuple[torch.Tensor, int]:
    """Next-token NLL for SFT: ``(loss, num_local_tokens)``.

    ``logits_BTV[:, t]`` predicts ``input_ids_BT[:, t + 1]``, which counts iff
    ``loss_mask_BT[:, t + 1] == 1``. The loss is the sum of NLL over this micro-batch's valid tokens
    / ``num_global_tokens``, the valid tokens of the whole optimizer step (all micro-batches, all
    ranks): with gradients summed over micro-batches and ranks, the gradient of the mean NLL over the
    global batch (spmdrl/algos/aggregation.py). ``num_local_tokens`` is this micro-batch's count.
    """
    if input_ids_BT.shape != loss_mask_BT.shape or tuple(input_ids_BT.shape) != tuple(logits_BTV.shape[:2]):
        raise ValueError(
            f"shapes differ: logits_BTV {tuple(logits_BTV.shape)}, input_ids_BT {tuple(input_ids_BT.shape)}, "
            f"loss_mask_BT {tuple(loss_mask_BT.shape)}"
        )
    mask_BT = loss_mask_BT[:, 1:]
    nll_BT = -token_logprobs(logits_BTV[:, :-1], input_ids_BT[:, 1:])
    loss = Aggregation("token-mean", num_global_tokens)(nll_BT, mask_BT)
    return loss, int(mask_BT.bool().sum())
