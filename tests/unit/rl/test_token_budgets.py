"""Token budgets of the RL passes: the config keys (verl's names) resolved by derive_rl, their errors,
and the memory model's inputs read from a config (spmdrl/rl/token_budgets.py). No GPU here: the memory
measurement itself (torch.cuda.mem_get_info) cannot run on CPU, so the budgets from memory are passed to
derive_rl as a figure, as build_job passes the measured ones."""

from __future__ import annotations

import pytest
import torch

from spmdrl.config import ConfigError, derive, derive_rl
from spmdrl.config_loader import load_config
from spmdrl.distributed.placement import plan_placement
from spmdrl.models.memory_model import DecoderShape
from spmdrl.rl.token_budgets import memory_inputs, rank_states, state_bytes, wants_memory_budgets

# grpo_tiny: prompts up to 64 tokens, responses up to 24 (its recipe): the longest row is 88 tokens.
TINY = ["recipe=grpo_tiny"]


def _rl(overrides: list[str], memory: tuple[int, int] | None = None):  # noqa: ANN202 - RLDerived
    cfg = load_config(TINY + overrides)
    return cfg, derive_rl(cfg, derive(cfg, 2, 1000, samples_per_item=cfg.rollout.n), memory_budgets=memory)


def _longest(cfg) -> int:  # noqa: ANN001
    return cfg.rollout.max_model_len or cfg.data.max_prompt_length + cfg.data.max_response_length


def test_defaults_are_auto_and_keep_sequence_counts_on_cpu() -> None:
    cfg, rl = _rl([])
    assert (cfg.trainer.ppo_max_token_len_per_gpu, cfg.trainer.log_prob_max_token_len_per_gpu) == (-1, -1)
    assert (rl.ppo_max_token_len, rl.log_prob_max_token_len) == (0, 0)  # today's micro_batch_size sequences
    assert not wants_memory_budgets(cfg, torch.device("cpu"))
    assert wants_memory_budgets(cfg, torch.device("cuda"))


def test_explicit_budgets_and_the_no_grad_default() -> None:
    _, rl = _rl(["trainer.ppo_max_token_len_per_gpu=512", "trainer.log_prob_max_token_len_per_gpu=2048"])
    assert (rl.ppo_max_token_len, rl.log_prob_max_token_len) == (512, 2048)
    # Auto no-grad budget without a measurement (CPU): the update's micro-batches, as before.
    _, rl = _rl(["trainer.ppo_max_token_len_per_gpu=512"])
    assert (rl.ppo_max_token_len, rl.log_prob_max_token_len) == (512, 512)
    # 0: sequence counts for the update, a budget for the no-grad passes only.
    _, rl = _rl(["trainer.ppo_max_token_len_per_gpu=0", "trainer.log_prob_max_token_len_per_gpu=4096"])
    assert (rl.ppo_max_token_len, rl.log_prob_max_token_len) == (0, 4096)


def test_measured_budgets_fill_only_the_keys_left_at_auto() -> None:
    _, rl = _rl([], memory=(30720, 69888))
    assert (rl.ppo_max_token_len, rl.log_prob_max_token_len) == (30720, 69888)
    _, rl = _rl(["trainer.ppo_max_token_len_per_gpu=0"], memory=(30720, 69888))
    assert (rl.ppo_max_token_len, rl.log_prob_max_token_len) == (0, 69888)
    _, rl = _rl(["trainer.log_prob_max_token_len_per_gpu=1024"], memory=(30720, 69888))
    assert (rl.ppo_max_token_len, rl.log_prob_max_token_len) == (30720, 1024)


def test_micro_batch_tokens_is_the_older_name_of_both() -> None:
    cfg, rl = _rl(["trainer.micro_batch_tokens=300"], memory=(30720, 69888))
    assert (rl.ppo_max_token_len, rl.log_prob_max_token_len) == (300, 300)
    assert not wants_memory_budgets(cfg, torch.device("cuda"))


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        (["trainer.ppo_max_token_len_per_gpu=-2"], r"ppo_max_token_len_per_gpu=-2: use -1"),
        (["trainer.log_prob_max_token_len_per_gpu=-7"], r"log_prob_max_token_len_per_gpu=-7: use -1"),
        # Shorter than one longest row (64 + 24 = 88 tokens in grpo_tiny).
        (["trainer.ppo_max_token_len_per_gpu=80"], r"ppo_max_token_len_per_gpu=80 is smaller than .* 88"),
        (
            ["trainer.log_prob_max_token_len_per_gpu=87"],
            r"log_prob_max_token_len_per_gpu=87 .* at least 88",
        ),
        (
            ["trainer.micro_batch_tokens=300", "trainer.ppo_max_token_len_per_gpu=400"],
            r"older name of trainer.ppo_max_token_len_per_gpu",
        ),
        (["trainer.micro_batch_tokens=-1"], r"micro_batch_tokens must be >= 0.*replacements"),
        (["trainer.memory_reserve_gib=-1"], r"memory_reserve_gib must be >= 0"),
    ],
)
def test_bad_budgets_fail_at_load(overrides: list[str], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        load_config(TINY + overrides)


def test_a_budget_of_exactly_one_longest_row_is_accepted() -> None:
    cfg = load_config(TINY)
    _, rl = _rl([f"trainer.ppo_max_token_len_per_gpu={_longest(cfg)}"])
    assert rl.ppo_max_token_len == 88


def test_memory_inputs_follow_the_model_section() -> None:
    shape = DecoderShape(896, 4864, 24, 14, 2, 151936, tied_embeddings=True)
    cfg = load_config(
        [
            "recipe=grpo_gsm8k",
            "trainer.pack_sequences=true",
            "model.activation_checkpointing=mlp",
            "model.activation_checkpointing_every=2",
        ]
    )
    m = memory_inputs(cfg, shape, "torch_varlen")
    assert (m.compute_bytes, m.activation_checkpointing, m.checkpoint_every) == (2, "mlp", 2)
    assert m.fused_chunk_tokens == cfg.model.fused_chunk_tokens  # auto fuses a 151,936-token vocabulary
    assert m.attention == "varlen"
    assert memory_inputs(cfg, shape, "mask").attention == "packed_mask"
    padded = load_config(["recipe=grpo_gsm8k", "model.use_fused_kernels=false"])
    m = memory_inputs(padded, shape, "torch_varlen")
    assert (m.attention, m.fused_chunk_tokens, m.activation_checkpointing) == ("padded", 0, "full")


def test_state_counts_trained_and_frozen_models_and_offload() -> None:
    shape = DecoderShape(896, 4864, 24, 14, 2, 151936, tied_embeddings=True)
    P = shape.params
    cfg = load_config(["recipe=grpo_gsm8k"])  # KL loss: a reference
    placement = plan_placement(cfg.parallel, 8, needs_critic=False)
    # The actor 16 bytes a parameter; the reference stored in bf16 (param_dtype auto on CUDA), 2.
    assert state_bytes(cfg, shape, placement, needs_critic=False) == 16 * P // 8 + 2 * P // 8
    offloaded = load_config(["recipe=grpo_gsm8k", "model.offload_params=true", "model.offload_ref=true"])
    assert state_bytes(offloaded, shape, placement, needs_critic=False) == 0
    ppo = load_config(["recipe=ppo_gsm8k"])
    colocated = plan_placement(ppo.parallel, 8, needs_critic=True)
    with_ref = ppo.algorithm.use_kl_loss or ppo.algorithm.use_kl_in_reward
    Pc = shape.params_with_head("value")  # the critic: a one-output value head instead of the LM head
    expected = 16 * P // 8 + 16 * Pc // 8 + (2 * P // 8 if with_ref else 0)
    assert state_bytes(ppo, shape, colocated, needs_critic=True) == expected


def test_state_counts_the_teacher_where_it_lives() -> None:
    """On-policy distillation's teacher: frozen, in teacher.dtype, sharded over the actor's ranks (added to
    their state) or over its own ranks (parallel.teacher_ranks: a rank kind of its own); none offloaded."""
    shape = DecoderShape(896, 4864, 24, 14, 2, 151936, tied_embeddings=True)
    teacher = DecoderShape(2048, 11008, 36, 16, 2, 151936, tied_embeddings=True)
    P, T = shape.params, teacher.params

    def states(*overrides: str) -> dict[str, int]:
        cfg = load_config(["recipe=grpo_gsm8k", "teacher.path=Qwen/Qwen2.5-3B-Instruct", *overrides])
        placement = plan_placement(cfg.parallel, 8, needs_critic=False, teacher=True)
        got = rank_states(cfg, shape, placement, needs_critic=False, teacher_shape=teacher)
        assert state_bytes(cfg, shape, placement, needs_critic=False, teacher_shape=teacher) == max(
            s.total for s in got
        )
        return {s.ranks: s.teacher for s in got}

    # Colocated: 2 bytes a parameter (bf16, model.param_dtype auto on CUDA) over the 8 actor ranks.
    assert states() == {"actor": 2 * T // 8}
    assert states("teacher.dtype=float32") == {"actor": 4 * T // 8}
    assert states("teacher.offload=true") == {"actor": 0}
    # Its own 2 ranks: the actor's 6 ranks hold none of it, each teacher rank a half.
    assert states("parallel.teacher_ranks=2") == {"actor": 0, "teacher": 2 * T // 2}
    # Without a teacher's shape (no teacher) nothing is counted.
    cfg = load_config(["recipe=grpo_gsm8k"])
    plain = rank_states(cfg, shape, plan_placement(cfg.parallel, 8, needs_critic=False), needs_critic=False)
    assert [s.teacher for s in plain] == [0] and plain[0].actor == 16 * P // 8


@pytest.mark.parametrize(
    ("overrides", "world", "whole"),
    [
        ([], 1, True),  # one GPU, 0.5B: the whole model one unit, counted as gathered
        ([], 8, False),  # eight: per-layer units
        (["model.fsdp_unit=layer"], 1, False),
        (["model.fsdp_unit=model"], 8, True),
    ],
)
def test_the_budgets_resolve_the_unit_as_the_build_does(
    overrides: list[str], world: int, whole: bool
) -> None:
    """model.fsdp_unit for the actor, from the config and placement the budgets see (an 80 GB card), and the
    gathered bytes that follow: the whole model's only when it is one unit."""
    from spmdrl.models.memory_model import gathered_param_bytes
    from spmdrl.rl.token_budgets import actor_whole_model

    cfg = load_config(["recipe=grpo_gsm8k", *overrides])
    shape = DecoderShape(896, 4864, 24, 14, 2, 151936, tied_embeddings=True)
    placement = plan_placement(cfg.parallel, world, needs_critic=False)
    got = actor_whole_model(cfg, shape, placement, total_bytes=80 * 10**9)
    assert got is whole
    m = memory_inputs(cfg, shape, "varlen", whole_model=got)
    expected = shape.params if whole else 2 * shape.layer_params + shape.root_params
    assert gathered_param_bytes(m, grad=True) == expected * (m.compute_bytes + 4)
