"""FSDP2 on 2 gloo ranks matches a single-process reference; placement builds the meshes it promises."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import Qwen2ForCausalLM

from spmdrl.testing.models import save_small_qwen2
from spmdrl.testing.spawn import run_distributed

pytestmark = pytest.mark.slow

VOCAB = 96


def _save_model(path: Path) -> None:
    save_small_qwen2(path, vocab_size=VOCAB)


def _data() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (8, 12), generator=g)
    attn = torch.ones_like(ids)
    attn[1, 9:] = 0  # some right padding
    attn[6, 5:] = 0
    loss_mask = attn.clone()
    loss_mask[:, :4] = 0  # a "prompt" of 4 tokens
    return ids, attn, loss_mask


def _train(model: torch.nn.Module, rows: slice, steps: int) -> list[float]:
    """Two micro-batches per rank, loss normalized by the global token count (the SFT recipe's rule;
    FSDP sums the gradients over ranks)."""
    import torch.distributed as dist

    from spmdrl.algos.losses import masked_cross_entropy
    from spmdrl.distributed.reduce import all_reduce_sum
    from spmdrl.optim import clip_grad_norm

    ids, attn, lm = _data()
    ids, attn, lm = ids[rows], attn[rows], lm[rows]
    # SGD: Adam divides by sqrt(v) and turns 1e-9 float noise on near-zero grads into lr-sized steps.
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    losses = []
    for _ in range(steps):
        global_tokens = (
            all_reduce_sum({"t": float(lm[:, 1:].sum())}, torch.device("cpu"))["t"]
            if dist.is_initialized()
            else float(lm[:, 1:].sum())
        )
        total = 0.0
        half = ids.shape[0] // 2
        for mb in (slice(0, half), slice(half, None)):
            logits = model(input_ids=ids[mb], attention_mask=attn[mb]).logits
            loss, _ = masked_cross_entropy(logits, ids[mb], lm[mb], num_global_tokens=global_tokens)
            loss.backward()
            total += float(loss.detach())
        clip_grad_norm(model, 1.0)
        opt.step()
        opt.zero_grad()
        if dist.is_initialized():
            total = all_reduce_sum({"l": total}, torch.device("cpu"))["l"]
        losses.append(total)
    return losses


def _fsdp_worker(
    rank: int, world_size: int, model_dir: str, ac: bool
) -> tuple[list[float], dict[str, torch.Tensor]]:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from spmdrl.distributed.placement import Placement
    from spmdrl.models.build import ModelSpec, build_fsdp_model

    meshes = Placement.colocated(world_size).build_meshes("cpu")
    model = build_fsdp_model(
        ModelSpec(Path(model_dir), torch.float32, torch.float32, activation_checkpointing=ac),
        meshes.fsdp("actor"),
        torch.device("cpu"),
    )
    assert model.lm_head.weight is model.model.embed_tokens.weight, "tied weights must stay tied"
    per = 8 // world_size
    losses = _train(model, slice(rank * per, (rank + 1) * per), steps=3)
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return losses, full


def _reference(model_dir: Path) -> tuple[list[float], dict[str, torch.Tensor]]:
    model = Qwen2ForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    losses = _train(model, slice(0, 8), steps=3)
    return losses, model.state_dict()


@pytest.mark.parametrize("ac", [pytest.param(False, marks=pytest.mark.guarantee("fsdp:numerics")), True])
def test_fsdp2_two_ranks_match_single_process(tmp_path: Path, ac: bool) -> None:
    _save_model(tmp_path / "m")
    ref_losses, ref_state = _reference(tmp_path / "m")
    (losses0, state0), (losses1, _) = run_distributed(_fsdp_worker, 2, str(tmp_path / "m"), ac)
    assert losses0 == pytest.approx(losses1, abs=1e-7), "ranks must agree on the reduced loss"
    assert losses0 == pytest.approx(ref_losses, rel=1e-5, abs=1e-6)
    assert ref_losses[-1] < ref_losses[0], (
        "the reference must actually learn, or the comparison proves little"
    )
    for k, v in ref_state.items():
        torch.testing.assert_close(state0[k], v, rtol=1e-4, atol=1e-5, msg=lambda m, k=k: f"{k}: {m}")


def _mesh_worker(rank: int, world_size: int) -> tuple[tuple[int, ...], tuple[str, ...], bool]:
    from spmdrl.distributed.placement import Placement

    meshes = Placement.colocated(world_size, dp_replicate=2).build_meshes("cpu")
    mesh = meshes.fsdp("actor")
    same = meshes.fsdp("ref") is mesh  # colocated roles share one mesh object
    return tuple(mesh.shape), tuple(mesh.mesh_dim_names or ()), same


def test_hsdp_mesh_on_four_ranks() -> None:
    results = run_distributed(_mesh_worker, 4)
    assert all(r == ((2, 2), ("dp_replicate", "dp_shard"), True) for r in results)


def test_placement_rejects_bad_sizes() -> None:
    from spmdrl.distributed.placement import Placement, RoleSpec
    from spmdrl.errors import ConfigError

    with pytest.raises(ConfigError, match="dp_replicate=3 must divide the 4 ranks"):
        Placement.colocated(4, dp_replicate=3)
    with pytest.raises(ConfigError, match="wants ranks 2..5 but the world has 4"):
        Placement(world_size=4, roles={"critic": RoleSpec("critic", 2, 4)})


def test_rollout_tp_groups_are_consecutive_blocks() -> None:
    from spmdrl.distributed.placement import rollout_tp_groups
    from spmdrl.errors import ConfigError

    assert rollout_tp_groups(4, 2) == [[0, 1], [2, 3]]
    assert rollout_tp_groups(4, 1) == [[0], [1], [2], [3]]
    assert rollout_tp_groups(2, 2) == [[0, 1]]
    with pytest.raises(ConfigError, match="rollout.tp=3 must be >= 1 and divide the world size 4"):
        rollout_tp_groups(4, 3)
