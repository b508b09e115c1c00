"""Policy and SFT losses, their aggregation over tokens, and the per-token quantities they need.

Loss normalization lives here, in :func:`aggregate`, and nowhere else. Its convention, for a
mini-batch split into micro-batches on each of ``dp_size`` data-parallel ranks:

- the caller counts the units the mode averages over (:func:`aggregation_count`: valid tokens, or
  sequences with at least one valid token) over the whole mini-batch on all ranks, say with an
  all_reduce, and passes that count as ``global_tokens`` / ``global_seqs``;
- each micro-batch's loss is ``dp_size * (its sum over those units) / global_count``;
- gradient accumulation sums the micro-batch gradients, and FSDP averages them over the ``dp_size``
  ranks: ``(1 / dp_size) * sum_ranks sum_micro dp_size * sum / global_count = total / global_count``.

So the final gradient equals the gradient of the loss of the whole mini-batch computed at once on
one device, however it is split. (Dividing each micro-batch by its own count instead would weight a
token in a short micro-batch more than one in a long one.) ``dp_size`` is the factor the gradient
reduction divides by: the data-parallel world size under FSDP's default averaging, 1 if the
gradients are summed. For logging, the average over ranks of the summed micro-batch losses is the
mini-batch loss.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from spmdrl.algos.kl import kl_penalty

AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")

# Rows of (batch x vocab) logits converted to float32 at a time: bounds the temporary float32 copy
# (and logsumexp's buffer) to about chunk x V x 4 bytes instead of B x T x V x 4.
_CHUNK_TOKENS = 1024


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of ``x`` where ``mask`` is set (0 where nothing is). Masked entries may hold NaN or inf."""
    valid = mask.bool()
    total = torch.where(valid, x, 0).sum() if dim is None else torch.where(valid, x, 0).sum(dim)
    count = valid.sum() if dim is None else valid.sum(dim)
    return total / count.clamp_min(1)


def aggregation_count(mask_BT: torch.Tensor, mode: str) -> int:
    """The number of units ``mode`` averages over in this batch: valid tokens for ``token-mean``,
    sequences with at least one valid token for the ``seq-mean-*`` modes. Sum it over micro-batches
    and ranks to get the ``global_tokens`` / ``global_seqs`` of :func:`aggregate`."""
    _check_mode(mode)
    valid_BT = mask_BT.bool()
    if mode == "token-mean":
        return int(valid_BT.sum())
    return int(valid_BT.any(dim=-1).sum())


def aggregate(
    loss_BT: torch.Tensor,
    mask_BT: torch.Tensor,
    mode: str = "token-mean",
    *,
    global_tokens: float | None = None,
    global_seqs: float | None = None,
    dp_size: int = 1,
) -> torch.Tensor:
    """Reduce per-token losses to a scalar.

    - ``token-mean``: sum over valid tokens / number of valid tokens;
    - ``seq-mean-token-mean``: each sequence's mean over its valid tokens, averaged over sequences;
    - ``seq-mean-token-sum``: each sequence's sum over its valid tokens, averaged over sequences.

    Sequences without a valid token are left out of the seq-mean modes. With ``global_tokens`` /
    ``global_seqs`` (the count for ``mode``, see the module docstring) the result is
    ``dp_size * sum / global_count``; without, the local mean. A count of 0 is read as 1 (loss 0).
    """
    _check_mode(mode)
    if loss_BT.shape != mask_BT.shape:
        raise ValueError(f"loss_BT {tuple(loss_BT.shape)} and mask_BT {tuple(mask_BT.shape)} differ in shape")
    valid_BT = mask_BT.bool()
    masked_BT = torch.where(valid_BT, loss_BT, 0)
    if mode == "token-mean":
        total = masked_BT.sum()
        global_count, other, unit = global_tokens, global_seqs, "tokens"
        local_count = valid_BT.sum()
    else:
        tokens_B = valid_BT.sum(dim=-1)
        per_seq_B = masked_BT.sum(dim=-1)
        if mode == "seq-mean-token-mean":
            per_seq_B = per_seq_B / tokens_B.clamp_min(1)
        total = per_seq_B.sum()  # a sequence with no valid token adds 0
        global_count, other, unit = global_seqs, global_tokens, "seqs"
        local_count = (tokens_B > 0).sum()
    if global_count is None:
        if other is not None:
            raise ValueError(f"mode {mode!r} averages over {unit}: pass global_{unit}, not the other count")
        if dp_size != 1:
            raise ValueError(f"dp_size={dp_size} only applies with a global count (global_{unit})")
        return total / local_count.clamp_min(1)
    return total * dp_size / max(float(global_count), 1.0)


@dataclass
class PolicyLossOutput:
    loss: torch.Tensor  # scalar, with gradient
    clip_frac: torch.Tensor  # scalar, detached: fraction of valid tokens where the clipped term was used
    approx_kl: torch.Tensor  # scalar, detached: k3 estimate of KL(old || new), mean over valid tokens


def ppo_policy_loss(
    logprobs_BT: torch.Tensor,
    old_logprobs_BT: torch.Tensor,
    advantages: torch.Tensor,
    mask_BT: torch.Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.28,
    agg: str = "token-mean",
    global_tokens: float | None = None,
    global_seqs: float | None = None,
    dp_size: int = 1,
    is_weights_BT: torch.Tensor | None = None,
) -> PolicyLossOutput:
    """PPO's clipped surrogate with separate low / high clip ranges ("clip-higher", DAPO).

    Per token, with ratio ``r = exp(logprob - old_logprob)`` and advantage ``A``:
    ``max(-A r, -A clip(r, 1 - clip_low, 1 + clip_high))``, times ``is_weights_BT`` if given
    (truncated importance weights for the rollout-vs-trainer mismatch; no gradient flows into them),
    then reduced by :func:`aggregate`. ``advantages`` is per sequence (B,) or per token (B, T).
    A raised ``clip_high`` lets the probability of unlikely tokens with positive advantage grow
    further per step, which keeps entropy from collapsing.
    """
    if advantages.dim() == 1:
        advantages_BT = advantages.unsqueeze(-1)
    elif advantages.shape == logprobs_BT.shape:
        advantages_BT = advantages
    else:
        raise ValueError(
            f"advantages must have shape (B,) or (B, T) = {tuple(logprobs_BT.shape)}, got {tuple(advantages.shape)}"
        )
    # Clamped so that a token whose probability moved by e^20 cannot overflow exp() into inf / NaN.
    log_ratio_BT = (logprobs_BT - old_logprobs_BT).clamp(-20.0, 20.0)
    ratio_BT = torch.exp(log_ratio_BT)
    unclipped_BT = -advantages_BT * ratio_BT
    clipped_BT = -advantages_BT * ratio_BT.clamp(1.0 - clip_low, 1.0 + clip_high)
    loss_BT = torch.maximum(unclipped_BT, clipped_BT)
    if is_weights_BT is not None:
        loss_BT = loss_BT * is_weights_BT.detach()
    loss = aggregate(
        loss_BT, mask_BT, agg, global_tokens=global_tokens, global_seqs=global_seqs, dp_size=dp_size
    )
    with torch.no_grad():
        clip_frac = masked_mean((clipped_BT > unclipped_BT).float(), mask_BT)
        # Tokens were sampled from the old policy, so k3 with the roles: "policy" = old, "ref" = new.
        approx_kl = masked_mean(kl_penalty(old_logprobs_BT, logprobs_BT, "k3"), mask_BT)
    return PolicyLossOutput(loss=loss, clip_frac=clip_frac, approx_kl=approx_kl)


def truncated_is_weights(
    trainer_old_logprobs_BT: torch.Tensor,
    rollout_logprobs_BT: torch.Tensor,
    mask_BT: torch.Tensor,
    cap: float,
) -> torch.Tensor:
    """``min(exp(trainer_old - rollout), cap)`` per token, 0 where masked, detached.

    vLLM's sampler and the trainer's forward disagree slightly (kernels, precision), so the tokens
    come from a policy a little off the one PPO thinks it sampled from; these weights correct that,
    truncated at ``cap`` to bound the variance (TIS).
    """
    if cap <= 0:
        raise ValueError(f"the importance-weight cap must be > 0, got {cap}")
    with torch.no_grad():
        log_w_BT = (trainer_old_logprobs_BT - rollout_logprobs_BT).clamp(max=20.0)
        weights_BT = torch.exp(log_w_BT).clamp(max=cap)
        return torch.where(mask_BT.bool(), weights_BT, 0.0)


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
    return torch.cat(parts, dim=1) if parts else logits_BTV.new_zeros((B, 0), dtype=torch.float32)


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
    return torch.cat(parts, dim=1) if parts else logits_BTV.new_zeros((B, 0), dtype=torch.float32)


def _chunks(B: int, T: int) -> list[tuple[int, int]]:
    step = max(1, _CHUNK_TOKENS // max(B, 1))
    return [(t0, min(T, t0 + step)) for t0 in range(0, T, step)]


def masked_cross_entropy(
    logits_BTV: torch.Tensor,
    input_ids_BT: torch.Tensor,
    loss_mask_BT: torch.Tensor,
    *,
    num_global_tokens: float,
    dp_size: int = 1,
) -> tuple[torch.Tensor, int]:
    """Next-token NLL for SFT: ``(loss, num_local_tokens)``.

    ``logits_BTV[:, t]`` predicts ``input_ids_BT[:, t + 1]``, which counts iff
    ``loss_mask_BT[:, t + 1] == 1``. The loss is ``dp_size * sum of NLL over this micro-batch's valid
    tokens / num_global_tokens``, where ``num_global_tokens`` counts the valid tokens of the whole
    optimizer step (all micro-batches, all ranks). Dividing every micro-batch by that one global count,
    not by its own count, is what makes the accumulated and rank-averaged gradient exactly the
    gradient of the mean NLL over every valid token of the global batch (see the module docstring for
    ``dp_size``). ``num_local_tokens`` is this micro-batch's count, for the caller's bookkeeping.
    """
    if input_ids_BT.shape != loss_mask_BT.shape or tuple(input_ids_BT.shape) != tuple(logits_BTV.shape[:2]):
        raise ValueError(
            f"shapes differ: logits_BTV {tuple(logits_BTV.shape)}, input_ids_BT {tuple(input_ids_BT.shape)}, "
            f"loss_mask_BT {tuple(loss_mask_BT.shape)}"
        )
    mask_BT = loss_mask_BT[:, 1:]
    nll_BT = -token_logprobs(logits_BTV[:, :-1], input_ids_BT[:, 1:])
    loss = aggregate(nll_BT, mask_BT, "token-mean", global_tokens=num_global_tokens, dp_size=dp_size)
    return loss, int(mask_BT.bool().sum())


def _check_mode(mode: str) -> None:
    if mode not in AGG_MODES:
        raise ValueError(f"unknown loss aggregation {mode!r}; use one of {', '.join(AGG_MODES)}")
