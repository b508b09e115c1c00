"""The LR schedule of spmdrl/optim.py: its sequence against transformers' schedulers (equal after the
warm-up, one step ahead during it), held at the floor past total_steps, and restored exactly on resume."""

from __future__ import annotations

import io

import pytest
import torch
from transformers import get_constant_schedule_with_warmup, get_cosine_with_min_lr_schedule_with_warmup

from spmdrl.config import OptimConfig
from spmdrl.optim import build_lr_scheduler, clip_grad_norm


def _optimizer(lr: float = 1e-3) -> torch.optim.Optimizer:
    return torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=lr)


def _lrs(scheduler: torch.optim.lr_scheduler.LRScheduler, steps: int) -> list[float]:
    """The LR each of ``steps`` optimizer steps trains with, stepping the schedule once per step."""
    out = []
    for _ in range(steps):
        out.append(scheduler.get_last_lr()[0])
        scheduler.optimizer.step()
        scheduler.step()
    return out


def test_cosine_equals_transformers_after_the_warm_up_and_is_one_step_ahead_during_it() -> None:
    warmup, total, floor = 4, 12, 0.1
    cfg = OptimConfig(lr=1e-3, schedule="cosine", warmup_steps=warmup, min_lr_ratio=floor)
    ours = _lrs(build_lr_scheduler(_optimizer(), cfg, total), total + 1)
    theirs = _lrs(
        get_cosine_with_min_lr_schedule_with_warmup(_optimizer(), warmup, total, min_lr_rate=floor),
        total + 2,
    )
    # The warm-up's first step already trains (at lr / warmup); transformers' trains at 0.
    assert ours[:warmup] == pytest.approx([1e-3 * (s + 1) / warmup for s in range(warmup)], rel=1e-12)
    assert theirs[0] == 0.0 and ours[:warmup] == theirs[1 : warmup + 1]
    assert ours[warmup - 1] == ours[warmup] == 1e-3  # the peak, at the warm-up's end and the decay's start
    assert ours[warmup:] == theirs[warmup : total + 1]  # bit for bit, down to the floor at total_steps
    assert ours[total] == pytest.approx(floor * 1e-3, rel=1e-12)


def test_constant_with_warm_up_is_transformers_one_step_ahead() -> None:
    cfg = OptimConfig(lr=1e-3, schedule="constant", warmup_steps=3)
    ours = _lrs(build_lr_scheduler(_optimizer(), cfg, 10), 8)
    theirs = _lrs(get_constant_schedule_with_warmup(_optimizer(), 3), 9)
    assert ours == theirs[1:] and ours == pytest.approx(
        [1e-3 / 3, 2e-3 / 3, 1e-3, 1e-3, 1e-3, 1e-3, 1e-3, 1e-3]
    )
    no_warmup = _lrs(build_lr_scheduler(_optimizer(), OptimConfig(lr=1e-3, schedule="constant"), 5), 5)
    assert no_warmup == [1e-3] * 5


def test_cosine_holds_the_floor_past_total_steps() -> None:
    cfg = OptimConfig(lr=1.0, schedule="cosine", warmup_steps=0, min_lr_ratio=0.2)
    lrs = _lrs(build_lr_scheduler(_optimizer(1.0), cfg, 5), 9)
    assert lrs[0] == 1.0 and all(a > b for a, b in zip(lrs[:5], lrs[1:6], strict=False))
    assert lrs[5:] == pytest.approx([0.2] * 4, rel=1e-12)


def test_resume_restores_the_schedule_exactly() -> None:
    cfg = OptimConfig(lr=1e-3, schedule="cosine", warmup_steps=3, min_lr_ratio=0.1)
    total, cut = 10, 5
    straight = _lrs(build_lr_scheduler(_optimizer(), cfg, total), total)

    opt = _optimizer()
    sched = build_lr_scheduler(opt, cfg, total)
    first = _lrs(sched, cut)
    # What the checkpoint holds: the optimizer's and the scheduler's state dicts, serialized.
    buf = io.BytesIO()
    torch.save({"optim": opt.state_dict(), "scheduler": sched.state_dict()}, buf)
    # The schedule's settings are not in it (a plain function's lambda is stored as None): they come
    # from the config, so a checkpoint loads into whatever builds the same LambdaLR.
    assert sched.state_dict()["lr_lambdas"] == [None] and sched.state_dict()["last_epoch"] == cut

    buf.seek(0)
    saved = torch.load(buf, weights_only=True)
    opt2 = _optimizer()
    sched2 = build_lr_scheduler(opt2, cfg, total)
    opt2.load_state_dict(saved["optim"])
    sched2.load_state_dict(saved["scheduler"])
    assert first + _lrs(sched2, total - cut) == straight


def test_clip_grad_norm_refuses_a_model_without_gradients() -> None:
    """A backward that reached no parameter (a loss that bypasses FSDP2's hooks) must stop the run, not
    step an optimizer over nothing."""
    model = torch.nn.Linear(3, 2)
    model(torch.ones(1, 3)).detach().sum()  # nothing backpropagated
    with pytest.raises(RuntimeError, match="no parameter of Linear has a gradient after backward"):
        clip_grad_norm(model, 1.0)
    model(torch.ones(1, 3)).sum().backward()
    assert clip_grad_norm(model, 1.0) > 0


def _optimizer_worker(rank: int, world_size: int, fused: bool) -> dict[str, object]:
    """Two copies of one FSDP2 model: ShardLocalAdamW and clip_grad_norm against torch.optim.AdamW and
    torch's clip_grad_norm_ on the DTensors, the same gradients, three steps."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    from spmdrl.optim import ShardLocalAdamW

    mesh = init_device_mesh("cpu", (world_size,))
    models = []
    for _ in range(2):
        torch.manual_seed(0)
        m = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))
        fully_shard(m, mesh=mesh)
        models.append(m)
    kind = {"fused": True} if fused else {"foreach": True}
    ours = ShardLocalAdamW(models[0].parameters(), lr=0.1, weight_decay=0.1, **kind)
    ref = torch.optim.AdamW(models[1].parameters(), lr=0.1, weight_decay=0.1, **kind)
    norms = []
    for step in range(3):
        x = torch.randn(4, 6, generator=torch.Generator().manual_seed(10 * rank + step))
        for m in models:
            m(x).pow(2).sum().backward()
        norm = clip_grad_norm(models[0], 0.5)
        ref_norm = torch.nn.utils.clip_grad_norm_(list(models[1].parameters()), 0.5).full_tensor()
        norms.append((norm, float(ref_norm)))
        ours.step()
        ref.step()
        for opt in (ours, ref):
            opt.zero_grad(set_to_none=True)
    weights = [
        (p.full_tensor(), q.full_tensor())
        for p, q in zip(models[0].parameters(), models[1].parameters(), strict=True)
    ]
    states = [isinstance(v, DTensor) for s in ours.state.values() for k, v in s.items() if k != "step"]
    return {"norms": norms, "weights": weights, "states_are_dtensors": bool(states) and all(states)}


@pytest.mark.parametrize("world_size", [1, 2])
@pytest.mark.parametrize("fused", [False, True])
def test_shard_local_adamw_and_clip_match_the_dtensor_step(world_size: int, fused: bool) -> None:
    """Stepping and clipping the shards as plain tensors is the DTensor step and clip to the last bit (one
    rank and two: uneven shards of 5 and 3 rows), and the state stays DTensors (which checkpoints reshard)."""
    from spmdrl.testing.spawn import run_distributed

    for result in run_distributed(_optimizer_worker, world_size, fused):
        for norm, ref_norm in result["norms"]:
            assert norm == ref_norm
            assert norm > 0.5  # the clip was active
        for ours, ref in result["weights"]:
            assert torch.equal(ours, ref)
        assert result["states_are_dtensors"]
