"""FSDP2 training-step throughput and peak memory: mixed precision and activation checkpointing.

``--loss grpo`` times the RL update's own path instead of plain cross-entropy: per-token logprobs
and entropy from the logits (spmdrl.models.forward.policy_logprobs) and the clipped policy loss.

Builds a randomly initialized Qwen2 of a named shape (no download), shards it with spmdrl's own
build path (meta -> fully_shard -> load), and times forward+backward+AdamW steps on synthetic
batches, in each variant, in one run. Prints a table with ratios to the first variant; ``--json FILE``
writes them as figures (benchmarks/bench_report.py) with the first variant as the baseline.

    torchrun --nproc_per_node=1 benchmarks/train_step.py --shape qwen2.5-0.5b --seq 1024 --batch 8   # one GPU
    torchrun --nproc_per_node=2 benchmarks/train_step.py --shape tiny --seq 128 --batch 8             # CPU, gloo
    torchrun --nproc_per_node=2 benchmarks/train_step.py --shape tiny --compile                       # + model.compile
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
from bench_report import Figure, write_json
from shapes import SHAPES
from transformers import Qwen2Config, Qwen2ForCausalLM

from spmdrl.distributed.env import init_distributed
from spmdrl.distributed.placement import Placement
from spmdrl.models.build import ModelSpec, build_fsdp_model

# The shapes this benchmark trains on one CPU or GPU (benchmarks/shapes.py has them all).
TRAIN_SHAPES = ("tiny", "qwen2.5-0.5b", "qwen2.5-1.5b")


def save_random_model(shape: str, out: Path) -> None:
    cfg = Qwen2Config(**{**SHAPES[shape], "tie_word_embeddings": True}, max_position_embeddings=4096)
    with torch.device("cpu"):
        torch.manual_seed(0)
        Qwen2ForCausalLM(cfg).save_pretrained(out)


def grpo_loss(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    from spmdrl.algos.aggregation import Aggregation
    from spmdrl.algos.policy_losses import policy_loss
    from spmdrl.config import AlgorithmConfig
    from spmdrl.models.forward import policy_logprobs

    # As the recipe with entropy_coeff=0 (the default): entropy as a metric, without a gradient graph.
    lp_BT, _ = policy_logprobs(model, ids, torch.ones_like(ids), with_entropy=True, entropy_grad=False)
    mask_BT = torch.ones_like(lp_BT, dtype=torch.bool)
    mask_BT[:, : ids.shape[1] // 4] = False  # a prompt quarter
    adv_B = torch.linspace(-1, 1, ids.shape[0], device=ids.device)
    agg = Aggregation.local("token-mean", mask_BT)
    return policy_loss("vanilla")(
        lp_BT, lp_BT.detach(), adv_B, mask_BT, agg=agg, params=AlgorithmConfig()
    ).loss


def ce_loss(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    logits = model(input_ids=ids).logits
    return torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten())


def time_variant(
    path: Path,
    mesh,
    device: torch.device,
    dtype: torch.dtype,
    ac: bool,
    seq: int,
    batch: int,
    steps: int,
    loss_fn=ce_loss,
    compile: bool = False,
) -> tuple[float, float]:
    spec = ModelSpec(path, dtype, torch.float32, activation_checkpointing=ac, compile=compile)
    model = build_fsdp_model(spec, mesh, device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, foreach=True)
    vocab = model.config.vocab_size
    ids = torch.randint(0, vocab, (batch, seq), device=device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    for i in range(steps + 2):  # two warm-up steps (model.compile compiles in the first)
        if i == 2:
            if device.type == "cuda":
                torch.cuda.synchronize()
            dist.barrier()
            t0 = time.perf_counter()
        loss = loss_fn(model, ids)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    if device.type == "cuda":
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - t0
    tokens_per_s = steps * batch * seq * dist.get_world_size() / elapsed
    peak_gib = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else float("nan")
    del model, opt
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return tokens_per_s, peak_gib


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="tiny", choices=TRAIN_SHAPES)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--loss", default="ce", choices=["ce", "grpo"])
    p.add_argument(
        "--compile", action="store_true", help="add a variant with model.compile (per-block torch.compile)"
    )
    p.add_argument("--json", default="", help="also write the figures (baseline: fp32) to this JSON file")
    args = p.parse_args()
    env = init_distributed("auto")
    mesh = Placement.colocated(env.world_size).build_meshes(env.device.type).fsdp("actor")
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "model"
        if env.rank == 0:
            save_random_model(args.shape, path)
        path = Path(_bcast(str(path)))
        dist.barrier()
        low = torch.bfloat16 if env.device.type == "cuda" else torch.float32
        variants = [
            ("fp32", torch.float32, False, False),
            (f"{str(low)[6:]} params", low, False, False),
            (f"{str(low)[6:]} + AC", low, True, False),
        ]
        if args.compile:
            variants.append((f"{str(low)[6:]} + compile", low, False, True))
        rows = []
        for name, dtype, ac, compile in variants:
            loss_fn = grpo_loss if args.loss == "grpo" else ce_loss
            tps, peak = time_variant(
                path, mesh, env.device, dtype, ac, args.seq, args.batch, args.steps, loss_fn, compile
            )
            rows.append((name, tps, peak))
        dist.barrier()
    if env.rank == 0:
        dev = torch.cuda.get_device_name() if env.device.type == "cuda" else "cpu"
        print(
            f"\n{args.shape}, {args.loss} loss, {env.world_size} rank(s) on {dev}, batch {args.batch} x seq {args.seq} per rank"
        )
        print(f"{'variant':<18}{'tokens/s':>12}{'x fp32':>9}{'peak GiB':>10}{'x fp32':>9}")
        for name, tps, peak in rows:
            print(f"{name:<18}{tps:>12.0f}{tps / rows[0][1]:>9.2f}{peak:>10.2f}{peak / rows[0][2]:>9.2f}")
        if args.json:
            write_json(
                args.json,
                "train_step",
                figures(rows, with_memory=env.device.type == "cuda"),
                shape=args.shape,
                loss=args.loss,
                world_size=env.world_size,
                device=dev,
                seq=args.seq,
                batch=args.batch,
                steps=args.steps,
            )
    dist.destroy_process_group()


def figures(rows: list[tuple[str, float, float]], with_memory: bool) -> list[Figure]:
    """Tokens/s (and peak GiB on CUDA) of each variant; the baseline is the first variant (fp32)."""
    _, base_tps, base_peak = rows[0]
    out = []
    for name, tps, peak in rows:
        key = name.replace(" + ", "_").replace(" ", "_")
        out.append(Figure(f"train_step/{key}/tokens_per_s", tps, "tokens/s", base_tps))
        if with_memory:
            out.append(Figure(f"train_step/{key}/peak_gib", peak, "GiB", base_peak))
    return out


def _bcast(s: str) -> str:
    box = [s]
    dist.broadcast_object_list(box, src=0)
    return box[0]


if __name__ == "__main__":
    main()
