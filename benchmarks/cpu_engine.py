"""CPU engine benchmark: generation and weight-sync speed for each engine dtype and CPU GEMM path.

    torchrun --nproc_per_node=2 benchmarks/cpu_engine.py
    torchrun --nproc_per_node=2 benchmarks/cpu_engine.py --configs auto/auto,bfloat16/onednn --json out.json

What ``rollout.dtype=auto`` should pick, measured on this machine in one run: for each
``dtype/cpu_gemm`` configuration, the same vLLM engine (the built-in tiny model unless ``--model-dir``)
generates the same requests as a grpo_tiny rollout (``--prompts`` prompts per rank x ``--n`` samples,
up to ``--max-tokens`` tokens, temperature 1, per-request seeds), then takes a checked weight sync from
an FSDP2 trainer. Each figure is the median of ``--repeats`` after one warm-up, the slowest rank's.
Prints generated tokens/s and sync time, and both as ratios to the first configuration (the baseline of
the ``--json`` figures, benchmarks/bench_report.py). Configurations the CPU cannot run (sgl without
native bf16, zentorch not installed) are listed as skipped.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist
from bench_report import Figure, write_json

from spmdrl.config import ConfigError, RolloutConfig
from spmdrl.distributed.env import init_distributed
from spmdrl.distributed.placement import Placement
from spmdrl.distributed.reduce import all_reduce_max
from spmdrl.models.build import ModelSpec, build_fsdp_model
from spmdrl.models.tiny import default_cache_dir, ensure_tiny_model
from spmdrl.rollout.engine import SamplingSpec, build_engine
from spmdrl.rollout.weight_sync import SyncCheck, sync_weights

DEFAULT_CONFIGS = "auto/auto,bfloat16/auto,float32/auto,bfloat16/onednn,bfloat16/torch,float32/onednn"


def _args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-dir", default="", help="an HF model directory; default: the built-in tiny model")
    p.add_argument("--configs", default=DEFAULT_CONFIGS, help="comma-separated dtype/cpu_gemm pairs")
    p.add_argument("--prompts", type=int, default=16, help="prompts per rank per generate")
    p.add_argument("--prompt-len", type=int, default=40)
    p.add_argument("--n", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=24)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--json", default="", help="also write the figures to this JSON file")
    return p.parse_args()


def figures(ran: list[dict]) -> list[Figure]:
    """Tokens/s and the checked sync's time of each configuration; the baseline is the first one's."""
    if not ran:
        return []
    ref = ran[0]
    out = []
    for r in ran:
        out.append(
            Figure(
                f"cpu_engine/{r['config']}/tokens_per_s", r["tokens_per_s"], "tokens/s", ref["tokens_per_s"]
            )
        )
        out.append(
            Figure(f"cpu_engine/{r['config']}/sync_check_s", r["sync_check_s"], "s", ref["sync_check_s"])
        )
    return out


def main() -> None:
    a = _args()
    env = init_distributed("cpu")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    model_dir = Path(a.model_dir) if a.model_dir else ensure_tiny_model(default_cache_dir())
    mesh = Placement.colocated(env.world_size).build_meshes("cpu").fsdp("actor")
    model = build_fsdp_model(
        ModelSpec(model_dir, torch.float32, torch.float32, train=False), mesh, torch.device("cpu")
    )
    g = torch.Generator().manual_seed(env.rank)
    prompts = [
        [1, *torch.randint(3, 500, (a.prompt_len - 1,), generator=g).tolist()] for _ in range(a.prompts)
    ]
    rows: list[dict] = []
    for i, pair in enumerate(a.configs.split(",")):
        dtype, gemm = pair.split("/")
        cfg = RolloutConfig(cpu_kvcache_gib=0.5, max_num_seqs=256, dtype=dtype, cpu_gemm=gemm, seed=i)
        try:
            engine = build_engine(model_dir, cfg, max_model_len=256, device_type="cpu")
        except ConfigError as e:
            rows.append({"config": pair, "skipped": str(e)})
            continue
        gen_s, tokens, sync_s = [], [], []
        for r in range(a.repeats + 1):
            spec = SamplingSpec(n=a.n, temperature=1.0, max_tokens=a.max_tokens, seed=1000 + r)
            t0 = time.perf_counter()
            gens = engine.generate(prompts, spec)
            dt = time.perf_counter() - t0
            t0 = time.perf_counter()
            sync_weights(model, engine, check=SyncCheck(seed=r))
            st = time.perf_counter() - t0
            local = {"gen": dt, "sync": st}
            slowest = all_reduce_max(local, torch.device("cpu"))
            n_tok = sum(len(x.token_ids) for x in gens)
            total_tok = torch.tensor([n_tok], dtype=torch.float64)
            dist.all_reduce(total_tok)
            if r > 0:  # the first is the warm-up
                gen_s.append(slowest["gen"])
                sync_s.append(slowest["sync"])
                tokens.append(float(total_tok))
        paths = dict(engine.gemm_paths)
        engine.close()
        med_gen = statistics.median(gen_s)
        rows.append(
            {
                "config": pair,
                "dtype": str(engine.dtype).removeprefix("torch."),
                "gemm_paths": paths,
                "tokens_per_s": statistics.median(tokens) / med_gen,
                "generate_s": med_gen,
                "sync_check_s": statistics.median(sync_s),
            }
        )
    if env.is_main:
        ran = [r for r in rows if "skipped" not in r]
        ref = ran[0] if ran else None
        print(
            f"\nCPU engine: {env.world_size} ranks x {a.prompts} prompts x {a.n} samples, <= {a.max_tokens} "
            f"tokens, median of {a.repeats} (slowest rank); ratios to {ref['config'] if ref else '-'}"
        )
        print(
            f"{'dtype/cpu_gemm':<20} {'engine':<9} {'paths':<16} {'tok/s':>9} {'x':>6} {'sync ms':>9} {'x':>6}"
        )
        for r in rows:
            if "skipped" in r:
                print(f"{r['config']:<20} skipped: {r['skipped']}")
                continue
            assert ref is not None
            paths = ",".join(f"{k}:{v}" for k, v in r["gemm_paths"].items())
            print(
                f"{r['config']:<20} {r['dtype']:<9} {paths:<16} {r['tokens_per_s']:>9.0f} "
                f"{r['tokens_per_s'] / ref['tokens_per_s']:>6.2f} {r['sync_check_s'] * 1e3:>9.1f} "
                f"{r['sync_check_s'] / ref['sync_check_s']:>6.2f}"
            )
        if a.json:
            write_json(
                a.json,
                "cpu_engine",
                figures(ran),
                world_size=env.world_size,
                configs=[
                    {k: v for k, v in r.items() if k in ("config", "dtype", "gemm_paths", "skipped")}
                    for r in rows
                ],
            )
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
