"""Checkpoints with real DCP on gloo processes: exact round trip, resharding 2 -> 1 and 2 -> 4, between FSDP2's
shards and a bare module's whole tensors (model.fsdp_unit=none) both ways, never half-written (a killed save,
a full disk), and the one-process export that transformers and vLLM load."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from spmdrl.testing.spawn import SpawnError, run_distributed

STEPS_BEFORE = 2


def _build(model_dir: str, unit: str = "auto"):  # noqa: ANN202
    from spmdrl.checkpoint.checkpointer import RoleState
    from spmdrl.checkpoint.export import write_hf_metadata
    from spmdrl.config import OptimConfig
    from spmdrl.distributed.placement import Placement
    from spmdrl.models.build import ModelSpec, build_fsdp_model
    from spmdrl.models.load import load_tokenizer
    from spmdrl.optim import build_lr_scheduler, build_optimizer

    world = torch.distributed.get_world_size()
    mesh = Placement.colocated(world).build_meshes("cpu").fsdp("actor")
    model = build_fsdp_model(
        ModelSpec(Path(model_dir), torch.float32, torch.float32, fsdp_unit=unit), mesh, torch.device("cpu")
    )
    cfg = OptimConfig(lr=1e-2, warmup_steps=3, schedule="cosine")
    opt = build_optimizer(model, cfg)
    sched = build_lr_scheduler(opt, cfg, 10)
    tok = load_tokenizer(Path(model_dir))
    role = RoleState("actor", True, model, opt, sched, None, lambda d: write_hf_metadata(model, tok, d))
    return model, opt, sched, role


def _train_step(model, opt, sched, step: int) -> None:  # noqa: ANN001
    # The same global batch whatever the world size: each rank takes its rows of it.
    g = torch.Generator().manual_seed(step)
    ids = torch.randint(3, 200, (4, 12), generator=g)
    world, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
    mine = ids.chunk(world)[rank] if world <= 4 else ids
    loss = model(input_ids=mine).logits.float().pow(2).sum() / 4e4
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    sched.step()


def _full(model, opt) -> dict:  # noqa: ANN001
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    msd, osd = get_state_dict(model, opt, options=StateDictOptions(full_state_dict=True))
    flat = {f"model.{k}": v.clone() for k, v in msd.items()}
    for k, v in osd["state"].items():
        for name, t in v.items():
            flat[f"optim.{k}.{name}"] = t.clone() if isinstance(t, torch.Tensor) else torch.tensor(t)
    return flat


def _save_worker(rank: int, world: int, model_dir: str, root: str, unit: str = "auto") -> dict:
    from spmdrl.checkpoint.checkpointer import save_checkpoint

    model, opt, sched, role = _build(model_dir, unit)
    for s in range(STEPS_BEFORE):
        _train_step(model, opt, sched, s)
    stats = save_checkpoint(
        Path(root), STEPS_BEFORE, [role], {"sampler": {"epoch": 0, "step_in_epoch": 7}}, keep=2
    )
    before = _full(model, opt)
    # The straight run goes on one more step: what a resumed run must reproduce exactly.
    _train_step(model, opt, sched, STEPS_BEFORE)
    return {
        "saved": before,
        "next": _full(model, opt),
        "lr": sched.get_last_lr()[0],
        "seconds": stats.seconds,
        "bytes": stats.bytes,
        "param_bytes": sum(p.numel() * 4 for p in model.parameters()),
    }


def _load_worker(rank: int, world: int, model_dir: str, path: str, unit: str = "auto") -> dict:
    from spmdrl.checkpoint.checkpointer import load_checkpoint

    model, opt, sched, role = _build(model_dir, unit)
    trainer = load_checkpoint(Path(path), [role])
    loaded = _full(model, opt)
    _train_step(model, opt, sched, trainer["step"])
    return {"trainer": trainer, "loaded": loaded, "next": _full(model, opt), "lr": sched.get_last_lr()[0]}


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, list[dict]]:
    from spmdrl.models.tiny import ensure_tiny_model

    tmp = tmp_path_factory.mktemp("ckpt")
    model_dir = ensure_tiny_model(tmp)
    root = tmp / "checkpoints"
    return model_dir, root, run_distributed(_save_worker, 2, str(model_dir), str(root), timeout_s=300)


def _same(a: dict, b: dict) -> list[str]:
    return sorted(k for k in a if not torch.equal(a[k], b[k])) + sorted(set(a) ^ set(b))


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 1, 4])
def test_checkpoint_round_trip_and_reshard(saved: tuple[Path, Path, list[dict]], world: int) -> None:
    model_dir, root, straight = saved
    path = root / f"step-{STEPS_BEFORE}"
    meta = json.loads((path / "meta.json").read_text())
    assert meta["step"] == STEPS_BEFORE and meta["world_size"] == 2
    # Parameters (fp32) + Adam's two moments: the checkpoint is about 3x the parameter bytes, plus small files.
    assert 2.9 * straight[0]["param_bytes"] < meta["bytes"] < 3.5 * straight[0]["param_bytes"], meta
    res = run_distributed(_load_worker, world, str(model_dir), str(path), timeout_s=300)
    for r in res:
        assert r["trainer"]["step"] == STEPS_BEFORE and r["trainer"]["sampler"]["step_in_epoch"] == 7
        # Model and optimizer state come back bit for bit, on any number of ranks.
        assert not _same(r["loaded"], straight[0]["saved"]), _same(r["loaded"], straight[0]["saved"])[:5]
        assert r["lr"] == straight[0]["lr"]
        if world == 2:
            # Same world: the next step is bitwise the straight run's next step.
            assert not _same(r["next"], straight[0]["next"])
        else:
            # Another world size sums gradients in another order: equal to float rounding.
            for k, v in straight[0]["next"].items():
                torch.testing.assert_close(r["next"][k], v, rtol=1e-4, atol=1e-6)


@pytest.mark.slow
def test_a_bare_module_resumes_from_shards_and_back(
    saved: tuple[Path, Path, list[dict]], tmp_path: Path
) -> None:
    """model.fsdp_unit=none keeps whole tensors where FSDP2 keeps DTensor shards; DCP reshards between them.
    The 2-rank FSDP2 checkpoint loads bit for bit into a bare module on one process, which trains on from it
    to float rounding of the straight run; a checkpoint the bare module saves loads bit for bit into FSDP2
    shards on 2 ranks, and their next step is the bare module's to float rounding."""
    model_dir, root, straight = saved
    (bare,) = run_distributed(
        _load_worker, 1, str(model_dir), str(root / f"step-{STEPS_BEFORE}"), "none", timeout_s=300
    )
    assert not _same(bare["loaded"], straight[0]["saved"]), _same(bare["loaded"], straight[0]["saved"])[:5]
    for k, v in straight[0]["next"].items():
        torch.testing.assert_close(bare["next"][k], v, rtol=1e-4, atol=1e-6)
    (saved_bare,) = run_distributed(_save_worker, 1, str(model_dir), str(tmp_path), "none", timeout_s=300)
    sharded = run_distributed(
        _load_worker, 2, str(model_dir), str(tmp_path / f"step-{STEPS_BEFORE}"), timeout_s=300
    )
    for r in sharded:
        assert not _same(r["loaded"], saved_bare["saved"]), _same(r["loaded"], saved_bare["saved"])[:5]
        for k, v in saved_bare["next"].items():
            torch.testing.assert_close(r["next"][k], v, rtol=1e-4, atol=1e-6)


def _ckpt_ops_worker(rank: int, world: int, model_dir: str, root: str) -> dict:
    import resource
    import signal

    from spmdrl.checkpoint.checkpointer import (
        CheckpointError,
        complete_checkpoints,
        latest_checkpoint,
        save_checkpoint,
    )

    model, opt, sched, role = _build(model_dir)
    root_p = Path(root)
    out: dict = {}
    for step in (1, 2, 3):
        _train_step(model, opt, sched, step)
        save_checkpoint(root_p, step, [role], {}, keep=2)
    out["kept"] = [s for s, _ in complete_checkpoints(root_p)]
    # A save killed mid-way leaves a partial directory: never the latest, removed by the next save.
    if rank == 0:
        (root_p / ".partial-step-4" / "actor").mkdir(parents=True)
        (root_p / ".partial-step-4" / "actor" / "junk").write_text("x")
    torch.distributed.barrier()
    out["latest_with_partial"] = latest_checkpoint(root_p).name  # type: ignore[union-attr]
    # The disk fills up during the next save (a file-size limit makes writes fail with EFBIG).
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (100_000, hard))
    try:
        save_checkpoint(root_p, 4, [role], {}, keep=2)
        out["full_disk"] = "no error"
    except CheckpointError as e:
        out["full_disk"] = str(e)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    return out


@pytest.mark.guarantee("checkpoint:atomic")
@pytest.mark.slow
def test_checkpoints_are_never_half_written(tmp_path: Path) -> None:
    from spmdrl.models.tiny import ensure_tiny_model

    model_dir = ensure_tiny_model(tmp_path)
    root = tmp_path / "checkpoints"
    try:
        res = run_distributed(_ckpt_ops_worker, 2, str(model_dir), str(root), timeout_s=300)
    except SpawnError as e:  # a rank whose write failed raised: that is the message a user sees
        msg = str(e)
        assert "saving checkpoint step-4" in msg and "Nothing saved before is lost" in msg, msg
        assert "step-3, is intact" in msg, msg
    else:
        for r in res:
            assert r["kept"] == [2, 3] and r["latest_with_partial"] == "step-3"
        msgs = [r["full_disk"] for r in res]
        assert any("saving checkpoint step-4" in m and "step-3, is intact" in m for m in msgs), msgs
    # Whatever the failure, the newest complete checkpoint is still step-3 and loads.
    from spmdrl.checkpoint.checkpointer import latest_checkpoint

    assert latest_checkpoint(root).name == "step-3"  # type: ignore[union-attr]
    assert json.loads((root / "step-3" / "meta.json").read_text())["step"] == 3


def _vllm_logprobs_worker(rank: int, world: int, model_dir: str, ids: list[int]) -> list[float]:
    from spmdrl.config import RolloutConfig
    from spmdrl.rollout.engine import SamplingSpec, build_engine

    engine = build_engine(
        Path(model_dir),
        RolloutConfig(cpu_kvcache_gib=0.25, max_num_seqs=4, dtype="float32", cpu_gemm="torch"),
        max_model_len=64,
        device_type="cpu",
    )
    gens = engine.generate([ids], SamplingSpec(n=1, temperature=0.0, max_tokens=6, seed=0))
    engine.close()
    return [*gens[0].token_ids, *gens[0].logprobs]


@pytest.mark.slow
def test_export_from_a_sharded_checkpoint(saved: tuple[Path, Path, list[dict]], tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    model_dir, root, straight = saved
    out = tmp_path / "exported"
    res = subprocess.run(
        [sys.executable, "-m", "spmdrl.export", str(root.parent / "nowhere"), str(out)],
        capture_output=True,
        text=True,
    )
    assert res.returncode == 2 and "no complete checkpoint there" in res.stderr, res.stderr
    res = subprocess.run(
        [sys.executable, "-m", "spmdrl.export", str(root / f"step-{STEPS_BEFORE}"), str(out)],
        capture_output=True,
        text=True,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    assert {"model.safetensors", "config.json", "tokenizer.json", "generation_config.json"} <= {
        p.name for p in out.iterdir()
    }
    # transformers loads the trainer's weights exactly.
    hf = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    saved_params = {
        k.removeprefix("model."): v for k, v in straight[0]["saved"].items() if k.startswith("model.")
    }
    for k, v in hf.state_dict().items():
        assert torch.equal(v, saved_params[k]), k
    # vLLM serves them: its greedy tokens' logprobs match transformers' on the same tokens.
    prompt = [1, 17, 42, 99, 7]
    got = run_distributed(
        _vllm_logprobs_worker, 1, str(out), prompt, timeout_s=300, env={"VLLM_LOGGING_LEVEL": "WARNING"}
    )[0]
    tokens, engine_lp = [int(t) for t in got[:6]], got[6:]
    with torch.no_grad():
        logits = hf(input_ids=torch.tensor([prompt + tokens])).logits[0].float()
    hf_lp = torch.log_softmax(logits, -1)[len(prompt) - 1 : -1].gather(1, torch.tensor(tokens)[:, None])[:, 0]
    assert tokens == torch.argmax(logits[len(prompt) - 1 : -1], -1).tolist()
    torch.testing.assert_close(torch.tensor(engine_lp), hf_lp, atol=2e-3, rtol=0)


def _async_worker(rank: int, world: int, model_dir: str, root: str) -> dict:
    import torch.distributed as dist

    from spmdrl.checkpoint.checkpointer import Checkpointer, latest_checkpoint, load_checkpoint

    model, opt, sched, role = _build(model_dir)
    ckpt = Checkpointer(Path(root), [role], keep=2, async_save=True)
    for s in range(STEPS_BEFORE):
        _train_step(model, opt, sched, s)
    t0 = time.perf_counter()
    first = ckpt.save(STEPS_BEFORE, {"sampler": {}})
    blocking = time.perf_counter() - t0
    at_save = _full(model, opt)
    # Training goes on (and changes every weight) while the checkpoint is written in the background.
    for s in range(STEPS_BEFORE, STEPS_BEFORE + 2):
        _train_step(model, opt, sched, s)
    dist.barrier()
    unpublished = latest_checkpoint(Path(root))
    done = ckpt.finish()
    model2, opt2, sched2, role2 = _build(model_dir)
    trainer = load_checkpoint(Path(root) / f"step-{STEPS_BEFORE}", [role2])
    return {
        "first": first,
        "unpublished": unpublished,
        "published": done.path.name if done else None,
        "blocking_s": blocking,
        "same": not _same(_full(model2, opt2), at_save),
        "moved": bool(_same(_full(model, opt), at_save)),
        "step": trainer["step"],
    }


@pytest.mark.slow
def test_async_save_publishes_the_state_it_was_given(tmp_path: Path) -> None:
    from spmdrl.models.tiny import ensure_tiny_model

    model_dir = ensure_tiny_model(tmp_path)
    for r in run_distributed(_async_worker, 2, str(model_dir), str(tmp_path / "checkpoints"), timeout_s=300):
        assert r["first"] is None and r["unpublished"] is None  # not complete until published
        assert r["published"] == f"step-{STEPS_BEFORE}" and r["step"] == STEPS_BEFORE
        # The checkpoint holds the weights of the moment of the save, not the later ones.
        assert r["moved"] and r["same"]
