"""The optimizer step and the gradient clip on FSDP2's shards against the DTensor path, host time.

    python benchmarks/optimizer_step.py                     # CPU, one gloo rank, ~20 s
    python benchmarks/optimizer_step.py --device cuda --json opt.json

A random Qwen2 of shape ``deep-narrow`` (benchmarks/shapes.py: Qwen2.5-0.5B's 24 layers at the tiny width,
so the host's work per tensor shows more than the arithmetic: 290 tensors), sharded with the job's apply_fsdp on one rank, one backward for gradients. Timed,
each the best of 3 rounds of ``--steps`` calls (the device synchronized around each round):

- ``torch.optim.AdamW`` on the DTensor parameters against ``spmdrl.optim.ShardLocalAdamW`` (what the job
  builds), fused (CUDA's choice) and foreach (CPU's);
- ``torch.nn.utils.clip_grad_norm_`` on the DTensor gradients (with ``full_tensor()`` of the norm, as the
  job read it) against ``spmdrl.optim.clip_grad_norm``.

The two are the same arithmetic to the last bit (tests/unit/test_optim.py); the learning rate is tiny and
the clip's limit huge, so repeating them changes nothing that matters. Ratios are shards / DTensor: below
1, the shards' step is cheaper. ``--json``: the shards' times as figures with the DTensor path's as
baseline.
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
from bench_report import Figure, fmt_ratio, write_json
from shapes import SHAPES


def _args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--steps", type=int, default=30, help="calls per timed round")
    p.add_argument("--json", default="", help="also write the figures to this JSON file")
    return p.parse_args()


def _best_ms(fn: Callable[[], object], steps: int, device: torch.device) -> float:
    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    for _ in range(3):
        fn()
    best = float("inf")
    for _ in range(3):
        sync()
        t0 = time.perf_counter()
        for _ in range(steps):
            fn()
        sync()
        best = min(best, (time.perf_counter() - t0) / steps * 1e3)
    return best


def main() -> None:
    a = _args()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29581")  # one process; a test passes a free port
    dist.init_process_group("nccl" if a.device == "cuda" else "gloo", rank=0, world_size=1)
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from spmdrl.models.parallelize import apply_fsdp
    from spmdrl.optim import ShardLocalAdamW, clip_grad_norm

    device = torch.device(a.device)
    if device.type == "cuda":
        torch.cuda.set_device(0)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(**SHAPES["deep-narrow"])).to(device)
    apply_fsdp(model, init_device_mesh(a.device, (1,)), param_dtype=torch.float32, reduce_dtype=torch.float32)
    model(input_ids=torch.randint(0, 512, (2, 16), device=device)).logits.sum().backward()
    params = list(model.parameters())
    rows: list[tuple[str, float, float]] = []
    for kind in ("fused", "foreach"):
        dtensor = torch.optim.AdamW(params, lr=1e-12, **{kind: True})
        shards = ShardLocalAdamW(params, lr=1e-12, **{kind: True})
        rows.append(
            (f"adamw_{kind}", _best_ms(shards.step, a.steps, device), _best_ms(dtensor.step, a.steps, device))
        )

    def torch_clip() -> float:
        return float(torch.nn.utils.clip_grad_norm_(params, 1e9).full_tensor())  # type: ignore[union-attr]

    rows.append(
        (
            "clip",
            _best_ms(lambda: clip_grad_norm(model, 1e9), a.steps, device),
            _best_ms(torch_clip, a.steps, device),
        )
    )
    print(f"optimizer step on {a.device}, {len(params)} tensors, best of 3 x {a.steps} calls")
    print(f"{'figure':<16}{'shards ms':>12}{'DTensor ms':>12}{'shards/DTensor':>16}")
    for name, ours, theirs in rows:
        print(f"{name:<16}{ours:>12.2f}{theirs:>12.2f}{fmt_ratio(ours / theirs):>16}")
    if a.json:
        write_json(
            a.json,
            "optimizer_step",
            [Figure(f"optimizer_step/{n}", ms / 1e3, "s", theirs / 1e3) for n, ms, theirs in rows],
            device=a.device,
            tensors=len(params),
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
