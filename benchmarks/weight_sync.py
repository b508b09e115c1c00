"""Weight sync benchmark: the bucketed FSDP2 -> vLLM sync against the simple ways of doing it.

    torchrun --nproc_per_node=2 benchmarks/weight_sync.py
    torchrun --nproc_per_node=2 benchmarks/weight_sync.py --layers 8 --hidden 512 --vocab 16384 --tp 2
    torchrun --nproc_per_node=2 benchmarks/weight_sync.py --model-dir /path/to/hf/model --no-engine
    torchrun --nproc_per_node=1 benchmarks/weight_sync.py --device cuda --model-dir /path/to/hf/model --enforce-eager

Measured in one run, on the same ranks and the same model (a random Qwen2 of the given shape, or
``--model-dir``), each the median of ``--repeats`` after one warm-up:

- ``one all_gather``: a single all-gather of as many bytes as the whole model in the engine dtype: the
  communication floor, with nothing to unpack;
- ``one device copy``: one ``copy_`` of as many bytes on the device: the memory floor (on one rank the
  all-gather moves nothing, and the bytes must still be written once into the engine's tensors);
- ``bucketed gather``: :func:`spmdrl.rollout.weight_sync.iter_full_tensors` drained, per bucket size;
- ``per-param full_tensor``: ``DTensor.full_tensor()`` for each parameter (one collective each), cast;
- ``bucketed sync`` / ``per-param sync``: the same two, fed into the vLLM engine's in-place reload;
- ``bucketed sync + check``: the bucketed sync followed by the run-time check that the engine's kernels
  return exactly the synced weights (what the recipes run every step; spmdrl/rollout/fingerprint.py);
- ``bucketed sync, direct load by the loaders``: the same stream into the model's own ``load_weights``,
  which writes each tensor into the live parameter (what verl does), instead of vLLM's in-place reload,
  which puts each layer back on the meta device, materializes it, loads, re-processes and copies it into
  the kernels' tensors. Only where the kernels read the parameters in place (CUDA; CPU with
  ``--cpu-gemm torch``: the packed CPU paths drop the weight after packing);
- ``bucketed sync, direct load`` (and ``+ check``): the job's direct load
  (spmdrl.rollout.vllm_worker.load_weights_direct), whose first call (the warm-up) runs the loaders and
  records their copies, and whose measured calls replay them as batched copies
  (spmdrl.rollout.copy_plan); each repeat of the checked row is checked like a recipe's sync (the
  engine's kernels return the streamed weights), which also proves the unchecked rows' loads take.

Prints ratios to the bucketed gather and to the floor: on one rank the device copy, on several the
all-gather; absolute times depend on the machine. With ``--json FILE`` writes every row as a figure
(benchmarks/bench_report.py) whose baseline is that floor: ``ratio`` is how many times the floor of moving
the same bytes each method takes (the goal for the checked sync at 0.5B and up: at most 1.5).
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
from bench_report import Figure, write_json

from spmdrl.distributed.env import broadcast_str, init_distributed
from spmdrl.distributed.placement import Placement
from spmdrl.models.build import ModelSpec, build_fsdp_model
from spmdrl.rollout.weight_sync import (
    DEFAULT_BUCKET_MB,
    SyncCheck,
    iter_full_tensors,
    sync_weights,
    tied_uses,
    trainer_weights,
)

all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-dir", default="", help="an HF Qwen2/Llama directory; default: a random Qwen2")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--intermediate", type=int, default=1536)
    p.add_argument("--vocab", type=int, default=16384)
    p.add_argument("--buckets-mb", default="4,32,128", help="bucket sizes for the gather-only rows")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--no-engine", action="store_true", help="skip vLLM; time the gathers only")
    p.add_argument("--cpu-gemm", default="auto", help="rollout.cpu_gemm for the engine (CPU)")
    p.add_argument(
        "--enforce-eager",
        action="store_true",
        help="CUDA: build the engine without torch.compile and CUDA graphs (faster start; the sync is the same)",
    )
    p.add_argument(
        "--json", default="", help="also write the figures (seconds, x one all-gather) to this file"
    )
    return p.parse_args()


def _random_qwen2(out: Path, a: argparse.Namespace) -> None:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from spmdrl.models.tiny import VOCAB_SIZE, build_tokenizer

    if a.vocab < VOCAB_SIZE:
        raise SystemExit(f"--vocab must be >= {VOCAB_SIZE} (the tokenizer's size), got {a.vocab}")
    cfg = Qwen2Config(
        vocab_size=a.vocab,
        hidden_size=a.hidden,
        intermediate_size=a.intermediate,
        num_hidden_layers=a.layers,
        num_attention_heads=max(1, a.hidden // 64),
        num_key_value_heads=max(1, a.hidden // 256),
        head_dim=64,
        tie_word_embeddings=True,
        max_position_embeddings=256,
    )
    cfg.architectures = ["Qwen2ForCausalLM"]
    torch.manual_seed(0)
    Qwen2ForCausalLM(cfg).save_pretrained(out)
    # vLLM loads a tokenizer with the model; the tiny model's (512 ids, all below --vocab) serves.
    build_tokenizer().save_pretrained(out)


def _slug(label: str) -> str:
    """A row's label as a figure name: "bucketed sync -> vLLM, 32 MB" -> "bucketed_sync_vllm_32_mb"."""
    return re.sub(r"[^a-z0-9.]+", "_", label.lower()).strip("_")


def _direct_load(worker: object, weights: object) -> None:
    """Inside vLLM's worker: the model's own load_weights into its live parameters (no re-processing), at
    every sync (the job's direct load replays its first one's copies: spmdrl.rollout.copy_plan)."""
    worker.model_runner.get_model().load_weights(weights)  # type: ignore[attr-defined]


def _median_s(fn: Callable[[], object], repeats: int, device: torch.device) -> float:
    times = []
    for i in range(repeats + 1):
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        dist.barrier()
        if i:  # the first run warms up allocators and communicators
            times.append(time.perf_counter() - t0)
    # Every rank reports the slowest rank's median: the sync is as slow as its slowest rank.
    t = torch.tensor([statistics.median(times)], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def main() -> None:
    a = _args()
    env = init_distributed(a.device)
    device = env.device
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    tmp = None
    if a.model_dir:
        model_dir = Path(a.model_dir)
    else:
        tmp = tempfile.TemporaryDirectory(prefix="spmdrl-bench-") if env.is_main else None
        model_dir = Path(broadcast_str(tmp.name if tmp else ""))
        if env.is_main:
            _random_qwen2(model_dir, a)
        dist.barrier()

    mesh = Placement.colocated(env.world_size).build_meshes(device.type).fsdp("actor")
    model = build_fsdp_model(ModelSpec(model_dir, torch.float32, torch.float32, train=False), mesh, device)
    dtype = torch.bfloat16
    weights = list(trainer_weights(model))
    total_bytes = sum(p.numel() for _, p in weights) * dtype.itemsize
    per_rank = -(-total_bytes // (dtype.itemsize * env.world_size))

    def one_all_gather() -> None:
        send = torch.empty(per_rank, dtype=dtype, device=device)
        recv = torch.empty(per_rank * env.world_size, dtype=dtype, device=device)
        all_gather_single(recv, send)

    # Freed before the engine is built (a second copy of the model on the device, twice).
    copy_buffers = [torch.empty(total_bytes // dtype.itemsize, dtype=dtype, device=device) for _ in range(2)]

    def one_copy() -> None:
        copy_buffers[1].copy_(copy_buffers[0])

    def drain(it: object) -> None:
        for _ in it:  # type: ignore[attr-defined]
            pass

    rows: list[tuple[str, float]] = [
        ("one all_gather, whole model", _median_s(one_all_gather, a.repeats, device)),
        ("one device copy, whole model", _median_s(one_copy, a.repeats, device)),
    ]
    # The floor of moving these bytes: on one rank nothing crosses ranks, so the copy; else the all-gather
    # (which writes every byte once too).
    floor_name, floor = (
        ("one device copy of the whole model's bytes", rows[1][1])
        if env.world_size == 1
        else ("one all_gather of the whole model's bytes", rows[0][1])
    )
    copy_buffers.clear()
    bucket_sizes = [float(x) for x in a.buckets_mb.split(",")]
    for mb in bucket_sizes:
        rows.append(
            (
                f"bucketed gather, {mb:g} MB",
                _median_s(
                    lambda mb=mb: drain(iter_full_tensors(weights, dtype=dtype, bucket_mb=mb)),
                    a.repeats,
                    device,
                ),
            )
        )
    # The reference row: the default bucket size when it was measured, else the largest one.
    ref_mb = DEFAULT_BUCKET_MB if DEFAULT_BUCKET_MB in bucket_sizes else max(bucket_sizes)
    ref = dict(rows)[f"bucketed gather, {ref_mb:g} MB"]
    rows.append(
        (
            "per-param full_tensor",
            _median_s(lambda: drain((n, p.full_tensor().to(dtype)) for n, p in weights), a.repeats, device),
        )
    )
    if not a.no_engine:
        from spmdrl.config import RolloutConfig
        from spmdrl.rollout.engine import build_engine

        cfg = RolloutConfig(
            tp=a.tp,
            cpu_kvcache_gib=0.25,
            max_num_seqs=8,
            dtype="bfloat16",
            cpu_gemm=a.cpu_gemm,
            enforce_eager=a.enforce_eager,
            weight_load="reload",  # the sync rows: vLLM's reload; the direct rows call the direct load
        )
        engine = build_engine(model_dir, cfg, max_model_len=128, device_type=device.type)
        rows.append(
            (
                f"bucketed sync -> vLLM, {DEFAULT_BUCKET_MB:g} MB",
                _median_s(lambda: sync_weights(model, engine), a.repeats, device),
            )
        )
        seeds = iter(range(1_000_000))
        rows.append(
            (
                "bucketed sync + check -> vLLM",
                _median_s(
                    lambda: sync_weights(model, engine, check=SyncCheck(seed=next(seeds))), a.repeats, device
                ),
            )
        )
        rows.append(
            (
                "per-param full_tensor -> vLLM",
                _median_s(
                    lambda: engine.load_weights((n, p.full_tensor().to(dtype)) for n, p in weights),
                    a.repeats,
                    device,
                ),
            )
        )
        if device.type == "cuda" or set(engine.gemm_paths) == {"torch"}:
            from spmdrl.rollout.fingerprint import Fingerprint, WeightSyncError, compare, observe
            from spmdrl.rollout.vllm_worker import load_weights_direct

            def direct(check: bool, load: Callable[..., object] = load_weights_direct) -> None:
                seed = next(seeds)
                sent = Fingerprint()
                stream = iter_full_tensors(weights, dtype=dtype)
                if check:
                    stream = observe(stream, sent, seed, tied_uses(model))
                with engine.world.vllm():
                    engine.llm.collective_rpc(load, args=(stream,))
                    engine.llm.reset_prefix_cache()
                if check and compare(engine.weight_fingerprint(seed), sent, SyncCheck.tol):
                    raise WeightSyncError("the direct load did not reach the engine's kernels")

            rows.append(
                (
                    "bucketed sync, direct load by the loaders",
                    _median_s(lambda: direct(False, _direct_load), a.repeats, device),
                )
            )
            # The job's direct load: its warm-up records the copy plan, the measured repeats replay it.
            rows.append(("bucketed sync, direct load", _median_s(lambda: direct(False), a.repeats, device)))
            # Every repeat checked: also proves the unchecked rows' loads took.
            rows.append(
                ("bucketed sync, direct load + check", _median_s(lambda: direct(True), a.repeats, device))
            )
        elif env.is_main:
            print(f"(no direct-load row: the engine's CPU GEMM paths {engine.gemm_paths} keep packed copies)")
        engine.close()

    if env.is_main:
        print(
            f"\nweight sync: {env.world_size} ranks on {device.type}, {len(weights)} tensors, "
            f"{total_bytes / 1e6:.1f} MB in {dtype}, median of {a.repeats} (slowest rank)"
        )
        print(f"{'method':<38} {'ms':>9} {'x floor':>9} {f'x bucketed {ref_mb:g} MB':>19}")
        for name, t in rows:
            print(f"{name:<38} {t * 1e3:>9.2f} {t / floor:>9.2f} {t / ref:>19.2f}")
        print(f"(floor: {floor_name})")
        if a.json:
            write_json(
                a.json,
                "weight_sync",
                [Figure(f"weight_sync/{_slug(n)}", t, "s", floor) for n, t in rows],
                world_size=env.world_size,
                device=device.type,
                bytes=total_bytes,
                tensors=len(weights),
                dtype=str(dtype).removeprefix("torch."),
                repeats=a.repeats,
                baseline=floor_name,
            )
    dist.barrier()
    if tmp is not None:
        tmp.cleanup()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
