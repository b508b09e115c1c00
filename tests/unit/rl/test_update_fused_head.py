"""model.use_fused_kernels reaches the update's forward (spmdrl/rl/update.py's micro_batch_loss): fused and
plain heads give the same loss, statistics and gradients, and the planned micro-batch scores each row
from its own first sampled column only (one process, a small in-memory Qwen2 with an entropy bonus)."""

from __future__ import annotations

import dataclasses

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from spmdrl.algos.aggregation import Aggregation
from spmdrl.config import AlgorithmConfig, Config, ModelConfig
from spmdrl.rl.batch import PolicyBatch
from spmdrl.rl.micro_batches import plan_micro_batches
from spmdrl.rl.settings import update_settings
from spmdrl.rl.update import micro_batch_loss
from spmdrl.testing.models import SMALL_QWEN2

B, T = 4, 14


def _batch() -> PolicyBatch:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 64, (B, T), generator=g)
    attn = torch.ones(B, T, dtype=torch.long)
    attn[1, -3:] = 0
    attn[3, -5:] = 0
    resp = attn.bool().clone()
    for row, prompt in enumerate([3, 5, 8, 4]):  # prompts of different lengths
        resp[row, :prompt] = False
    adv_BT = torch.tensor([1.0, -1.0, 0.5, -0.5])[:, None] * resp
    old = -torch.rand(B, T, generator=g)
    return PolicyBatch(
        ids * attn, attn, resp, old.clone(), adv_BT, old_logprobs_BT=old, ref_logprobs_BT=old - 0.1
    )


def test_fused_head_in_the_update_equals_plain() -> None:
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(**SMALL_QWEN2)).float()
    batch = _batch()
    (plan,) = plan_micro_batches([torch.arange(B)], batch.row_lengths(), torch.device("cpu"))
    assert plan.first_columns == [3, 5, 8, 4] and plan.first_column == 3
    mb = batch.take(plan.index_B, plan.width)
    agg = Aggregation.local("token-mean", mb.response_mask_BT)
    results = {}
    for fused in ("false", "true"):
        cfg = Config(
            model=ModelConfig(use_fused_kernels=fused, fused_chunk_tokens=4),
            algorithm=AlgorithmConfig(entropy_coeff=0.01, use_kl_loss=True),
        )
        cfg = dataclasses.replace(cfg, rollout=dataclasses.replace(cfg.rollout, temperature=0.8))
        model.zero_grad(set_to_none=True)
        out = micro_batch_loss(update_settings(cfg), model, mb, agg, plan=plan)
        out.loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        results[fused] = (out, grads)
    (plain, g_plain), (fused_out, g_fused) = results["false"], results["true"]
    # Scored exactly where a token was sampled: each row's own prompt and padding stay 0.
    assert torch.equal(plain.logprobs_BT != 0, mb.response_mask_BT)
    torch.testing.assert_close(fused_out.logprobs_BT, plain.logprobs_BT, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(fused_out.loss, plain.loss, rtol=1e-5, atol=1e-7)
    for key in ("pg_loss", "entropy", "kl_loss"):
        torch.testing.assert_close(fused_out.stats[key], plain.stats[key], rtol=1e-5, atol=1e-7)
    for name, grad in g_plain.items():
        torch.testing.assert_close(g_fused[name], grad, rtol=1e-4, atol=1e-6 * float(grad.abs().max()))
