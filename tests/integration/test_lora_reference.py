"""Under LoRA the KL reference is the actor with its adapters off (spmdrl/rl/reference.py), no copy of its own.

Two gloo ranks build the models through the recipe's path (spmdrl.rl.models.build_models: FSDP2,
activation checkpointing on, float32 on CPU) with model.lora and a KL loss, train the adapters one update
(so B is non-zero and the adapted actor differs from its base), then score the rows through
old_and_ref_logprobs. What is asserted, with padded and with packed rows:

- build_models built no second model: the reference is the actor, with its adapters off;
- its reference logprobs equal, bitwise, those of a frozen reference built apart from the same model.path
  (what build_models built before);
- the adapted actor's logprobs differ from them (the adapters count), and are the same before and after
  the reference's pass (the adapters are on again after it), and the actor is back in train mode.
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


def _worker(rank: int, world: int, model_dir: str) -> dict[str, Any]:
    from spmdrl.config import (
        AlgorithmConfig,
        Config,
        DataConfig,
        LoraConfig,
        ModelConfig,
        OptimConfig,
        RolloutConfig,
        TrainerConfig,
        derive,
        derive_rl,
        validate,
    )
    from spmdrl.distributed.placement import Placement
    from spmdrl.models.build import build_fsdp_model, model_spec
    from spmdrl.models.causal_attention import use_causal_sdpa
    from spmdrl.models.varlen import apply_packed_attention
    from spmdrl.optim import build_optimizer
    from spmdrl.rl.experience import old_and_ref_logprobs
    from spmdrl.rl.models import build_models
    from spmdrl.rl.reference import Reference
    from spmdrl.rl.settings import update_settings
    from spmdrl.rl.update import update_policy

    batch = rank_policy_batch(ROWS, rank, world)
    cpu = torch.device("cpu")
    meshes = Placement.colocated(world).build_meshes("cpu")
    out: dict[str, Any] = {}
    for pack in (False, True):
        cfg = Config(
            model=ModelConfig(
                path=model_dir,
                param_dtype="float32",
                activation_checkpointing="full",
                lora=LoraConfig(rank=4, alpha=8.0),
            ),
            data=DataConfig(max_prompt_length=8, max_response_length=10),
            trainer=TrainerConfig(global_batch_size=ROWS // 2, micro_batch_size=4, pack_sequences=pack),
            rollout=RolloutConfig(n=2),
            optim=OptimConfig(lr=1e-2, grad_clip=0.0),
            algorithm=AlgorithmConfig(use_kl_loss=True),
        )
        validate(cfg)
        rl = derive_rl(cfg, derive(cfg, world, 100, samples_per_item=2))
        actor, ref = build_models(cfg.model, cfg.trainer, cfg.algorithm, cpu, meshes, Path(model_dir))
        assert ref is not None and ref.adapters_off and ref.model is actor
        # One update of the adapters (B starts at zero: the adapted actor would be its base).
        optimizer = build_optimizer(actor, cfg.optim)
        trained = old_and_ref_logprobs(update_settings(cfg), rl, actor, ref, batch, None, recompute_old=True)
        update_policy(update_settings(cfg), rl, actor, optimizer, trained)

        before = old_and_ref_logprobs(update_settings(cfg), rl, actor, None, batch, None, recompute_old=True)
        scored = old_and_ref_logprobs(update_settings(cfg), rl, actor, ref, batch, None, recompute_old=True)
        after = old_and_ref_logprobs(update_settings(cfg), rl, actor, None, batch, None, recompute_old=True)

        # The reference as build_models built it before: a frozen copy of model.path, FSDP2 on its mesh.
        frozen = build_fsdp_model(
            model_spec(cfg.model, Path(model_dir), cpu, train=False), meshes.fsdp("ref"), cpu
        )
        use_causal_sdpa(frozen)
        apply_packed_attention(
            frozen, cfg.trainer.packed_attention, packed=pack, device=cpu, dtype=torch.float32
        )
        apart = old_and_ref_logprobs(
            update_settings(cfg), rl, actor, Reference(frozen), batch, None, recompute_old=False
        )

        mask = batch.response_mask_BT.bool()
        out[f"pack={pack}"] = dict(
            equal=torch.equal(scored.ref_logprobs_BT, apart.ref_logprobs_BT),
            max_ref_gap=(scored.ref_logprobs_BT - apart.ref_logprobs_BT).abs().max().item(),
            adapted_gap=(scored.old_logprobs_BT - scored.ref_logprobs_BT)[mask].abs().max().item(),
            on_again=torch.equal(before.old_logprobs_BT, after.old_logprobs_BT)
            and torch.equal(before.old_logprobs_BT, scored.old_logprobs_BT),
            training=actor.training,
        )
        del actor, ref, frozen, optimizer
    return out


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("lora_reference") / "m"
    save_small_qwen2(path)
    return path


def test_actor_with_adapters_off_is_the_reference_bitwise(model_dir: Path) -> None:
    results = run_distributed(_worker, 2, str(model_dir), timeout_s=600)
    for rank, res in enumerate(results):
        for case, r in res.items():
            where = (rank, case)
            assert r["equal"], (where, r["max_ref_gap"])
            assert r["adapted_gap"] > 1e-4, (where, r["adapted_gap"])  # the trained adapters count
            assert r["on_again"], where
            assert r["training"], where
