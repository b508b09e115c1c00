"""No host-device sync inside the actor update's micro-batch loop with clip_cov, kl_cov, sapo and
bypass_mode (with its rollout correction), as tests/integration/test_update_syncs.py checks for the
default loss (its docstring says how the syncs are counted; its fixed per-pass counts are reused here).

One gloo rank runs the recipe's update_policy on the tiny Qwen2 (FSDP2, padded) with 2 and with 4
micro-batches per mini-batch, for each ``algorithm.policy_loss``. Asserted: kl_cov, sapo and bypass_mode
count only the fixed syncs of a pass, whatever the number of micro-batches; clip_cov one more per
micro-batch, its candidates' count (``nonzero``), which torch.randperm needs on the host to draw verl's
tokens for the same seed, and nothing else. Before this change the loop also counted, per micro-batch:
clip_cov 3 more (the valid count, the drawn indices' blocking copy, a boolean index), kl_cov 5 (the
valid count and four boolean indices), sapo 2 (its temperatures copied to the device), bypass_mode with
rollout_is 1 (rollout_is_std's valid count).

It also checks that the host count the update gives the losses (``MicroBatch.response_tokens``) is the
count of their mask.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch

from spmdrl.testing.models import padded_rows, save_small_qwen2
from spmdrl.testing.spawn import run_side_by_side
from tests.integration.test_update_syncs import UPDATE, _places

pytestmark = pytest.mark.slow

ROWS = 8  # one mini-batch of 4 prompts x 2 samples on the one rank
MICRO = {2: 4, 4: 2}  # micro-batches per mini-batch -> rows per micro-batch
LOSSES = ("clip_cov", "kl_cov", "sapo", "bypass_mode")
CLIP_COV_READ = ("nonzero", "algos/policy_losses_cov.py", "clip_cov_policy_loss")


def _worker(rank: int, world: int, model_dir: str, micro: int) -> dict[str, Any]:
    from spmdrl.config import (
        AlgorithmConfig,
        Config,
        DataConfig,
        OptimConfig,
        RolloutConfig,
        RolloutCorrectionConfig,
        TrainerConfig,
        derive,
        derive_rl,
    )
    from spmdrl.distributed.placement import Placement
    from spmdrl.models.build import ModelSpec, build_fsdp_model
    from spmdrl.optim import build_optimizer
    from spmdrl.rl.batch import PolicyBatch
    from spmdrl.rl.settings import update_settings
    from spmdrl.rl.update import loss_modes, mini_batches, update_policy
    from spmdrl.testing.syncs import SyncCounter

    base = Config(
        data=DataConfig(max_prompt_length=8, max_response_length=8),
        trainer=TrainerConfig(global_batch_size=ROWS // 2, micro_batch_size=micro),
        rollout=RolloutConfig(n=2),
        # Ratios and bounds that make clip_cov draw and kl_cov select tokens in every micro-batch.
        algorithm=AlgorithmConfig(
            ppo_mini_batch_size=ROWS // 2,
            use_kl_loss=True,
            kl_loss_coef=0.01,
            clip_cov_ratio=0.2,
            clip_cov_lb=-10.0,
            kl_cov_ratio=0.2,
        ),
        optim=OptimConfig(lr=1e-3),
    )
    rl = derive_rl(base, derive(base, world, 100, samples_per_item=2))
    mesh = Placement.colocated(world).build_meshes("cpu").fsdp("actor")
    cpu, f32 = torch.device("cpu"), torch.float32
    actor = build_fsdp_model(ModelSpec(Path(model_dir), f32, f32), mesh, cpu)
    optimizer = build_optimizer(actor, base.optim)

    g = torch.Generator().manual_seed(0)
    prompt_B, resp_B = torch.randint(2, 6, (ROWS,), generator=g), torch.randint(1, 8, (ROWS,), generator=g)
    ids, attn, resp = padded_rows(prompt_B, resp_B, 64, g)
    B, T = ids.shape
    noise = 0.1 * torch.randn(B, T, generator=g) * resp
    batch = PolicyBatch(
        ids, attn, resp, -torch.rand(B, T, generator=g) * resp, torch.randn(B, T, generator=g) * resp
    )
    batch = batch.replace(ref_logprobs_BT=batch.engine_logprobs_BT + noise)

    counts = {}
    for loss in LOSSES:
        a = dataclasses.replace(base.algorithm, policy_loss=loss if loss != "bypass_mode" else "vanilla")
        if loss == "bypass_mode":
            correction = RolloutCorrectionConfig(
                bypass_mode=True,
                rollout_is="token",
                rollout_is_threshold="2.0",
                rollout_is_batch_normalize=True,
            )
            a = dataclasses.replace(a, rollout_correction=correction)
        cfg = dataclasses.replace(base, algorithm=a)
        # The host count each micro-batch's loss gets is its mask's count.
        for _, _, plans, mbs, _ in mini_batches(update_settings(cfg), rl, batch, loss_modes(cfg.algorithm)):
            assert [p.response_tokens for p in plans] == [int(mb.response_mask_BT.sum()) for mb in mbs]
        # A first update creates AdamW's state, whose step counters live on the host (capturable=False).
        update_policy(update_settings(cfg), rl, actor, optimizer, batch)
        host = [s["step"] for s in optimizer.state.values()]
        with SyncCounter() as c:
            c.mark_host(*host)
            update_policy(update_settings(cfg), rl, actor, optimizer, batch)
        counts[loss] = (_places(c), c.summary())
    return counts


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("syncs_losses") / "m"
    save_small_qwen2(path)
    return path


def test_no_sync_inside_the_micro_batch_loop_of_these_losses(model_dir: Path) -> None:
    sides = run_side_by_side(_worker, 1, [(str(model_dir), MICRO[n]) for n in MICRO])
    runs = {n: run for n, (run,) in zip(MICRO, sides, strict=True)}
    for loss in LOSSES:
        for n, run in runs.items():
            places, text = run[loss]
            expected = Counter(UPDATE)
            if loss == "clip_cov":  # one mini-batch, one epoch: one read per micro-batch
                expected[CLIP_COV_READ] += n
            assert places == expected, (
                f"{loss}, {n} micro-batches: syncs other than the expected ones:\n{text}"
            )
