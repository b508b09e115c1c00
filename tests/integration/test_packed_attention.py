"""Varlen attention in the recipe's update: trainer.packed_attention=varlen gives the mask path's update.

Two gloo ranks build the actor and its reference through the recipe's own path (spmdrl.rl.models.
build_models: FSDP2, activation checkpointing on, so the backward recomputes each layer's attention from
the boundaries it was called with), pack their token-budget micro-batches and run update_policy (KL loss
on, 2 mini-batches x 2 epochs, old logprobs recomputed first), once with packed_attention=mask and once
with varlen (on CPU: the exact per-segment reference). What is asserted:

- the varlen models attend varlen (their attention implementation), the mask models do not;
- the weights after the update and the summed metrics are the mask path's (float32; the two differ
  only by summation order in attention: rtol 1e-5, atol 1e-6 on weights, as test_update_numerics);
- the no-grad pass syncs no more with varlen than with the mask (spmdrl.testing.syncs).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from spmdrl.testing.models import rank_policy_batch, save_small_qwen2
from spmdrl.testing.spawn import run_distributed

pytestmark = pytest.mark.slow

ROWS = 16  # 8 prompts x 2 samples, 8 rows per rank
TOKEN_BUDGET = 24
WEIGHT_TOL = dict(rtol=1e-5, atol=1e-6)


def _worker(rank: int, world: int, model_dir: str) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from spmdrl.config import (
        AlgorithmConfig,
        Config,
        DataConfig,
        ModelConfig,
        OptimConfig,
        RolloutConfig,
        TrainerConfig,
        derive,
        derive_rl,
        validate,
    )
    from spmdrl.distributed.placement import Placement
    from spmdrl.rl.micro_batches import micro_batch_rows
    from spmdrl.rl.models import build_models
    from spmdrl.rl.settings import update_settings
    from spmdrl.rl.update import logprobs_of, update_policy
    from spmdrl.testing.syncs import SyncCounter

    batch = rank_policy_batch(ROWS, rank, world)
    cpu = torch.device("cpu")
    meshes = Placement.colocated(world).build_meshes("cpu")
    out: dict[str, Any] = {}
    for setting in ("mask", "varlen"):
        cfg = Config(
            model=ModelConfig(path=model_dir, param_dtype="float32", activation_checkpointing="full"),
            data=DataConfig(max_prompt_length=8, max_response_length=10),
            trainer=TrainerConfig(
                global_batch_size=ROWS // 2,
                micro_batch_tokens=TOKEN_BUDGET,
                pack_sequences=True,
                packed_attention=setting,
            ),
            rollout=RolloutConfig(n=2),
            optim=OptimConfig(grad_clip=0.0),
            algorithm=AlgorithmConfig(ppo_mini_batch_size=ROWS // 4, ppo_epochs=2, use_kl_loss=True),
        )
        validate(cfg)
        rl = derive_rl(cfg, derive(cfg, world, 100, samples_per_item=2))
        actor, ref = build_models(cfg.model, cfg.trainer, cfg.algorithm, cpu, meshes, Path(model_dir))
        assert ref is not None
        optimizer = torch.optim.SGD(actor.parameters(), lr=0.1)
        parts = micro_batch_rows(
            batch.attention_mask_BT.sum(1), micro_batch_size=8, token_budget=TOKEN_BUDGET
        )
        with SyncCounter() as c:
            c.mark_host(*parts)
            ref_lp = logprobs_of(ref.model, batch, parts, 1.0, True)
        b = batch.replace(ref_logprobs_BT=ref_lp + 0.05 * batch.advantages_BT)  # a KL term with a gradient
        b = b.replace(old_logprobs_BT=logprobs_of(actor, b, parts, 1.0, True))
        metrics = update_policy(update_settings(cfg), rl, actor, optimizer, b).metrics
        state = get_model_state_dict(actor, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        out[setting] = dict(
            impl=(actor.config._attn_implementation, ref.model.config._attn_implementation),
            syncs=c.count(),
            metrics=metrics,
            state=state if rank == 0 else None,
        )
        del actor, ref, optimizer
    return out


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("packed_attention") / "m"
    save_small_qwen2(path)
    return path


def test_varlen_update_equals_mask_update(model_dir: Path) -> None:
    from spmdrl.models.build import read_safetensors
    from spmdrl.models.varlen import VARLEN

    results = run_distributed(_worker, 2, str(model_dir), timeout_s=600)
    mask, varlen = results[0]["mask"], results[0]["varlen"]
    assert varlen["impl"] == (VARLEN, VARLEN) and VARLEN not in mask["impl"]
    assert varlen["syncs"] <= mask["syncs"], (varlen["syncs"], mask["syncs"])
    for key in ("actor/pg_loss", "actor/kl_loss", "actor/grad_norm"):
        assert varlen["metrics"][key] == pytest.approx(mask["metrics"][key], rel=1e-5, abs=1e-7), key
    for name, w in mask["state"].items():
        torch.testing.assert_close(varlen["state"][name], w, **WEIGHT_TOL, msg=name)
    # The update moves the weights far more than the tolerance: the comparison proves something.
    initial = read_safetensors(model_dir)
    assert max((w - initial[n]).abs().max().item() for n, w in mask["state"].items() if n in initial) > 1e-3
