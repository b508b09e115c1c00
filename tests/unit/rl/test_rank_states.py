"""The models' state per rank that the token budgets subtract (spmdrl.rl.token_budgets.rank_states): LoRA's
adapters and the one-output heads counted from the shape agree with the real modules (built on the meta
device, at real models' shapes), and each placement counts the models its ranks hold, sharded over that
role's ranks. tests/integration/test_memory_state_real.py compares the bytes with built FSDP2 models."""

from __future__ import annotations

import copy
import logging
from pathlib import Path

import pytest
import torch
from transformers import (
    AutoModelForSequenceClassification,
    AutoModelForTokenClassification,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from spmdrl.config import ConfigError, LoraConfig
from spmdrl.config_loader import load_config
from spmdrl.distributed.placement import Placement
from spmdrl.models.grad_sync import auto_defers
from spmdrl.models.lora import apply_lora
from spmdrl.models.memory_model import DecoderShape, lora_adapter_params
from spmdrl.rl.token_budgets import (
    RankState,
    check_reward_model_pass,
    rank_states,
    reward_model_shape,
    state_bytes,
)
from spmdrl.testing.models import QWEN2_5_0_5B

# Qwen2.5-0.5B's config (tied, q/k/v biases) and a small untied Llama (no biases).
QWEN = Qwen2Config(**QWEN2_5_0_5B)
LLAMA = LlamaConfig(
    hidden_size=512,
    intermediate_size=1376,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=2,
    vocab_size=32000,
    tie_word_embeddings=False,
)
SHAPE = DecoderShape.from_hf(QWEN)
RM = DecoderShape(1536, 8960, 28, 12, 2, 151936, tied_embeddings=True)  # another shape: Qwen2.5-1.5B's


def _count(model: torch.nn.Module, adapters: bool | None = None) -> int:
    return sum(
        p.numel() for n, p in model.named_parameters() if adapters is None or ("lora_" in n) == adapters
    )


@pytest.mark.parametrize("config", [QWEN, LLAMA], ids=["qwen2", "llama"])
@pytest.mark.parametrize("targets", [["all-linear"], ["q_proj", "v_proj"], ["gate_proj", "o_proj", "k_proj"]])
def test_adapter_and_base_counts_match_the_adapted_module(config: object, targets: list[str]) -> None:
    with torch.device("meta"):
        model = (Qwen2ForCausalLM if isinstance(config, Qwen2Config) else LlamaForCausalLM)(config)
    shape = DecoderShape.from_hf(config)
    assert _count(model) == shape.params
    apply_lora(model, LoraConfig(rank=16, target_modules=targets))
    assert _count(model, adapters=True) == lora_adapter_params(shape, 16, targets)
    assert _count(model, adapters=False) == shape.params  # the base is unchanged


@pytest.mark.parametrize(
    ("auto", "head"),
    [(AutoModelForTokenClassification, "value"), (AutoModelForSequenceClassification, "reward")],
)
def test_one_output_heads_match_the_critic_and_reward_model_classes(auto: type, head: str) -> None:
    for base in (QWEN, LLAMA):
        config = copy.deepcopy(base)
        config.num_labels = 1
        with torch.device("meta"):
            model = auto.from_config(config)
        assert _count(model) == DecoderShape.from_hf(config).params_with_head(head), (auto, type(config))


def test_an_unknown_lora_target_names_the_fix() -> None:
    with pytest.raises(ConfigError, match=r"qkv_proj.*trainer.ppo_max_token_len_per_gpu"):
        lora_adapter_params(SHAPE, 8, ["qkv_proj"])


def _states(
    overrides: list[str], placement: Placement, *, critic: bool = False, rm: bool = False
) -> list[RankState]:
    cfg = load_config(["recipe=grpo_gsm8k", *overrides])  # a KL loss: a reference
    return rank_states(cfg, SHAPE, placement, needs_critic=critic, rm_shape=RM if rm else None)


RM_ON = ["reward_model.enable=true", "reward_model.path=rm"]


def test_lora_actor_reference_and_reward_model_colocated() -> None:
    P, S = SHAPE.params, 8
    A = lora_adapter_params(SHAPE, 32, ["all-linear"])
    (s,) = _states(["model.lora.rank=32", *RM_ON], Placement.colocated(S), rm=True)
    assert s.actor == (2 * P + 16 * A) // S  # the frozen base in bf16 (as the reference) + adapters x 16
    assert s.ref == 0  # the reference is the actor with its adapters off: no copy of its own
    assert s.reward_model == 2 * RM.params_with_head("reward") // S  # its own shape, over the actor's ranks
    assert s.total == s.actor + s.reward_model
    # defer_grad_sync keeps the unsharded gradients of the trained parameters only: the adapters'.
    (d,) = _states(["model.lora.rank=32", "trainer.defer_grad_sync=true"], Placement.colocated(S))
    assert d.deferred_grads == 4 * A
    # auto (the default) defers only where a rank's shard is the whole gradient anyway: nothing to count.
    (auto,) = _states(["model.lora.rank=32"], Placement.colocated(S))
    assert auto.deferred_grads == 0
    # Nor on one rank, where deferring holds what the shard's gradients would.
    (one,) = _states(["trainer.defer_grad_sync=true"], Placement.colocated(1))
    assert one.deferred_grads == 0 and one.actor == 16 * P
    # Offloaded shards keep their gradients in host memory: deferred ones would stay on the device.
    (off,) = _states(["trainer.defer_grad_sync=true", "model.offload_params=true"], Placement.colocated(1))
    assert off.deferred_grads == 4 * P and off.actor == 0


def test_auto_defers_only_where_it_costs_no_device_memory() -> None:
    assert auto_defers(1, offloaded=False)  # one shard rank: the shard is the whole gradient
    assert not auto_defers(2, offloaded=False)  # sharded: the unsharded gradients are N x the shard's
    assert not auto_defers(1, offloaded=True)  # the shards' gradients in host memory, the deferred on the GPU


def test_split_counts_each_roles_ranks_and_the_busier_one_plans() -> None:
    P, Pc = SHAPE.params, SHAPE.params_with_head("value")
    actor, critic = _states(RM_ON, Placement.split(8, critic_ranks=2), critic=True, rm=True)
    assert (actor.ranks, critic.ranks) == ("actor", "critic")
    assert (actor.actor, actor.ref, actor.critic) == (16 * P // 6, 2 * P // 6, 0)
    assert actor.reward_model == 2 * RM.params_with_head("reward") // 6  # the actor's ranks score
    assert (critic.actor, critic.ref, critic.reward_model, critic.critic) == (0, 0, 0, 16 * Pc // 2)
    cfg = load_config(["recipe=grpo_gsm8k", *RM_ON])
    busiest = state_bytes(cfg, SHAPE, Placement.split(8, 2), needs_critic=True, rm_shape=RM)
    assert busiest == max(actor.total, critic.total) == critic.total  # 2 critic ranks: the busier
    # HSDP shards within a replica group only.
    hsdp, _ = _states([], Placement.split(8, 4, dp_replicate=2), critic=True)
    assert hsdp.actor == 16 * P // 2


def test_async_trainer_ranks_hold_no_reward_model() -> None:
    (s,) = _states(RM_ON, Placement.asynchronous(8, rollout_ranks=2), rm=True)
    assert (s.actor, s.reward_model) == (16 * SHAPE.params // 6, 0)


def test_the_log_line_names_each_part() -> None:
    (s,) = _states(RM_ON, Placement.colocated(8), rm=True)
    assert s.describe().startswith("actor ranks ")
    assert all(f"{k} " in s.describe() for k in ("actor", "ref", "reward_model"))
    assert "critic" not in s.describe()
    # Under LoRA the reference is the actor with its adapters off: no part of its own.
    (lora,) = _states(["model.lora.rank=8", *RM_ON], Placement.colocated(8), rm=True)
    assert "ref " not in lora.describe() and "reward_model " in lora.describe()


def test_reward_model_path_is_checked_before_its_shape_is_read(tmp_path: Path) -> None:
    assert reward_model_shape(load_config(["recipe=grpo_tiny"])) is None
    cfg = load_config(["recipe=grpo_tiny", "reward_model.enable=true", f"reward_model.path={tmp_path}"])
    with pytest.raises(ConfigError, match="reward_model.path.*no config.json"):
        reward_model_shape(cfg)


def test_a_reward_model_pass_that_does_not_fit_beside_the_engine_warns(
    caplog: pytest.LogCaptureFixture,
) -> None:
    cfg = load_config(["recipe=grpo_gsm8k", *RM_ON, "reward_model.micro_batch_size_per_gpu=64"])
    with caplog.at_level(logging.WARNING, logger="spmdrl.rl.token_budgets"):
        need = check_reward_model_pass(cfg, RM, room=2**30)
    assert need > 2**30
    assert "reward_model.micro_batch_size_per_gpu" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="spmdrl.rl.token_budgets"):
        assert check_reward_model_pass(cfg, RM, room=need) == need
    assert not caplog.text


def test_padded_rows_of_causal_sdpa_models_count_no_mask() -> None:
    """The RL models attend with causal SDPA and no mask (spmdrl.models.causal_attention) unless a layer
    needs transformers' own mask: padded rows then cost what varlen's do."""
    import dataclasses

    from spmdrl.models.memory_model import token_budgets
    from spmdrl.rl.token_budgets import memory_inputs

    shape = DecoderShape(896, 4864, 24, 14, 2, 151936, tied_embeddings=True)
    cfg = load_config(["recipe=grpo_gsm8k", "model.use_fused_kernels=false"])
    causal = memory_inputs(cfg, shape, "torch_varlen", padded_mask=False)
    masked = memory_inputs(cfg, shape, "torch_varlen")
    assert (causal.attention, masked.attention) == ("causal", "padded")
    kwargs = {"free_bytes": 60 * 2**30, "state_bytes": 0, "reserve_bytes": 0, "max_len": 1536}
    varlen = token_budgets(dataclasses.replace(causal, attention="varlen"), **kwargs)
    got = token_budgets(causal, **kwargs)
    assert got.train_bytes_per_token == varlen.train_bytes_per_token
    assert token_budgets(masked, **kwargs).train_bytes_per_token == got.train_bytes_per_token + 3 * 1536
