"""The LM head and the per-token quantities RL reads from it, fused and chunked over positions.

``h_ND`` holds the last hidden states of only the N positions that predict a scored token. The plain
way computes their (N, V) logits, then the log-softmax, entropy and sum of squared probabilities from
them; autograd keeps the logits (and a float32 copy and the softmax) until backward: at Qwen2.5's
151,936-token vocabulary, 0.6 MB per position and tensor. :func:`fused_head` computes the logits
``chunk_tokens`` positions at a time, keeps only what each position needs for backward (its logsumexp,
and the mean logit under its distribution when the entropy is differentiated), and recomputes each
chunk's logits in backward: the head's memory is a few chunk x V tensors whatever N is, for one more
chunk-sized GEMM per chunk in backward (docs/performance.md, "The LM head on response positions").

All of it runs in float32 (float64 for float64 inputs); the two GEMMs per chunk in the weight's dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class HeadOut:
    """Per position, float32 (float64 for float64 inputs), shape (N,)."""

    logprobs_N: torch.Tensor
    entropy_N: torch.Tensor | None = None
    sum_pi_squared_N: torch.Tensor | None = None


def fused_head(
    h_ND: torch.Tensor,
    weight_VD: torch.Tensor,
    target_N: torch.Tensor,
    *,
    bias_V: torch.Tensor | None = None,
    temperature: float = 1.0,
    softcap: float | None = None,
    chunk_tokens: int = 512,
    with_entropy: bool = False,
    entropy_grad: bool = True,
    with_sum_pi_squared: bool = False,
) -> HeadOut:
    """``log_softmax(y)[target]`` (and the entropy of ``softmax(y)``, and ``sum softmax(y)^2``) per
    position, where ``y = softcap(h W^T + b) / temperature``, from one pass over the vocabulary.

    ``softcap``: Gemma's final logit soft-capping, ``cap * tanh(z / cap)`` (None: none). ``temperature``
    0 (greedy) is scored at 1, as :func:`spmdrl.models.forward.policy_forward` does. ``entropy_grad``
    False: the entropy is a metric, with no gradient (nothing is kept for it). The sum of squared
    probabilities never has one. Gradients flow to ``h_ND``, ``weight_VD`` and ``bias_V``.
    """
    if chunk_tokens <= 0:
        raise ValueError(f"chunk_tokens must be > 0, got {chunk_tokens}")
    scale = 1.0 if temperature <= 0 else float(temperature)
    lp, ent, sps = _ChunkedHead.apply(
        h_ND,
        weight_VD,
        bias_V,
        target_N,
        scale,
        softcap,
        int(chunk_tokens),
        with_entropy,
        with_entropy and entropy_grad,
        with_sum_pi_squared,
    )
    return HeadOut(lp, ent if with_entropy else None, sps if with_sum_pi_squared else None)


def _logits(
    h_CD: torch.Tensor,
    weight_VD: torch.Tensor,
    bias_V: torch.Tensor | None,
    scale: float,
    softcap: float | None,
    acc: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A chunk's scaled logits ``y`` in ``acc``, and ``tanh(z / cap)`` for the soft-cap's derivative."""
    z = torch.nn.functional.linear(h_CD, weight_VD, bias_V).to(acc)
    th = None
    if softcap is not None:
        th = torch.tanh(z / softcap)
        z = th * softcap
    # Division (not multiplication by 1 / T): the same rounding as the unfused path's logits / T.
    return (z / scale if scale != 1.0 else z), th


class _ChunkedHead(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx,
        h_ND: torch.Tensor,
        weight_VD: torch.Tensor,
        bias_V: torch.Tensor | None,
        target_N: torch.Tensor,
        scale: float,
        softcap: float | None,
        chunk: int,
        want_entropy: bool,
        entropy_grad: bool,
        want_sps: bool,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        N = h_ND.shape[0]
        acc = torch.promote_types(h_ND.dtype, torch.float32)
        target_N1 = target_N.long().unsqueeze(-1)
        lp_N = h_ND.new_empty(N, dtype=acc)
        lse_N = h_ND.new_empty(N, dtype=acc)
        ent_N = h_ND.new_empty(N if want_entropy else 0, dtype=acc)
        mean_y_N = h_ND.new_empty(N if want_entropy else 0, dtype=acc)
        sps_N = h_ND.new_empty(N if want_sps else 0, dtype=acc)
        for c0 in range(0, N, chunk):
            c1 = min(N, c0 + chunk)
            y_CV, _ = _logits(h_ND[c0:c1], weight_VD, bias_V, scale, softcap, acc)
            lse_C = torch.logsumexp(y_CV, dim=-1)
            lse_N[c0:c1] = lse_C
            lp_N[c0:c1] = y_CV.gather(-1, target_N1[c0:c1]).squeeze(-1) - lse_C
            if want_entropy:
                # logsumexp(y) - sum p y, as spmdrl.algos.losses.entropy_from_logits.
                mean_y_N[c0:c1] = (torch.softmax(y_CV, dim=-1) * y_CV).sum(-1)
                ent_N[c0:c1] = lse_C - mean_y_N[c0:c1]
            if want_sps:
                sps_N[c0:c1] = torch.exp(torch.logsumexp(2.0 * y_CV, dim=-1) - 2.0 * lse_C)
            del y_CV
        ctx.scale, ctx.softcap, ctx.chunk, ctx.entropy_grad = scale, softcap, chunk, entropy_grad
        # Per position, only scalars are kept: each chunk's logits are recomputed in backward.
        ctx.save_for_backward(h_ND, weight_VD, bias_V, target_N1, lse_N, mean_y_N if entropy_grad else None)
        ctx.mark_non_differentiable(sps_N)
        if not entropy_grad:
            ctx.mark_non_differentiable(ent_N)
        return lp_N, ent_N, sps_N

    @staticmethod
    def backward(ctx, g_lp_N: torch.Tensor, g_ent_N: torch.Tensor, _g_sps: torch.Tensor):  # type: ignore[override]
        h_ND, weight_VD, bias_V, target_N1, lse_N, mean_y_N = ctx.saved_tensors
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        acc = lse_N.dtype
        grad_h = torch.empty_like(h_ND) if need_h else None
        # Summed over chunks in float32 (a bf16 running sum would lose the small chunks' contributions).
        grad_w = torch.zeros_like(weight_VD, dtype=acc) if need_w else None
        grad_b = torch.zeros_like(bias_V, dtype=acc) if need_b and bias_V is not None else None
        N = h_ND.shape[0]
        for c0 in range(0, N, ctx.chunk):
            c1 = min(N, c0 + ctx.chunk)
            h_CD = h_ND[c0:c1]
            y_CV, th_CV = _logits(h_CD, weight_VD, bias_V, ctx.scale, ctx.softcap, acc)
            p_CV = torch.exp(y_CV - lse_N[c0:c1, None])
            g_lp_C1 = g_lp_N[c0:c1, None].to(acc)
            # d logprob / dy = onehot(target) - p; d entropy / dy = p (E_p[y] - y).
            if ctx.entropy_grad:
                gy_CV = p_CV * (g_ent_N[c0:c1, None].to(acc) * (mean_y_N[c0:c1, None] - y_CV) - g_lp_C1)
            else:
                gy_CV = p_CV.mul_(-g_lp_C1)
            gy_CV.scatter_add_(-1, target_N1[c0:c1], g_lp_C1)
            del y_CV
            if ctx.scale != 1.0:
                gy_CV.div_(ctx.scale)
            if th_CV is not None:  # d(cap tanh(z / cap)) / dz = 1 - tanh^2
                gy_CV.mul_(1.0 - th_CV * th_CV)
            gz_CV = gy_CV.to(weight_VD.dtype)
            del gy_CV, th_CV
            if grad_h is not None:
                grad_h[c0:c1] = gz_CV @ weight_VD
            if grad_w is not None:
                grad_w += (gz_CV.t() @ h_CD).to(acc)
            if grad_b is not None:
                grad_b += gz_CV.sum(0).to(acc)
        grad_w = grad_w.to(weight_VD.dtype) if grad_w is not None else None
        grad_b = grad_b.to(bias_V.dtype) if grad_b is not None else None
        return grad_h, grad_w, grad_b, None, None, None, None, None, None, None
