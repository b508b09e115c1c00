"""The weight-sync check's probe through a mixture of experts' kernel (spmdrl/rollout/expert_probe.py),
against a stand-in for vLLM's fused-MoE kernel (tests/integration/test_moe.py runs the real one) that
rounds as vLLM 0.32's CPU kernel does (float32 arithmetic; the intermediate and the output rounded to the
engine dtype): the trainer's float64 outputs from the matrices it streams agree within the slack it
derives from that rounding, also summed over TP slices of the experts' width and in bf16 at many seeds,
and an expert whose matrix the engine holds in another element order (a layout the kernel misreads)
fails that key while its whole sums agree."""

from __future__ import annotations

import pytest
import torch

from spmdrl.models.experts import split_fused
from spmdrl.rollout.expert_probe import ExpertOutputs, engine_rows, observe_experts, reduce_outputs, signs
from spmdrl.rollout.fingerprint import Fingerprint, compare, kernel_key, observe

LAYER = "model.layers.0.mlp.experts"
E, INTER, HIDDEN = 3, 32, 64


def _kernel(x: torch.Tensor, ids: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """What the fused-MoE kernel computes for rows routed to one expert each with weight 1: float32
    arithmetic on the weights' dtype, the intermediate and the output rounded to it."""
    dtype, inter = w13.dtype, w13.shape[1] // 2
    gate_up = torch.bmm(w13[ids[:, 0]].float(), x.float()[:, :, None])[:, :, 0]
    h = (torch.nn.functional.silu(gate_up[:, :inter]) * gate_up[:, inter:]).to(dtype)
    return torch.bmm(w2[ids[:, 0]].float(), h.float()[:, :, None])[:, :, 0].to(dtype)


def _engine(gate_up: torch.Tensor, down: torch.Tensor, seed: int, tp: int) -> Fingerprint:
    """The engine side: each TP rank's kernel on its slice of every expert's width, reduced, summed."""
    fp = Fingerprint()
    experts, hidden, inter = down.shape
    x, _, ids, k = engine_rows(hidden, experts, seed, gate_up.dtype, torch.device("cpu"))
    y = torch.zeros(experts * k, hidden, dtype=torch.float64)
    for r in range(tp):
        rows = slice(r * inter // tp, (r + 1) * inter // tp)
        w13 = torch.cat([gate_up[:, :inter][:, rows], gate_up[:, inter:][:, rows]], dim=1)
        y += _kernel(x, ids, w13, down[:, :, rows]).double()  # each rank's partial outputs, rounded
    s = signs(hidden, seed, y.device)
    for e in range(experts):
        fp.add_sums(kernel_key(LAYER, e), LAYER, reduce_outputs(y[e * k : (e + 1) * k], s))
    return fp


def _trainer(gate_up: torch.Tensor, down: torch.Tensor, seed: int) -> Fingerprint:
    fp = Fingerprint()
    stream = [*split_fused(f"{LAYER}.gate_up_proj", gate_up), *split_fused(f"{LAYER}.down_proj", down)]
    list(observe_experts(iter(stream), ExpertOutputs(fp, seed)))
    return fp


@pytest.mark.parametrize("tp", [1, 2])
def test_the_kernel_probe_agrees_and_catches_a_misread_layout(tp: int) -> None:
    g = torch.Generator().manual_seed(0)
    gate_up = torch.randn(E, 2 * INTER, HIDDEN, generator=g) * 0.1
    down = torch.randn(E, HIDDEN, INTER, generator=g) * 0.1
    trainer = _trainer(gate_up, down, seed=3)
    assert sorted(trainer.values) == [f"layer 0: expert {e} through its kernel" for e in range(E)]
    assert compare(_engine(gate_up, down, seed=3, tp=tp), trainer, tol=1e-9) == []
    # Expert 1's down matrix in another element order: its whole sums are unchanged, its outputs are not.
    scrambled = down.clone()
    scrambled[1] = down[1].flatten()[torch.randperm(HIDDEN * INTER, generator=g)].view(HIDDEN, INTER)
    bad = compare(_engine(gate_up, scrambled, seed=3, tp=tp), trainer, tol=1e-9)
    assert [d.key for d in bad] == ["layer 0: expert 1 through its kernel"]


def test_whole_sums_and_kernel_probe_together_in_one_stream() -> None:
    """observe (whole sums) and observe_experts (kernel outputs) over the same stream: both kinds of key."""
    g = torch.Generator().manual_seed(1)
    gate_up, down = torch.randn(E, 2 * INTER, HIDDEN, generator=g), torch.randn(E, HIDDEN, INTER, generator=g)
    fp = Fingerprint()
    stream = [*split_fused(f"{LAYER}.gate_up_proj", gate_up), *split_fused(f"{LAYER}.down_proj", down)]
    passed = list(observe_experts(observe(iter(stream), fp, 0, {}), ExpertOutputs(fp, 0)))
    assert [n for n, _ in passed] == [n for n, _ in stream]
    assert len(fp.values) == E * 3  # gate_up, down, through its kernel


@pytest.mark.parametrize("tp", [1, 2])
def test_a_bf16_kernels_rounding_stays_within_the_slack_at_many_seeds(tp: int) -> None:
    """bf16, tiny-moe's sizes and scale: the three reduced numbers cancel at random (a tenth of the outputs'
    norm at times), so the kernel's rounding reaches several percent of their largest; the slack, from the
    outputs' size, holds at every seed, and an expert's elements in another order are caught at every one.
    Every other seed, down's columns share a sign (as trained weights' may): the intermediate's rounding
    then adds up in the plain sum, which a slack from the outputs' size alone would not cover."""
    g = torch.Generator().manual_seed(2)
    experts, inter, hidden = 4, 128, 128
    worst = 0.0
    for seed in range(16):
        gate_up = (torch.randn(experts, 2 * inter, hidden, generator=g) * 0.05).to(torch.bfloat16)
        offset = 0.05 * (seed % 2)
        down = (torch.randn(experts, hidden, inter, generator=g) * 0.05 + offset).to(torch.bfloat16)
        trainer = _trainer(gate_up, down, seed=seed)
        engine = _engine(gate_up, down, seed=seed, tp=tp)
        assert compare(engine, trainer, tol=1e-9) == [], seed
        for key, t in trainer.values.items():
            e = engine.values[key]
            worst = max(worst, max(abs(a - b) for a, b in zip(e, t, strict=True)) / max(map(abs, t)))
        reordered = down.clone()
        reordered[1] = down[1].flatten().flip(0).view(hidden, inter)
        bad = compare(_engine(gate_up, reordered, seed=seed, tp=tp), trainer, tol=1e-9)
        assert [d.key for d in bad] == ["layer 0: expert 1 through its kernel"], seed
    # What a tolerance relative to the reduced numbers themselves would have had to allow.
    assert worst > 1e-2, worst
