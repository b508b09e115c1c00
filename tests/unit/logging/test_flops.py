"""spmdrl.logging.flops: the FLOPs of the three Qwen2.5 shapes against numbers worked out by hand here, the
training / recomputation multiples, and the peak table by the names torch.cuda.get_device_name reports.

The hand numbers, per decoder layer and token, forward (2 FLOPs a multiply-add), from the model cards'
config.json files:

Qwen2.5-0.5B: hidden 896, intermediate 4864, 24 layers, 14 query / 2 key-value heads of 64, vocab 151936
    q 2*896*896 = 1,605,632; k and v 2 * 2*896*128 = 458,752; o 2*896*896 = 1,605,632;
    MLP 3 * 2*896*4864 = 26,148,864; layer 29,818,880; x 24 layers = 715,653,120 per token
    (~2 x its 0.36B non-embedding parameters, biases and norms aside)
Qwen2.5-1.5B: hidden 1536, intermediate 8960, 28 layers, 12 / 2 heads of 128, vocab 151936
    q 2*1536*1536 = 4,718,592; k, v 2 * 2*1536*256 = 1,572,864; o 4,718,592; MLP 3 * 2*1536*8960 =
    82,575,360; layer 93,585,408; x 28 = 2,620,391,424 per token
Qwen2.5-7B: hidden 3584, intermediate 18944, 28 layers, 28 / 4 heads of 128, vocab 152064 (its config's
    vocab_size; the 0.5B and 1.5B have 151936)
    q 2*3584*3584 = 25,690,112; k, v 2 * 2*3584*512 = 7,340,032; o 25,690,112; MLP 3 * 2*3584*18944 =
    407,371,776; layer 466,092,032; x 28 = 13,050,576,896 per token

Attention of one 1024-token sequence, causal with the diagonal: 1024*1025/2 = 524,800 (query, key) pairs,
each 2 FLOPs for the score and 2 for the value per head dimension: 4 * heads * head_dim * 524,800 per layer:
    0.5B: 4*14*64*524,800 * 24 = 45,141,196,800; 1.5B: 4*12*128*524,800 * 28 = 90,282,393,600;
    7B: 4*28*128*524,800 * 28 = 210,658,918,400
LM head over 512 response positions: 2 * hidden * vocab * 512:
    0.5B: 2*896*151936*512 = 139,401,887,744; 1.5B: 2*1536*151936*512 = 238,974,664,704;
    7B: 2*3584*152064*512 = 558,077,313,024
"""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen2Config

from spmdrl.logging.flops import (
    DecoderShape,
    device_peak_flops,
    forward_flops,
    peak_flops,
    training_flops,
    utilization,
)
from spmdrl.testing.models import QWEN2_5_0_5B

QWEN = {
    # Tied like the real 0.5B; tying does not enter the count (the LM head is one matmul either way).
    "qwen2.5-0.5b": dict(QWEN2_5_0_5B),
    "qwen2.5-1.5b": dict(
        hidden_size=1536,
        intermediate_size=8960,
        num_hidden_layers=28,
        num_attention_heads=12,
        num_key_value_heads=2,
        vocab_size=151936,
    ),
    "qwen2.5-7b": dict(
        hidden_size=3584,
        intermediate_size=18944,
        num_hidden_layers=28,
        num_attention_heads=28,
        num_key_value_heads=4,
        vocab_size=152064,
    ),
}
# (dense per token, attention of 1024 tokens, LM head over 512 positions), from the docstring.
HAND = {
    "qwen2.5-0.5b": (715_653_120, 45_141_196_800, 139_401_887_744),
    "qwen2.5-1.5b": (2_620_391_424, 90_282_393_600, 238_974_664_704),
    "qwen2.5-7b": (13_050_576_896, 210_658_918_400, 558_077_313_024),
}


def shape(name: str) -> DecoderShape:
    return DecoderShape.from_hf_config(Qwen2Config(**QWEN[name]))


@pytest.mark.parametrize("name", sorted(QWEN))
def test_forward_flops_of_the_qwen_shapes_match_the_hand_count(name: str) -> None:
    dense, attention, head = HAND[name]
    s = shape(name)
    assert s.dense_per_token() == dense
    assert s.attention(1024) == attention
    assert s.lm_head(512) == head
    fwd = forward_flops(s, [1024], [512])
    assert fwd.model == fwd.hardware == 1024 * dense + attention + head


def test_full_attention_is_the_square_torchtitan_and_palm_count() -> None:
    # 0.5B, 1024 tokens: 4 * 14 * 64 * 1024^2 * 24 = 90,194,313,216 (the causal count x 2048/1025).
    assert shape("qwen2.5-0.5b").attention(1024, causal=False) == 90_194_313_216


def test_training_is_three_forwards_and_recomputation_counts_only_as_hardware_flops() -> None:
    dense, attention, head = HAND["qwen2.5-0.5b"]
    layers = 1024 * dense + attention
    s = shape("qwen2.5-0.5b")
    plain = training_flops(s, [1024], [512])
    assert plain.model == plain.hardware == 3 * (layers + head)
    full = training_flops(s, [1024], [512], recompute="full")
    assert full.model == 3 * (layers + head)
    assert full.hardware == 4 * layers + 3 * head  # the LM head is outside the checkpointed layers
    # Every 4th of the 24 layers: 6 of them, a quarter of the layers' forward once more.
    assert (
        training_flops(s, [1024], [512], recompute="full", every=4).hardware
        == 3 * (layers + head) + layers // 4
    )
    # MLP only, every layer: 3 * 2*896*4864 = 26,148,864 per token and layer, x 1024 tokens x 24 layers.
    mlp = training_flops(s, [1024], [512], recompute="mlp")
    assert mlp.hardware - mlp.model == 26_148_864 * 1024 * 24
    with pytest.raises(ValueError, match="recompute"):
        training_flops(s, [1024], [512], recompute="selective")


def test_sequences_add_up_with_their_own_lengths() -> None:
    s = shape("qwen2.5-0.5b")
    # Two sequences of 1024 and 512: attention is per sequence (not of a 1536-token one).
    both = forward_flops(s, [1024, 512], [512, 0]).model
    assert both == forward_flops(s, [1024], [512]).model + forward_flops(s, [512], [0]).model
    assert both < forward_flops(s, [1536], [512]).model
    with pytest.raises(ValueError, match="LM-head"):
        forward_flops(s, [1024, 512], [512])


def test_head_dim_of_its_own() -> None:
    # Qwen3-style: head_dim set apart from hidden / heads.
    cfg = Qwen2Config(**{**QWEN["qwen2.5-0.5b"], "num_attention_heads": 16, "num_key_value_heads": 8})
    cfg.head_dim = 128
    s = DecoderShape.from_hf_config(cfg)
    assert (s.heads, s.kv_heads, s.head_dim) == (16, 8, 128)
    # q 2*896*2048 = 3,670,016; k, v 2*2*896*1024 = 3,670,016; o 2*2048*896 = 3,670,016; MLP 26,148,864:
    # 37,158,912 per layer.
    assert s.dense_per_token() == 24 * 37_158_912


@pytest.mark.parametrize(
    ("device_name", "tflops"),
    [
        ("NVIDIA H100 80GB HBM3", 989.5),
        ("NVIDIA H100 NVL", 835.5),
        ("NVIDIA H100 PCIe", 756.5),
        ("NVIDIA H200", 989.5),
        ("NVIDIA H200 NVL", 835.5),
        ("NVIDIA GH200 480GB", 989.5),
        ("NVIDIA A100-SXM4-80GB", 312.0),
        ("NVIDIA A100 80GB PCIe", 312.0),
        ("NVIDIA L40S", 362.05),
        ("NVIDIA L40", 181.05),
        ("NVIDIA L4", 121.0),
        ("NVIDIA B200", 2250.0),
        ("AMD Instinct MI300X", 1307.4),
    ],
)
def test_peak_by_device_name(device_name: str, tflops: float) -> None:
    assert peak_flops(device_name) == pytest.approx(tflops * 1e12)


def test_unknown_device_and_cpu_have_no_peak_and_no_mfu() -> None:
    assert peak_flops("NVIDIA GeForce GTX 1080") is None
    assert device_peak_flops(torch.device("cpu")) is None
    assert utilization(1e12, 1.0, 1, None) is None  # None, not 0: no MFU is reported
    assert utilization(1e12, 0.0, 1, 1e12) is None
    assert utilization(989.5e12, 2.0, 2, 989.5e12) == pytest.approx(0.25)
