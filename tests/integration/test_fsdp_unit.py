"""model.fsdp_unit: the whole model as one FSDP2 unit trains bit for bit as per-layer units do, with less
host work per micro-batch, frees its gathered copy after a no-grad pass, and auto takes it only on a
one-rank mesh (spmdrl.models.parallelize.apply_fsdp, spmdrl.models.memory_model.whole_model_unit)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from spmdrl.testing.models import save_small_qwen2
from spmdrl.testing.spawn import run_distributed

pytestmark = pytest.mark.slow

VOCAB = 96


def _rows() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, VOCAB, (4, 16), generator=g)
    attn = torch.ones_like(ids)
    attn[1, 11:] = 0
    return ids, attn


def _aten_ops(fn: object) -> int:
    from torch.profiler import profile

    with profile() as prof:
        fn()  # type: ignore[operator]
    return sum(e.count for e in prof.key_averages() if e.key.startswith("aten::"))


def _worker(rank: int, world_size: int, model_dir: str, unit: str, fused_chunk: int) -> dict[str, object]:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    from spmdrl.distributed.placement import Placement
    from spmdrl.models.build import ModelSpec, build_fsdp_model
    from spmdrl.models.forward import policy_logprobs
    from spmdrl.models.parallelize import decoder_layers, gathered_through

    torch.manual_seed(0)
    model = build_fsdp_model(
        ModelSpec(Path(model_dir), torch.float32, torch.float32, fsdp_unit=unit),
        Placement.colocated(world_size).build_meshes("cpu").fsdp("actor"),
        torch.device("cpu"),
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=True)
    ids, attn = _rows()

    def loss() -> torch.Tensor:
        lp, _ = policy_logprobs(model, ids, attn, first_column=4, fused_chunk_tokens=fused_chunk)
        return -(lp * attn).sum() / attn.sum()

    losses = []
    for _ in range(3):
        value = loss()
        value.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(value.item())
    with torch.no_grad():
        policy_logprobs(model, ids, attn, first_column=4, fused_chunk_tokens=fused_chunk)
    sharded_after_no_grad = all(isinstance(p, DTensor) for p in model.parameters())
    with torch.no_grad(), gathered_through(model):  # a pass of two micro-batches
        policy_logprobs(model, ids, attn, first_column=4, fused_chunk_tokens=fused_chunk)
        kept_within_pass = not any(isinstance(p, DTensor) for p in model.parameters())
        policy_logprobs(model, ids, attn, first_column=4, fused_chunk_tokens=fused_chunk)
    sharded_after_pass = all(isinstance(p, DTensor) for p in model.parameters())
    ops = _aten_ops(lambda: loss().backward())
    opt.zero_grad(set_to_none=True)
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return {
        "layer_units": sum(isinstance(layer, FSDPModule) for layer in decoder_layers(model)),
        "losses": losses,
        "state": state,
        "sharded_after_no_grad": sharded_after_no_grad,
        "kept_within_pass": kept_within_pass,
        "sharded_after_pass": sharded_after_pass,
        "ops": ops,
    }


@pytest.mark.parametrize("fused_chunk", [0, 8])
def test_whole_model_unit_trains_as_layer_units(tmp_path: Path, fused_chunk: int) -> None:
    """One rank: auto is the whole-model unit; it reaches the same losses and weights to the last bit as
    per-layer units (the same kernels in the same order, only fewer gathers), with the LM head's chunked
    backward (fused_chunk 8) too, in fewer ATen ops per forward + backward, and leaves no gathered copy
    after a no-grad forward, or after a pass of several (gathered_through: gathered once for it)."""
    save_small_qwen2(tmp_path / "m", vocab_size=VOCAB)
    (layer,) = run_distributed(_worker, 1, str(tmp_path / "m"), "layer", fused_chunk)
    (auto,) = run_distributed(_worker, 1, str(tmp_path / "m"), "auto", fused_chunk)
    assert layer["layer_units"] > 0 and auto["layer_units"] == 0, "auto on one rank: one unit, no layer units"
    assert auto["losses"] == layer["losses"]
    assert layer["losses"][-1] < layer["losses"][0], "the run must learn, or equal losses prove little"
    for name, tensor in layer["state"].items():
        assert torch.equal(auto["state"][name], tensor), name
    assert auto["sharded_after_no_grad"], "a no-grad forward must not leave the whole model gathered"
    assert auto["kept_within_pass"] and auto["sharded_after_pass"], "gathered once for a pass, then freed"
    assert auto["ops"] < layer["ops"], (auto["ops"], layer["ops"])


def test_auto_keeps_layer_units_on_two_ranks(tmp_path: Path) -> None:
    """Two ranks: auto shards per layer (the gathers overlap compute there); model makes one unit."""
    save_small_qwen2(tmp_path / "m", vocab_size=VOCAB)
    auto = run_distributed(_worker, 2, str(tmp_path / "m"), "auto", 0)
    whole = run_distributed(_worker, 2, str(tmp_path / "m"), "model", 0)
    assert all(r["layer_units"] > 0 for r in auto)
    assert all(r["layer_units"] == 0 for r in whole)
    assert whole[0]["losses"] == pytest.approx(auto[0]["losses"], rel=1e-6)


def _reward_worker(rank: int, world_size: int, model_dir: str) -> tuple[int, float]:
    from spmdrl.distributed.placement import Placement
    from spmdrl.models.build import ModelSpec, build_fsdp_model
    from spmdrl.models.parallelize import decoder_layers
    from spmdrl.optim import clip_grad_norm
    from spmdrl.rewards.reward_model import sequence_scores

    torch.manual_seed(0)
    model = build_fsdp_model(
        ModelSpec(Path(model_dir), torch.float32, torch.float32, head="reward"),
        Placement.colocated(world_size).build_meshes("cpu").fsdp("actor"),
        torch.device("cpu"),
    )
    model.config.pad_token_id = 0  # transformers pools by it (sequence_scores reads the head's own output)
    ids, attn = _rows()
    sequence_scores(model, ids, attn).sum().backward()
    units = sum(isinstance(layer, torch.distributed.fsdp.FSDPModule) for layer in decoder_layers(model))
    return units, clip_grad_norm(model, 1.0)


def test_whole_model_unit_trains_a_reward_head(tmp_path: Path) -> None:
    """The reward model's scores come from a hook on its head (spmdrl.rewards.reward_model.sequence_scores),
    not from the model's outputs: through_outputs still gets the whole-model unit's gradients reduced into
    its parameters (without it clip_grad_norm finds none and stops the run)."""
    save_small_qwen2(tmp_path / "m", vocab_size=VOCAB)
    ((units, norm),) = run_distributed(_reward_worker, 1, str(tmp_path / "m"))
    assert units == 0
    assert norm > 0
