"""LoRA against full fine-tuning on the same model, in one run: update step time, trainer memory, sync time.

Builds a random Qwen2 of a named shape (benchmarks/train_step.py's shapes, or ``small``; no download) with spmdrl's
build path twice, once training every weight and once with ``model.lora`` adapters (rank ``--rank``,
every decoder linear unless ``--targets``), and for each:

- ``step_s``: forward + backward + AdamW (spmdrl.optim.build_optimizer: a LoRA model's optimizer holds
  the adapters only) on a synthetic batch, median of ``--steps`` after two warm-up steps, slowest rank;
- ``state_mib``: what one rank keeps between steps: its parameter shards, gradient shards and AdamW
  moments (exact byte counts, on any device);
- ``peak_gib``: the CUDA allocator's peak over the timed steps (CUDA only: on CPU the process's peak
  resident set only grows, so two variants in one process cannot be told apart);
- ``sync_s``: the weight sync's trainer side, ``engine_weights(iter_full_tensors(...))`` drained (the
  all-gather per bucket, and for LoRA the merge W + alpha/r B A), without an engine, median of 5.

Full fine-tuning is the baseline of every figure (``ratio`` = LoRA / full).

    torchrun --nproc_per_node=2 benchmarks/lora.py --json lora.json                        # CPU, gloo
    torchrun --nproc_per_node=1 benchmarks/lora.py --shape qwen2.5-0.5b --seq 1024 --batch 8  # one GPU
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
from bench_report import Figure, fmt_ratio, write_json
from shapes import SHAPES
from train_step import TRAIN_SHAPES, ce_loss
from transformers import Qwen2Config, Qwen2ForCausalLM

from spmdrl.config import LoraConfig, OptimConfig
from spmdrl.distributed.env import broadcast_str, init_distributed
from spmdrl.distributed.placement import Placement
from spmdrl.models.build import ModelSpec, build_fsdp_model
from spmdrl.optim import build_optimizer
from spmdrl.rollout.weight_sync import engine_weights, iter_full_tensors, trainer_weights

# train_step.py's shapes and "small" between its CPU and GPU sizes (~27M parameters), where adapters are a
# realistic fraction of the model on a CPU.
LORA_SHAPES = (*TRAIN_SHAPES, "small")


def save_random_model(shape: str, out: Path) -> None:
    cfg = Qwen2Config(**{**SHAPES[shape], "tie_word_embeddings": True}, max_position_embeddings=4096)
    torch.manual_seed(0)
    Qwen2ForCausalLM(cfg).save_pretrained(out)


def _local_bytes(t: torch.Tensor) -> int:
    local = t.to_local() if hasattr(t, "to_local") else t
    return local.numel() * local.element_size()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()
    dist.barrier()


def measure(
    path: Path, mesh, device: torch.device, lora: LoraConfig | None, args: argparse.Namespace
) -> dict[str, float]:
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = build_fsdp_model(ModelSpec(path, dtype, torch.float32, lora=lora), mesh, device)
    opt = build_optimizer(model, OptimConfig(lr=1e-5))
    ids = torch.randint(0, model.config.vocab_size, (args.batch, args.seq), device=device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times = []
    for i in range(args.steps + 2):
        _sync(device)
        t0 = time.perf_counter()
        ce_loss(model, ids).backward()
        opt.step()
        _sync(device)
        if i >= 2:
            times.append(time.perf_counter() - t0)
        if i == args.steps + 1:  # the state held between steps: with the last step's gradients
            state = sum(_local_bytes(p) for p in model.parameters())
            state += sum(_local_bytes(p.grad) for p in model.parameters() if p.grad is not None)
            state += sum(_local_bytes(v) for s in opt.state.values() for v in s.values() if v.dim() > 0)
        opt.zero_grad(set_to_none=True)
    peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else float("nan")
    sync = []
    with torch.no_grad():
        for _ in range(5):
            _sync(device)
            t0 = time.perf_counter()
            for _name, _t in engine_weights(model, iter_full_tensors(trainer_weights(model), dtype=dtype)):
                pass
            _sync(device)
            sync.append(time.perf_counter() - t0)
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    out = torch.tensor([statistics.median(times), statistics.median(sync)], device=device)
    dist.all_reduce(out, op=dist.ReduceOp.MAX)  # the slowest rank's
    del model, opt
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return {
        "step_s": float(out[0]),
        "sync_s": float(out[1]),
        "state_mib": state / 2**20,
        "peak_gib": peak,
        "trained_m": trained / 1e6,
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="small", choices=sorted(LORA_SHAPES))
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--alpha", type=float, default=32.0)
    p.add_argument("--targets", default="all-linear", help="comma-separated model.lora.target_modules")
    p.add_argument("--json", default="", help="also write the figures (baseline: full fine-tuning) here")
    args = p.parse_args()
    env = init_distributed("auto")
    mesh = Placement.colocated(env.world_size).build_meshes(env.device.type).fsdp("actor")
    lora = LoraConfig(rank=args.rank, alpha=args.alpha, target_modules=args.targets.split(","))
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "model"
        if env.rank == 0:
            save_random_model(args.shape, path)
        path = Path(broadcast_str(str(path)))
        dist.barrier()
        full = measure(path, mesh, env.device, None, args)
        adapted = measure(path, mesh, env.device, lora, args)
        dist.barrier()
    if env.rank == 0:
        dev = torch.cuda.get_device_name() if env.device.type == "cuda" else "cpu"
        print(
            f"\n{args.shape}, {env.world_size} rank(s) on {dev}, batch {args.batch} x seq {args.seq} per rank, "
            f"LoRA rank {args.rank} on {args.targets}"
        )
        print(f"{'figure':<24}{'full':>12}{'LoRA':>12}{'LoRA/full':>11}")
        figs = figures(full, adapted, with_peak=env.device.type == "cuda")
        for f in figs:
            print(
                f"{f.name.removeprefix('lora/'):<24}{f.baseline:>12.4g}{f.value:>12.4g}{fmt_ratio(f.ratio):>11}"
            )
        if args.json:
            write_json(
                args.json,
                "lora",
                figs,
                shape=args.shape,
                world_size=env.world_size,
                device=dev,
                seq=args.seq,
                batch=args.batch,
                steps=args.steps,
                rank=args.rank,
                targets=args.targets,
            )
    dist.destroy_process_group()


def figures(full: dict[str, float], lora: dict[str, float], *, with_peak: bool) -> list[Figure]:
    units = {"step_s": "s", "sync_s": "s", "state_mib": "MiB", "trained_m": "M params", "peak_gib": "GiB"}
    keys = ["trained_m", "step_s", "state_mib", "sync_s"] + (["peak_gib"] if with_peak else [])
    return [Figure(f"lora/{k}", lora[k], units[k], full[k]) for k in keys]


if __name__ == "__main__":
    main()
