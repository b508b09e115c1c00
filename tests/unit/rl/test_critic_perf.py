"""spmdrl/rl/perf.py, the critic's part: a value model's FLOPs (the decoder without the LM head's vocabulary
matmul, plus a hidden x 1 head at every position), its tokens/s and MFU, and the actor's metrics during
PPO's critic warm-up (no update to measure).

One process for the pure functions and their metrics, two gloo processes for the sum over a role's ranks.
A CPU has no peak, so the MFU path is checked by giving the module an H100's (the only fake here: a CPU
cannot report one), against FLOPs counted by hand in this file.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from transformers import Qwen2Config

from spmdrl.config import ModelConfig
from spmdrl.logging.flops import DecoderShape
from spmdrl.rl import perf
from spmdrl.rl.batch import PolicyBatch
from spmdrl.testing.spawn import run_distributed

CPU = torch.device("cpu")
PEAK = 989.5e12


def _config() -> Qwen2Config:
    # 2 layers, hidden 64, intermediate 128, 4 query / 2 key-value heads of 16, vocab 100, one label (a
    # value model's config, as transformers' token-classification class reads it).
    return Qwen2Config(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=100,
        num_labels=1,
    )


class _Model(torch.nn.Module):
    """What the perf metrics read of a model: its HF config."""

    def __init__(self) -> None:
        super().__init__()
        self.config = _config()


def _batch() -> PolicyBatch:
    # Row 0: 3 prompt + 2 response tokens; row 1: 2 prompt + 1 response, then 2 of padding.
    attn = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]])
    resp = torch.tensor([[0, 0, 0, 1, 1], [0, 0, 1, 0, 0]], dtype=torch.bool)
    z = torch.zeros(2, 5)
    return PolicyBatch(torch.zeros(2, 5, dtype=torch.long), attn, resp, z, z)


# By hand, for the 8 real tokens of _batch (5 + 3). Per token and layer: q 2*64*64 = 8,192; k, v
# 2*2*64*32 = 8,192; o 8,192; MLP 3*2*64*128 = 49,152: 73,728; x 2 layers = 147,456. Attention, causal,
# 2*2*4*16 = 256 per (query, key) pair and layer, x 2 layers: row 0 has 5*6/2 = 15 pairs, row 1 3*4/2 = 6:
# 21 * 512 = 10,752. The value head: 2*64*1 = 128 per token, at all 8 tokens: 1,024 (the actor's LM head
# would be 2*64*100 = 12,800 at its 3 response tokens instead).
LAYERS = 8 * 147_456 + 10_752
VALUE_FORWARD = LAYERS + 8 * 128  # 1,191,424
MLP_PER_TOKEN_AND_LAYER = 2 * 3 * 64 * 128  # 49,152: what model.activation_checkpointing=mlp recomputes
ACTOR_FORWARD = LAYERS + 3 * 12_800


EPOCHS = 2  # algorithm.ppo_epochs


def _model(ac: str = "off") -> ModelConfig:
    return ModelConfig(activation_checkpointing=ac)


def test_value_model_flops_by_hand() -> None:
    shape = DecoderShape.from_hf_config(_config())
    assert perf.value_shape(shape).vocab == 1 and perf.value_shape(shape).layers == shape.layers
    tokens = [5, 3]
    forward = perf.value_forward_flops(shape, tokens)
    assert forward.model == forward.hardware == VALUE_FORWARD
    train = perf.value_training_flops(shape, tokens)
    assert train.model == train.hardware == 3 * VALUE_FORWARD
    full = perf.value_training_flops(shape, tokens, recompute="full")
    assert full.model == 3 * VALUE_FORWARD and full.hardware == 3 * VALUE_FORWARD + LAYERS  # the head not
    mlp = perf.value_training_flops(shape, tokens, recompute="mlp", every=2)  # layer 2 of 2 only
    assert mlp.hardware == 3 * VALUE_FORWARD + 8 * MLP_PER_TOKEN_AND_LAYER


def test_critic_tokens_per_s_everywhere_and_no_mfu_without_a_peak() -> None:
    timings = {"timing/critic_update_s": 4.0, "timing/values_s": 0.5, "timing/actor_update_s": 1.0}
    m = perf.critic_perf_metrics(_model(), EPOCHS, _Model(), _batch(), timings, device=CPU)
    # 8 real tokens x 2 PPO epochs / 1 rank / 4 s: the critic's own time, not the actor's.
    assert m == {"perf/critic_tokens_per_s_update": pytest.approx(4.0)}


def test_critic_mfu_of_the_update_and_the_values_pass(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(perf, "device_peak_flops", lambda device: PEAK)
    timings = {"timing/critic_update_s": 4.0, "timing/values_s": 0.5, "timing/old_ref_s": 9.0}
    m = perf.critic_perf_metrics(_model(), EPOCHS, _Model(), _batch(), timings, device=CPU)
    assert m["perf/critic_mfu"] == pytest.approx(2 * 3 * VALUE_FORWARD / 4.0 / PEAK)  # 2 epochs x 3 forwards
    assert m["perf/critic_hfu"] == m["perf/critic_mfu"]  # nothing recomputed
    assert m["perf/critic_mfu_forward"] == pytest.approx(VALUE_FORWARD / 0.5 / PEAK)  # one values pass
    assert not any(k.startswith("perf/") and "critic" not in k for k in m)  # none of the actor's keys
    ac = perf.critic_perf_metrics(_model(ac="full"), EPOCHS, _Model(), _batch(), timings, device=CPU)
    assert ac["perf/critic_mfu"] == m["perf/critic_mfu"]  # MFU counts model FLOPs only
    assert ac["perf/critic_hfu"] == pytest.approx(2 * (3 * VALUE_FORWARD + LAYERS) / 4.0 / PEAK)


def test_critic_without_its_phase_timings_logs_no_mfu(monkeypatch: pytest.MonkeyPatch) -> None:
    """On an actor rank's view of the timings (no critic phase), nothing is divided by a zero time."""
    monkeypatch.setattr(perf, "device_peak_flops", lambda device: PEAK)
    m = perf.critic_perf_metrics(_model(), EPOCHS, _Model(), _batch(), {}, device=CPU)
    assert set(m) == {"perf/critic_tokens_per_s_update"}


def test_actor_during_the_critic_warm_up_reports_only_its_forwards(monkeypatch: pytest.MonkeyPatch) -> None:
    """PPO's critic.warmup_steps: the actor did not update, so no update speed; its old/ref passes ran."""
    timings = {"timing/actor_update_s": 2.0, "timing/old_ref_s": 0.5}
    cpu = perf.actor_perf_metrics(
        _model(),
        EPOCHS,
        _Model(),
        _batch(),
        timings,
        forward_passes=2,
        device=CPU,
        trained=False,
    )
    assert cpu == {}  # no peak, no update: nothing to report
    monkeypatch.setattr(perf, "device_peak_flops", lambda device: PEAK)
    m = perf.actor_perf_metrics(
        _model(),
        EPOCHS,
        _Model(),
        _batch(),
        timings,
        forward_passes=2,
        device=CPU,
        trained=False,
    )
    assert m == {"perf/mfu_forward": pytest.approx(2 * ACTOR_FORWARD / 0.5 / PEAK)}


def _two_ranks(rank: int, world_size: int) -> None:
    """Rank r holds r + 1 copies of _batch's rows: the FLOPs and tokens are summed over both ranks and
    divided by both ranks' devices, the same figures on each."""
    perf.device_peak_flops = lambda device: PEAK  # this child process's module: a CPU has no peak
    batch = PolicyBatch.concat([_batch()] * (rank + 1))
    timings = {"timing/critic_update_s": 4.0, "timing/values_s": 0.5}
    m = perf.critic_perf_metrics(
        _model(),
        EPOCHS,
        _Model(),
        batch,
        timings,
        device=CPU,
        group=dist.group.WORLD,
    )
    assert m["perf/critic_tokens_per_s_update"] == pytest.approx(3 * 8 * 2 / 2 / 4.0)
    assert m["perf/critic_mfu"] == pytest.approx(3 * 2 * 3 * VALUE_FORWARD / 4.0 / 2 / PEAK)
    assert m["perf/critic_mfu_forward"] == pytest.approx(3 * VALUE_FORWARD / 0.5 / 2 / PEAK)


def test_critic_metrics_sum_over_the_critic_ranks() -> None:
    run_distributed(_two_ranks, 2, timeout_s=120)
