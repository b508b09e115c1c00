"""spmdrl/rl/perf.py: the actor's tokens/s and MFU from a batch's real lengths and the step's times.

One process, a real (random, small) Qwen2's config. A CPU has no peak, so no MFU is reported there; the
MFU path is checked by giving the module the peak of an H100 (the only fake here: a CPU cannot report
one), against the FLOPs worked out by hand in the test.
"""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen2Config

from spmdrl.config import ModelConfig
from spmdrl.rl import perf
from spmdrl.rl.batch import PolicyBatch

CPU = torch.device("cpu")


class _Model(torch.nn.Module):
    """What actor_perf_metrics reads of the actor: its HF config."""

    def __init__(self) -> None:
        super().__init__()
        # 2 layers, hidden 64, intermediate 128, 4 query / 2 key-value heads of 16, vocab 100.
        self.config = Qwen2Config(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=100,
        )


def _batch() -> PolicyBatch:
    # Row 0: 3 prompt + 2 response tokens; row 1: 2 prompt + 1 response, then 2 of padding.
    attn = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]])
    resp = torch.tensor([[0, 0, 0, 1, 1], [0, 0, 1, 0, 0]], dtype=torch.bool)
    z = torch.zeros(2, 5)
    return PolicyBatch(torch.zeros(2, 5, dtype=torch.long), attn, resp, z, z)


# By hand. Per token and layer: q 2*64*64 = 8,192; k, v 2*2*64*32 = 8,192; o 8,192; MLP 3*2*64*128 = 49,152:
# 73,728; x 2 layers = 147,456. Attention, causal, 4*4*16 = 256 per (query, key) pair and layer, x 2 layers:
# row 0 has 5*6/2 = 15 pairs, row 1 3*4/2 = 6: 21 * 512 = 10,752. LM head 2*64*100 = 12,800 per response
# token, 3 of them: 38,400. Forward: 8 real tokens * 147,456 + 10,752 + 38,400 = 1,228,800.
FORWARD = 8 * 147_456 + 10_752 + 38_400
LAYERS = 8 * 147_456 + 10_752


EPOCHS = 2  # algorithm.ppo_epochs


def _model(ac: str = "off") -> ModelConfig:
    return ModelConfig(activation_checkpointing=ac)


def test_tokens_per_s_everywhere_and_no_mfu_without_a_peak() -> None:
    timings = {"timing/actor_update_s": 2.0, "timing/old_ref_s": 0.5}
    m = perf.actor_perf_metrics(_model(), EPOCHS, _Model(), _batch(), timings, forward_passes=2, device=CPU)
    # 8 real tokens x 2 PPO epochs / 1 rank / 2 s.
    assert m == {"perf/tokens_per_s_update": pytest.approx(8.0)}


def test_mfu_of_the_update_and_the_forward_with_a_known_peak(monkeypatch: pytest.MonkeyPatch) -> None:
    peak = 989.5e12
    monkeypatch.setattr(perf, "device_peak_flops", lambda device: peak)
    timings = {"timing/actor_update_s": 2.0, "timing/old_ref_s": 0.5}
    m = perf.actor_perf_metrics(_model(), EPOCHS, _Model(), _batch(), timings, forward_passes=2, device=CPU)
    assert m["perf/mfu_update"] == pytest.approx(2 * 3 * FORWARD / 2.0 / peak)  # 2 epochs of 3 forwards
    assert m["perf/hfu_update"] == m["perf/mfu_update"]  # nothing recomputed
    assert m["perf/mfu_forward"] == pytest.approx(2 * FORWARD / 0.5 / peak)  # old + ref passes
    ac = perf.actor_perf_metrics(
        _model(ac="full"),
        EPOCHS,
        _Model(),
        _batch(),
        timings,
        forward_passes=0,
        device=CPU,
    )
    assert ac["perf/mfu_update"] == m["perf/mfu_update"]  # MFU counts model FLOPs only
    assert ac["perf/hfu_update"] == pytest.approx(2 * (3 * FORWARD + LAYERS) / 2.0 / peak)
    assert "perf/mfu_forward" not in ac  # no old/ref pass ran
