"""LoRA (spmdrl/models/lora.py): the adapted layer computes the merged weight's product, only adapters
train and enter the optimizer, the sync's merged stream is the base model's names and order, and a wrong
target module name fails listing the model's linear modules."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from transformers import Qwen2Config, Qwen2ForCausalLM

from spmdrl.config import ConfigError, LoraConfig, OptimConfig
from spmdrl.models.lora import (
    LoraLinear,
    apply_lora,
    initial_adapter_weights,
    is_adapter_param,
    linear_module_names,
    lora_scale,
    merge_state_dict,
    merged,
)
from spmdrl.optim import build_optimizer
from spmdrl.rollout.weight_sync import engine_shapes, engine_weights, trainer_weights
from spmdrl.testing.models import SMALL_QWEN2


def _lora_model(target: list[str], *, rank: int = 4, alpha: float = 8.0) -> Qwen2ForCausalLM:
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(**SMALL_QWEN2))
    apply_lora(model, LoraConfig(rank=rank, alpha=alpha, target_modules=target))
    with torch.no_grad():  # B = 0 at start; a trained-looking B makes the adapter count
        for mod in model.modules():
            if isinstance(mod, LoraLinear):
                mod.lora_B.weight.normal_(0, 0.1)
    return model


def test_the_adapted_layer_equals_the_dense_product_of_the_merged_weight() -> None:
    torch.manual_seed(0)
    base = nn.Linear(16, 8)
    layer = LoraLinear(base, rank=2, alpha=6.0, dropout=0.0)
    with torch.no_grad():
        layer.lora_B.weight.normal_()
    x = torch.randn(3, 5, 16)
    w = merged(layer.weight, layer.lora_A.weight, layer.lora_B.weight, 3.0)
    torch.testing.assert_close(layer(x), x @ w.T + layer.bias, rtol=1e-5, atol=1e-5)
    # W + (alpha / r) B A, written out
    torch.testing.assert_close(w, base.weight + 3.0 * layer.lora_B.weight @ layer.lora_A.weight)


def test_merged_model_gives_the_adapted_model_logits() -> None:
    model = _lora_model(["all-linear"])
    ids = torch.randint(0, 64, (2, 9))
    dense = Qwen2ForCausalLM(Qwen2Config(**SMALL_QWEN2))
    dense.load_state_dict(merge_state_dict(model.state_dict(), lora_scale(model) or 0.0))
    torch.testing.assert_close(model(ids).logits, dense(ids).logits, rtol=1e-4, atol=1e-5)


def test_only_adapters_get_gradients_and_enter_the_optimizer() -> None:
    model = _lora_model(["q_proj", "v_proj"])
    model(torch.randint(0, 64, (2, 7))).logits.sum().backward()
    with_grad = {n for n, p in model.named_parameters() if p.grad is not None}
    adapters = {n for n, _ in model.named_parameters() if is_adapter_param(n)}
    assert with_grad == adapters
    assert len(adapters) == 2 * 2 * SMALL_QWEN2["num_hidden_layers"]  # A and B of q and v per layer
    opt = build_optimizer(model, OptimConfig())
    in_opt = {id(p) for g in opt.param_groups for p in g["params"]}
    assert in_opt == {id(p) for n, p in model.named_parameters() if is_adapter_param(n)}


def test_all_linear_targets_every_linear_but_the_lm_head() -> None:
    model = _lora_model(["all-linear"])
    adapted = {n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, LoraLinear)}
    assert adapted == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    assert not isinstance(model.lm_head, LoraLinear)


def test_an_unknown_target_module_fails_listing_the_linear_modules() -> None:
    model = Qwen2ForCausalLM(Qwen2Config(**SMALL_QWEN2))
    with pytest.raises(ConfigError, match="qkv_proj") as e:
        apply_lora(model, LoraConfig(rank=4, target_modules=["qkv_proj"]))
    for name in linear_module_names(model):
        assert name in str(e.value)
    assert "lm_head" not in str(e.value)


def test_the_engine_stream_is_the_base_models_names_in_order_with_merged_weights() -> None:
    model = _lora_model(["all-linear"])
    base = Qwen2ForCausalLM(Qwen2Config(**SMALL_QWEN2))
    sent = list(engine_weights(model, ((n, p.detach()) for n, p in trainer_weights(model))))
    assert [n for n, _ in sent] == [n for n, _ in trainer_weights(base)]  # biases after their weight too
    assert [(n, t.shape) for n, t in sent] == engine_shapes(model)
    want = merge_state_dict(model.state_dict(), lora_scale(model) or 0.0)
    for name, t in sent:
        torch.testing.assert_close(t, want[name])
    # the merge changed the adapted weights (B != 0) and nothing else
    q = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(dict(sent)[q], model.state_dict()[q])


def test_initial_adapters_start_at_the_base_model_and_agree_across_calls() -> None:
    model = _lora_model(["q_proj"])
    a, b = initial_adapter_weights(model, seed=0), initial_adapter_weights(model, seed=0)
    assert a.keys() == {n for n, _ in model.named_parameters() if is_adapter_param(n)}
    for k in a:
        assert torch.equal(a[k], b[k])  # every rank cuts its shard out of the same tensor
        assert torch.count_nonzero(a[k]) == 0 if k.endswith("lora_B.weight") else a[k].abs().sum() > 0
