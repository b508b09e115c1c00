"""Expert parallelism (parallel.ep) trains as FSDP2 alone does: on the built-in tiny-moe (4 layers of 4
experts, 2 per token), in real gloo processes, the actor with its experts split over ep ranks (all-to-all
dispatch, FSDP2 over the (efsdp, ep) experts mesh) against the same model sharded by FSDP2 alone, on the
same rows per rank: the loss of a forward, every gradient (the experts' gathered from both mesh dimensions),
then one whole update (spmdrl.rl.update.update_policy: two micro-batches, the gradient norm clipped over
both meshes, AdamW) and its weights, equal to float32 rounding (the expert sums run in another order).

The weight sync of an ep actor: the engine (all experts, float32) serves the trainer's model fresh and after
a checked sync of perturbed weights, and one expert corrupted on one rank's engine is still caught and named;
the same under parallel.placement=async, where the engines on the rollout ranks get every expert by broadcast
from the first trainer rank (tests/integration/test_grpo_async_ep.py runs that placement end to end).

The checkpoint and the export of an ep model: a DCP save of the actor and its AdamW state loads into an
ep model and into an FSDP2-only one (resharded) exactly; the HF export (each expert's matrices, the
checkpoint's layout) loads in transformers with the trainer's logits, and exporting the DCP checkpoint gives
the same files.

ep=2 on 2 ranks is in the default tier; ep=2 x efsdp=2 (also under activation checkpointing, which recomputes
the all-to-alls in backward) and ep=4 on 4 ranks, the weight sync, the checkpoint and export run under --all.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from spmdrl.testing.models import padded_rows
from spmdrl.testing.spawn import run_distributed

pytestmark = pytest.mark.slow

N, PROMPTS = 2, 4  # rows per prompt, prompts per mini-batch over all ranks


def _rows(rank: int, world: int, vocab: int):  # noqa: ANN202
    from spmdrl.rl.batch import PolicyBatch

    g = torch.Generator().manual_seed(0)
    B = PROMPTS * N
    ids, attn, resp = padded_rows(
        torch.randint(2, 6, (B,), generator=g), torch.randint(1, 9, (B,), generator=g), vocab, g
    )
    engine_lp = -torch.rand(ids.shape, generator=g) * resp
    adv = torch.randn(ids.shape, generator=g) * resp
    rows = slice(rank * B // world, (rank + 1) * B // world)
    return PolicyBatch(ids[rows], attn[rows], resp[rows], engine_lp[rows], adv[rows])


def _name(n: str) -> str:
    return n.replace("._checkpoint_wrapped_module", "")  # activation checkpointing's wrapper


def _worker(rank: int, world: int, model_dir: str, ep: int, ac: str = "off") -> dict:
    from torch.distributed.tensor import DTensor

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
    from spmdrl.rl.settings import update_settings
    from spmdrl.rl.update import update_policy

    meshes = Placement.colocated(world, ep=ep).build_meshes("cpu")
    spec = ModelSpec(Path(model_dir), torch.float32, torch.float32, activation_checkpointing=ac)
    # A small clip: the update's step is the clipped one, so the norm over both meshes decides it. Adam's
    # first step is lr * g / (|g| + eps): with the default eps a gradient element near 0 (a few per tensor
    # here) steps by about +-lr whichever side of 0 rounding puts it; eps=1e-3 makes the step smooth in g,
    # so float32 rounding of the gradients stays rounding in the weights.
    optim = OptimConfig(lr=1e-3, eps=1e-3, grad_clip=0.5)
    cfg = Config(
        trainer=TrainerConfig(global_batch_size=PROMPTS, micro_batch_size=2),
        rollout=RolloutConfig(n=N),
        optim=optim,
        algorithm=AlgorithmConfig(use_kl_loss=False),
    )
    rl = derive_rl(cfg, derive(cfg, world, 100, samples_per_item=N))
    batch = _rows(rank, world, vocab=64)
    out: dict = {}
    for name, experts_mesh in (("fsdp", None), ("ep", meshes.experts("actor"))):
        model = build_fsdp_model(spec, meshes.fsdp("actor"), torch.device("cpu"), experts_mesh)
        experts = model.model.layers[0].mlp.experts.gate_up_proj
        res: dict = {"experts_local": tuple(experts.to_local().shape), "placements": str(experts.placements)}
        # 1. One forward and backward: the loss on this rank's rows, every gradient (summed over ranks).
        logits = model(input_ids=batch.input_ids_BT, attention_mask=batch.attention_mask_BT).logits
        loss = (logits.log_softmax(-1)[..., 7] * batch.response_mask_BT).sum()
        loss.backward()
        res["loss"] = loss.item()
        res["grads"] = {_name(n): p.grad.full_tensor() for n, p in model.named_parameters()}
        model.zero_grad(set_to_none=True)
        # 2. One update: two micro-batches per rank, clipping over both meshes, AdamW.
        optimizer = build_optimizer(model, optim)
        res["metrics"] = update_policy(update_settings(cfg), rl, model, optimizer, batch).metrics
        res["weights"] = {_name(n): p.full_tensor() for n, p in model.named_parameters()}
        res["all_dtensors"] = all(isinstance(p, DTensor) for p in model.parameters())
        out[name] = res
    return out


def _check(results: list[dict], ep: int, world: int) -> None:
    per_rank = 4 // ep  # experts an ep rank holds, which FSDP2 shards over the world / ep ranks holding them
    for res in results:
        fsdp, ep_res = res["fsdp"], res["ep"]
        assert ep_res["experts_local"][0] == max(per_rank // (world // ep), 1), ep_res["experts_local"]
        assert "Shard(dim=0)" in ep_res["placements"] and fsdp["placements"] == "(Shard(dim=0),)"
        assert ep_res["loss"] == pytest.approx(fsdp["loss"], rel=1e-6), (ep_res["loss"], fsdp["loss"])
        assert fsdp["grads"].keys() == ep_res["grads"].keys()
        for n, g in fsdp["grads"].items():
            torch.testing.assert_close(ep_res["grads"][n], g, rtol=1e-5, atol=1e-5, msg=n)
        experts = "model.layers.2.mlp.experts.down_proj"
        assert fsdp["grads"][experts].abs().max() > 1e-3  # the experts did get a gradient
        for key in ("actor/pg_loss", "actor/grad_norm"):
            assert ep_res["metrics"][key] == pytest.approx(fsdp["metrics"][key], rel=1e-5), key
        assert fsdp["metrics"]["actor/grad_norm"] > 0.5  # clipped: the norm over both meshes set the step
        for n, w in fsdp["weights"].items():
            torch.testing.assert_close(ep_res["weights"][n], w, rtol=1e-5, atol=1e-6, msg=n)
        assert ep_res["all_dtensors"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    from spmdrl.models.tiny import TINY_MOE, ensure_tiny_model

    return str(ensure_tiny_model(tmp_path_factory.mktemp("ep"), TINY_MOE))


@pytest.mark.guarantee("moe:ep")
def test_ep2_on_two_ranks_trains_as_fsdp_alone(model_dir: str) -> None:
    _check(run_distributed(_worker, 2, model_dir, 2, timeout_s=600), ep=2, world=2)


@pytest.mark.parametrize(("ep", "ac"), [(2, "off"), (4, "off"), (2, "full")])
def test_ep_on_four_ranks_trains_as_fsdp_alone(model_dir: str, ep: int, ac: str) -> None:
    """ep=2: two ep groups, each expert FSDP2-sharded over the two ranks holding it (the gradient norm sums
    over both dimensions of the experts' mesh); ep=4: one expert a rank; full activation checkpointing."""
    _check(run_distributed(_worker, 4, model_dir, ep, ac, timeout_s=600), ep=ep, world=4)


def _sync_worker(rank: int, world: int, model_dir: str) -> dict:
    from spmdrl.config import RolloutConfig
    from spmdrl.distributed.placement import Placement
    from spmdrl.models.build import ModelSpec, build_fsdp_model
    from spmdrl.rollout.engine import build_engine
    from spmdrl.rollout.weight_sync import SyncCheck, sync_weights
    from tests.integration.test_moe import EXPERT, MAX_LEN, _corrupted_sync
    from tests.integration.test_weight_sync import _mismatch, _perturb, _prompts

    meshes = Placement.colocated(world, ep=2).build_meshes("cpu")
    spec = ModelSpec(Path(model_dir), torch.float32, torch.float32, train=False)
    model = build_fsdp_model(spec, meshes.fsdp("actor"), torch.device("cpu"), meshes.experts("actor"))
    originals = [p.to_local().clone() for p in model.parameters()]
    engine = build_engine(
        Path(model_dir),
        RolloutConfig(tp=1, cpu_kvcache_gib=0.25, max_num_seqs=16, seed=0, dtype="float32"),
        max_model_len=MAX_LEN,
        device_type="cpu",
    )
    try:
        out: dict = {"fresh": _mismatch(model, engine, _prompts(rank), seed=1)}
        _perturb(model, originals, seed=10 + rank)
        out["stale"] = _mismatch(model, engine, _prompts(rank), seed=2)
        out["checked"] = sync_weights(model, engine, bucket_mb=0.5, check=SyncCheck(seed=1)).checked_groups
        out["synced"] = _mismatch(model, engine, _prompts(rank), seed=3)
        out["expert_broken"] = _corrupted_sync(model, engine, rank, EXPERT, seed=2)
        return out
    finally:
        engine.close()


def test_ep_actor_syncs_every_expert_to_the_engine(model_dir: str) -> None:
    """The engine needs all experts; each rank holds two of each layer's four: the sync gathers them."""
    r0, r1 = run_distributed(_sync_worker, 2, model_dir, timeout_s=900, env={"VLLM_LOGGING_LEVEL": "WARNING"})
    for r in (r0, r1):
        assert r["fresh"]["logprob_abs_diff_mean"] < 1e-4, r["fresh"]
        assert r["stale"]["logprob_abs_diff_mean"] > 1e-2, r["stale"]
        assert r["synced"]["logprob_abs_diff_mean"] < 1e-4, r["synced"]
        assert r["checked"] == 4 * (4 * 3 + 2) + 2, r["checked"]  # every expert of every layer, twice
    assert "layer 1: expert 2 down" in r1["expert_broken"], r1["expert_broken"]
    assert "failed on another rank's engine" in r0["expert_broken"], r0["expert_broken"]


def _async_sync_worker(rank: int, world: int, model_dir: str) -> dict:
    from spmdrl.config import RolloutConfig
    from spmdrl.distributed.placement import Placement
    from spmdrl.models.build import ModelSpec, build_fsdp_model, build_meta_model
    from spmdrl.rollout.engine import build_engine
    from spmdrl.rollout.fingerprint import WeightSyncError
    from spmdrl.rollout.weight_sync import Fanout, SyncCheck, sync_weights
    from tests.integration.test_moe import EXPERT, MAX_LEN, _doubled
    from tests.integration.test_weight_sync import _perturb

    placement = Placement.asynchronous(world, 2, ep=2)
    meshes = placement.build_meshes("cpu")
    spec = ModelSpec(Path(model_dir), torch.float32, torch.float32, train=False)
    trainer = meshes.holds("actor")
    fanout = Fanout(meshes.fanout_group, placement.fanout_ranks()[0], receiving=not trainer)
    model = build_meta_model(spec)
    if trainer:  # ranks 0-1: each holds 2 of every layer's 4 experts, and no engine
        model = build_fsdp_model(spec, meshes.fsdp("actor"), torch.device("cpu"), meshes.experts("actor"))
        _perturb(model, [p.to_local().clone() for p in model.parameters()], seed=10 + rank)
    engine = build_engine(  # on the rollout ranks only; every rank takes part in creating its groups
        Path(model_dir),
        RolloutConfig(tp=1, cpu_kvcache_gib=0.25, max_num_seqs=16, seed=0, dtype="float32"),
        max_model_len=MAX_LEN,
        device_type="cpu",
        ranks=placement.role("rollout").ranks,
    )

    def sync(seed: int) -> tuple[int, str]:
        try:
            stats = sync_weights(
                model,
                engine,
                check=SyncCheck(seed),
                fanout=fanout,
                device=torch.device("cpu"),
                dtype=torch.float32,
            )
            return stats.checked_groups, "no error"
        except WeightSyncError as e:
            return 0, str(e)

    try:
        out: dict = {"checked": sync(1)}
        if rank == 3:  # the last rollout rank's engine loads one expert doubled
            load = engine.load_weights  # type: ignore[union-attr]
            engine.load_weights = lambda ws: load((n, _doubled(t) if n == EXPERT else t) for n, t in ws)  # type: ignore[union-attr]
        out["expert_broken"] = sync(2)[1]
        return out
    finally:
        if engine is not None:
            engine.close()


def test_async_ep_actor_syncs_every_expert_to_the_rollout_ranks(model_dir: str) -> None:
    """parallel.placement=async with parallel.ep=2: trainer ranks 0-1 each hold half of each layer's experts
    and no engine; rank 0 broadcasts every gathered expert to the engines of rollout ranks 2-3 (Fanout). The
    check covers every expert on both engines, and one expert wrong on rank 3's engine stops every rank."""
    results = run_distributed(
        _async_sync_worker, 4, model_dir, timeout_s=900, env={"VLLM_LOGGING_LEVEL": "WARNING"}
    )
    for r in results[2:]:
        assert r["checked"] == (4 * (4 * 3 + 2) + 2, "no error"), r["checked"]  # every expert of every layer
    assert "layer 1: expert 2 down" in results[3]["expert_broken"], results[3]["expert_broken"]
    for r in results[:3]:
        assert "failed on another rank's engine" in r["expert_broken"], r["expert_broken"]


def _build_trained(model_dir: str, meshes, ep_on: bool):  # noqa: ANN001, ANN202
    from spmdrl.models.build import ModelSpec, build_fsdp_model
    from spmdrl.optim import build_lr_scheduler, build_optimizer
    from spmdrl.trainer_config import OptimConfig

    spec = ModelSpec(Path(model_dir), torch.float32, torch.float32)
    model = build_fsdp_model(
        spec, meshes.fsdp("actor"), torch.device("cpu"), meshes.experts("actor") if ep_on else None
    )
    optimizer = build_optimizer(model, OptimConfig(lr=1e-2))
    return model, optimizer, build_lr_scheduler(optimizer, OptimConfig(lr=1e-2), 10)


def _step(model, optimizer, ids: torch.Tensor) -> None:  # noqa: ANN001
    model(input_ids=ids).logits.log_softmax(-1)[..., 3].sum().backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _checkpoint_worker(rank: int, world: int, model_dir: str, out: str) -> dict:
    from spmdrl.checkpoint.checkpointer import RoleState, load_checkpoint, save_checkpoint
    from spmdrl.checkpoint.export import export_hf, write_hf_metadata
    from spmdrl.distributed.placement import Placement
    from spmdrl.models.load import load_tokenizer

    meshes = Placement.colocated(world, ep=2).build_meshes("cpu")
    ids = torch.randint(0, 60, (2, 9), generator=torch.Generator().manual_seed(rank))
    model, optimizer, scheduler = _build_trained(model_dir, meshes, ep_on=True)
    _step(model, optimizer, ids)
    saved = {n: p.full_tensor() for n, p in model.named_parameters()}
    moments = {n: optimizer.state[p]["exp_avg"].full_tensor() for n, p in model.named_parameters()}
    tokenizer = load_tokenizer(Path(model_dir), False)
    write_hf = lambda d: write_hf_metadata(model, tokenizer, d)  # noqa: E731
    save_checkpoint(
        Path(out) / "ckpt",
        1,
        [RoleState("actor", True, model, optimizer, scheduler, write_hf=write_hf)],
        {},
        keep=1,
    )
    export_hf(model, tokenizer, Path(out) / "hf")
    probe = torch.arange(3, 19).view(2, 8)
    with torch.no_grad():
        logits = model(input_ids=probe).logits
    res: dict = {"logits": logits, "probe": probe}
    for name, ep_on in (("ep", True), ("fsdp", False)):
        fresh, fresh_opt, fresh_sched = _build_trained(model_dir, meshes, ep_on)
        _step(fresh, fresh_opt, ids + 1)  # other weights and moments, which the load must replace
        load_checkpoint(
            Path(out) / "ckpt" / "step-1", [RoleState("actor", True, fresh, fresh_opt, fresh_sched)]
        )
        res[name] = all(torch.equal(p.full_tensor(), saved[n]) for n, p in fresh.named_parameters()) and all(
            torch.equal(fresh_opt.state[p]["exp_avg"].full_tensor(), moments[n])
            for n, p in fresh.named_parameters()
        )
    return res


@torch.no_grad()
def test_ep_checkpoint_loads_into_either_layout_and_exports(model_dir: str, tmp_path: Path) -> None:
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from spmdrl.checkpoint.export import export_checkpoint

    r0, r1 = run_distributed(_checkpoint_worker, 2, model_dir, str(tmp_path), timeout_s=600)
    assert r0["ep"] and r1["ep"], "an ep checkpoint did not load back into an ep model exactly"
    assert r0["fsdp"] and r1["fsdp"], "an ep checkpoint did not load into an FSDP2-only model exactly"
    export = load_file(tmp_path / "hf" / "model.safetensors")
    assert "model.layers.0.mlp.experts.3.down_proj.weight" in export  # every expert, per expert
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32)
    torch.testing.assert_close(loaded(input_ids=r0["probe"]).logits, r0["logits"], rtol=0, atol=1e-5)
    assert loaded.generate(r0["probe"][:1], max_new_tokens=4, do_sample=False).shape == (1, 12)
    export_checkpoint(tmp_path / "ckpt" / "step-1", tmp_path / "from_checkpoint")
    again = load_file(tmp_path / "from_checkpoint" / "model.safetensors")
    assert export.keys() == again.keys() and all(torch.equal(export[k], again[k]) for k in export)
