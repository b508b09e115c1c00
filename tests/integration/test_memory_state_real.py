"""The memory model's state per rank (spmdrl.rl.token_budgets.rank_states) against the bytes the real FSDP2
models hold: built on 2 gloo ranks as the RL job builds them (bf16 compute, so the frozen models are stored
in bf16 and the trained ones keep a float32 master), each trained one after an optimizer step and a second
backward (parameters, gradients and AdamW's moments all alive, as at the update). Checked per model: the
actor, the actor under LoRA (all-linear, and two targets), the reference, the critic and a reward model of
another shape than the actor's."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from spmdrl.config_loader import load_config
from spmdrl.distributed.placement import Placement
from spmdrl.models.memory_model import DecoderShape
from spmdrl.rl.token_budgets import rank_states
from spmdrl.testing.models import SMALL_QWEN2, save_small_qwen2
from spmdrl.testing.spawn import run_distributed

pytestmark = pytest.mark.slow

WORLD = 2
BASE = [
    "recipe=grpo_tiny",
    "model.param_dtype=bfloat16",  # what auto is on CUDA: frozen models stored in bf16
    "algorithm.use_kl_loss=true",  # a reference
    "reward_model.enable=true",
    "reward_model.path=rm",  # read by nothing here: the reward model's shape is passed in
]
# A reward model of its own shape: wider, deeper, longer MLP than the actor.
RM_SHAPE = dict(hidden_size=96, intermediate_size=160, num_hidden_layers=3, num_attention_heads=3)
LORA = {
    "actor": [],
    "actor_lora_all": ["model.lora.rank=4"],
    "actor_lora_two": ["model.lora.rank=8", "model.lora.target_modules=[q_proj,down_proj]"],
}


def _local_bytes(t: torch.Tensor) -> int:
    from torch.distributed.tensor import DTensor

    local = t.to_local() if isinstance(t, DTensor) else t
    return local.numel() * local.element_size()


def _held_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> int:
    """This rank's parameter shards, their gradients and the optimizer's moments (not its step counters)."""
    params = list(model.parameters())
    held = sum(_local_bytes(p) for p in params)
    held += sum(_local_bytes(p.grad) for p in params if p.grad is not None)
    if optimizer is not None:
        for state in optimizer.state.values():
            held += sum(_local_bytes(state[k]) for k in ("exp_avg", "exp_avg_sq"))
    return held


def _state_worker(rank: int, world: int, actor_dir: str, rm_dir: str) -> dict[str, int]:
    from spmdrl.models.build import build_fsdp_model, model_spec
    from spmdrl.optim import build_optimizer

    device = torch.device("cpu")
    mesh = Placement.colocated(world).build_meshes("cpu").fsdp("actor")
    ids = torch.randint(0, SMALL_QWEN2["vocab_size"], (2, 12), generator=torch.Generator().manual_seed(rank))

    def trained(overrides: list[str], head: str) -> int:
        cfg = load_config(BASE + overrides)
        model = build_fsdp_model(
            model_spec(cfg.model, Path(actor_dir), device, train=True, head=head), mesh, device
        )
        optimizer = build_optimizer(model, cfg.optim)
        for step in range(2):  # the moments appear at the first step; the second backward's gradients stay
            optimizer.zero_grad(set_to_none=True)
            model(input_ids=ids).logits.float().pow(2).mean().backward()
            if step == 0:
                optimizer.step()
        return _held_bytes(model, optimizer)

    def frozen(path: str, head: str) -> int:
        cfg = load_config(BASE)
        model = build_fsdp_model(
            model_spec(cfg.model, Path(path), device, train=False, head=head), mesh, device
        )
        return _held_bytes(model, None)

    out = {name: trained(overrides, "lm") for name, overrides in LORA.items()}
    out["critic"] = trained([], "value")
    out["ref"] = frozen(actor_dir, "lm")
    out["reward_model"] = frozen(rm_dir, "reward")
    return out


def _modelled(overrides: list[str], world: int, *, needs_critic: bool) -> dict[str, int]:
    from transformers import Qwen2Config

    cfg = load_config(BASE + overrides)
    shape = DecoderShape.from_hf(Qwen2Config(**SMALL_QWEN2))
    rm_shape = DecoderShape.from_hf(Qwen2Config(**{**SMALL_QWEN2, **RM_SHAPE}))
    (state,) = rank_states(
        cfg, shape, Placement.colocated(world), needs_critic=needs_critic, rm_shape=rm_shape
    )
    return {
        "actor": state.actor,
        "ref": state.ref,
        "critic": state.critic,
        "reward_model": state.reward_model,
    }


def test_modelled_state_is_what_the_built_models_hold(tmp_path: Path) -> None:
    actor_dir, rm_dir = tmp_path / "actor", tmp_path / "rm"
    save_small_qwen2(actor_dir)
    save_small_qwen2(rm_dir, seed=1, **RM_SHAPE)
    real = run_distributed(_state_worker, WORLD, str(actor_dir), str(rm_dir))
    expected = {name: _modelled(o, 1, needs_critic=True)["actor"] for name, o in LORA.items()}
    one_rank = _modelled([], 1, needs_critic=True)
    expected |= {k: one_rank[k] for k in ("ref", "critic", "reward_model")}
    per_rank = {name: _modelled(o, WORLD, needs_critic=True)["actor"] for name, o in LORA.items()}
    sharded = _modelled([], WORLD, needs_critic=True)
    per_rank |= {k: sharded[k] for k in ("ref", "critic", "reward_model")}
    for name, whole in expected.items():
        # The shards of all ranks add up to the model's state exactly ...
        assert sum(r[name] for r in real) == whole, (name, [r[name] for r in real], whole)
        # ... and each rank holds its 1/S of it, but for FSDP2's uneven split of a dim 0 the world does not
        # divide (the one-output heads' rows): within 1%.
        for r in real:
            assert abs(r[name] - per_rank[name]) <= 0.01 * per_rank[name], (name, r[name], per_rank[name])
    # LoRA: the frozen base in bf16 and 16 bytes a trained adapter parameter, far below the full actor's.
    assert expected["actor_lora_all"] < expected["actor"] / 2
    assert expected["actor_lora_two"] < expected["actor_lora_all"]
