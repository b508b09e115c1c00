"""The GRPO update moves the policy the right way: up on positive-advantage samples, down on negative.

2 gloo ranks, FSDP2 actor built by the real build path, the recipe's own update_policy.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from spmdrl.testing.models import save_small_qwen2
from spmdrl.testing.spawn import run_distributed, run_side_by_side

pytestmark = pytest.mark.slow


def _worker(
    rank: int, world: int, model_dir: str, mini: int, epochs: int
) -> tuple[float, float, dict[str, float]]:
    from spmdrl.config import (
        AlgorithmConfig,
        Config,
        OptimConfig,
        RolloutConfig,
        TrainerConfig,
        derive,
        derive_rl,
    )
    from spmdrl.distributed.placement import Placement
    from spmdrl.models.build import ModelSpec, build_fsdp_model
    from spmdrl.models.forward import policy_logprobs
    from spmdrl.optim import build_optimizer
    from spmdrl.rl.batch import PolicyBatch
    from spmdrl.rl.micro_batches import micro_batch_rows
    from spmdrl.rl.settings import update_settings
    from spmdrl.rl.update import logprobs_of, update_policy

    cfg = Config(
        trainer=TrainerConfig(global_batch_size=4, micro_batch_size=2),
        rollout=RolloutConfig(n=2),
        algorithm=AlgorithmConfig(
            ppo_mini_batch_size=mini, ppo_epochs=epochs, use_kl_loss=True, kl_loss_coef=0.01
        ),
        optim=OptimConfig(lr=1e-3),
    )
    d = derive(cfg, world, 100, samples_per_item=2)
    rl = derive_rl(cfg, d)
    mesh = Placement.colocated(world).build_meshes("cpu").fsdp("actor")
    actor = build_fsdp_model(
        ModelSpec(Path(model_dir), torch.float32, torch.float32), mesh, torch.device("cpu")
    )
    ref = build_fsdp_model(
        ModelSpec(Path(model_dir), torch.float32, torch.float32, train=False), mesh, torch.device("cpu")
    )
    g = torch.Generator().manual_seed(rank)
    B, T = 4, 10  # 2 prompts x 2 samples on this rank
    ids = torch.randint(0, 64, (B, T), generator=g)
    attn = torch.ones(B, T, dtype=torch.long)
    resp = torch.zeros(B, T, dtype=torch.bool)
    resp[:, 4:] = True
    adv = torch.tensor([1.0, -1.0, 1.0, -1.0])
    batch = PolicyBatch(ids, attn, resp, torch.zeros(B, T), adv[:, None] * resp)
    batch = batch.replace(
        ref_logprobs_BT=logprobs_of(
            ref, batch, micro_batch_rows(batch.attention_mask_BT.sum(1), micro_batch_size=2), 1.0
        )
    )
    recompute = epochs > 1 or rl.mini_batches_per_step > 1
    if recompute:
        batch = batch.replace(
            old_logprobs_BT=logprobs_of(
                actor, batch, micro_batch_rows(batch.attention_mask_BT.sum(1), micro_batch_size=2), 1.0
            )
        )
    with torch.no_grad():
        before, _ = policy_logprobs(actor, ids, attn)
    result = update_policy(update_settings(cfg), rl, actor, build_optimizer(actor, cfg.optim), batch)
    metrics = result.metrics
    # The old policy the update reports is the one before it (the first forward when on-policy).
    torch.testing.assert_close(result.old_logprobs_BT * resp, before * resp)
    with torch.no_grad():
        after, _ = policy_logprobs(actor, ids, attn)
    delta_B = ((after - before) * resp).sum(1)
    return float(delta_B[adv > 0].mean()), float(delta_B[adv < 0].mean()), metrics


@pytest.mark.parametrize(("mini", "epochs"), [(4, 1), (2, 2)])
def test_update_raises_positive_and_lowers_negative(tmp_path: Path, mini: int, epochs: int) -> None:
    save_small_qwen2(tmp_path / "m")
    for up, down, metrics in run_distributed(_worker, 2, str(tmp_path / "m"), mini, epochs):
        assert up > 0, "positive-advantage samples must become more likely"
        assert down < 0, "negative-advantage samples must become less likely"
        assert {
            "actor/pg_loss",
            "actor/kl_loss",
            "actor/entropy",
            "actor/pg_clipfrac",
            "actor/grad_norm",
        } <= set(metrics)
        if epochs > 1:
            assert metrics["actor/ppo_kl"] > 0  # later updates see a ratio != 1


def _nonfinite_worker(rank: int, world: int, model_dir: str, mode: str) -> tuple[str, float, bool]:
    from spmdrl.config import (
        AlgorithmConfig,
        Config,
        OptimConfig,
        RolloutConfig,
        TrainerConfig,
        derive,
        derive_rl,
    )
    from spmdrl.distributed.placement import Placement
    from spmdrl.models.build import ModelSpec, build_fsdp_model
    from spmdrl.optim import build_optimizer
    from spmdrl.rl.batch import PolicyBatch
    from spmdrl.rl.settings import update_settings
    from spmdrl.rl.update import update_policy

    cfg = Config(
        trainer=TrainerConfig(global_batch_size=2, micro_batch_size=2),
        rollout=RolloutConfig(n=2),
        algorithm=AlgorithmConfig(use_kl_loss=False),
        optim=OptimConfig(lr=1e-3, nonfinite_grad=mode),
    )
    rl = derive_rl(cfg, derive(cfg, world, 100, samples_per_item=2))
    mesh = Placement.colocated(world).build_meshes("cpu").fsdp("actor")
    actor = build_fsdp_model(
        ModelSpec(Path(model_dir), torch.float32, torch.float32), mesh, torch.device("cpu")
    )
    optimizer = build_optimizer(actor, cfg.optim)
    B, T = 4, 10
    ids = torch.randint(0, 64, (B, T), generator=torch.Generator().manual_seed(0))
    resp = torch.zeros(B, T, dtype=torch.bool)
    resp[:, 4:] = True
    adv = torch.tensor([1.0, float("nan"), 1.0, -1.0])  # a reward function that returned NaN, say
    batch = PolicyBatch(ids, torch.ones(B, T, dtype=torch.long), resp, torch.zeros(B, T), adv[:, None] * resp)
    before = [p.to_local().clone() for p in actor.parameters()]
    try:
        metrics = update_policy(update_settings(cfg), rl, actor, optimizer, batch).metrics
    except FloatingPointError as e:
        return str(e), -1.0, True
    unchanged = all(torch.equal(a, p.to_local()) for a, p in zip(before, actor.parameters(), strict=True))
    return "", metrics["actor/skipped_updates"], unchanged


def test_nonfinite_gradient_stops_or_skips(tmp_path: Path) -> None:
    save_small_qwen2(tmp_path / "m")
    ((stop,), (skip,)) = run_side_by_side(
        _nonfinite_worker, 1, [(str(tmp_path / "m"), m) for m in ("stop", "skip")]
    )
    err, _, _ = stop
    assert "non-finite gradient norm" in err and "optim.nonfinite_grad=skip" in err
    err, skipped, unchanged = skip
    assert err == "" and skipped == 1 and unchanged  # verl's behaviour: the update is dropped, counted
