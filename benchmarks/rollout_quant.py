"""Low-precision rollout: the engine in fp8 (``rollout.quantization=fp8``) against the same engine in bf16,
same model, same requests, same process (one CUDA GPU).

    torchrun --nproc_per_node=1 benchmarks/rollout_quant.py --shape qwen2.5-1.5b --json rollout_quant.json
    torchrun --nproc_per_node=1 benchmarks/rollout_quant.py --model /path/to/hf/model

For each engine precision in turn (``--methods``, default ``none,fp8``; the engine closed before the next
is built), on a random Qwen2 of ``--shape`` (the tiny tokenizer's 512-token vocabulary, so the LM head is
small) or ``--model``:

- **the sync and its check**: the trainer's weights (FSDP2, bf16, as a CUDA job holds them) synced into
  the engine with the per-step check at the tolerance the job would use
  (spmdrl.rollout.quantization.check_tol); then one tensor doubled on its way into the engine, which the
  check must catch. Both verdicts are printed: a quantized engine's check that passed the doubled tensor
  would be useless, one that failed the clean sync would stop every run;
- **rollout speed**: ``--prompts`` prompts x ``--n`` samples of up to ``--max-tokens`` tokens at
  temperature 1 through the recipe's rollout call (engine.generate), the median of ``--repeats`` after a
  warm-up; generated tokens per second;
- **mismatch**: the trainer's logprobs of one round's sampled tokens against the engine's
  (``mismatch/logprob_abs_diff_mean``, ``kl_k3``: before correction), and the gap left after the rollout
  correction (``mismatch/corrected_*``) with TIS (token weights truncated at 2) and with masked IS
  (IcePop: weights outside [0.5, 2] dropped).

Prints fp8 / bf16 ratios; ``--json FILE`` writes them (benchmarks/bench_report.py: each fp8 figure with
the bf16 one as its baseline). Random weights give near-uniform distributions: the mismatch of a trained
checkpoint differs (larger where its distributions are peaked); the speed does not depend on them.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from bench_report import Figure, fmt_ratio, write_json

from spmdrl.algos.correction import rollout_correction
from spmdrl.algos.losses import token_logprobs
from spmdrl.config import RolloutConfig
from spmdrl.distributed.env import init_distributed
from spmdrl.distributed.placement import Placement
from spmdrl.models.build import ModelSpec, build_fsdp_model
from spmdrl.rl.batch import pack_generations
from spmdrl.rollout.engine import SamplingSpec, build_engine
from spmdrl.rollout.fingerprint import WeightSyncError
from spmdrl.rollout.mismatch import corrected_mismatch, logprob_mismatch
from spmdrl.rollout.quantization import check_tol
from spmdrl.rollout.weight_sync import SyncCheck, sync_weights

PROMPT_LEN = 32
# The tensor the corrupted sync doubles: an MLP matrix in the middle of the model.
CORRUPT = "mlp.down_proj.weight"


def _args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="qwen2.5-1.5b", help="benchmarks/shapes.py's name (a random model)")
    p.add_argument("--model", default="", help="an HF model directory instead of a random --shape")
    p.add_argument(
        "--methods", default="none,fp8", help="rollout.quantization values, the first the baseline"
    )
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--samples", type=int, default=4, help="samples per prompt")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.3)
    p.add_argument("--json", default="", help="also write the figures to this JSON file")
    p.add_argument(
        "--device", default="cuda", help="cuda; cpu for a dry run of the plumbing (bf16 engine only)"
    )
    return p.parse_args()


def _prompts(count: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [[1, *torch.randint(3, 500, (PROMPT_LEN - 1,), generator=g).tolist()] for _ in range(count)]


@torch.no_grad()
def _trainer_logprobs(
    model: torch.nn.Module, input_ids_BT: torch.Tensor, mask_BT: torch.Tensor
) -> torch.Tensor:
    out_BT = torch.zeros(input_ids_BT.shape, dtype=torch.float32, device=input_ids_BT.device)
    for i in range(0, input_ids_BT.shape[0], 16):  # a few rows at a time: the logits stay small
        ids, mask = input_ids_BT[i : i + 16], mask_BT[i : i + 16]
        logits = model(input_ids=ids, attention_mask=mask).logits
        out_BT[i : i + 16, 1:] = token_logprobs(logits[:, :-1].float(), ids[:, 1:])
    return out_BT


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _device_name(device: str) -> str:
    return torch.cuda.get_device_name() if device == "cuda" else "CPU"


def _sync_verdicts(model: torch.nn.Module, engine: Any, tol: float, corrupt: str) -> dict[str, str]:
    """The clean checked sync's verdict, then one with ``corrupt`` doubled on its way in."""
    out: dict[str, str] = {}
    try:
        stats = sync_weights(model, engine, check=SyncCheck(seed=1, tol=tol))
        out["clean"] = f"passed ({stats.checked_groups} groups, {stats.seconds * 1e3:.0f} ms)"
    except WeightSyncError as e:
        out["clean"] = "FAILED: " + str(e).splitlines()[1].strip()
    load = engine.load_weights
    engine.load_weights = lambda ws: load((n, t * 2 if n == corrupt else t) for n, t in ws)
    try:
        sync_weights(model, engine, check=SyncCheck(seed=2, tol=tol))
        out["corrupted"] = f"NOT CAUGHT ({corrupt} doubled)"
    except WeightSyncError as e:
        out["corrupted"] = "caught: " + str(e).splitlines()[1].strip()
    finally:
        engine.load_weights = load
    sync_weights(model, engine)  # leave it serving the trainer's weights
    return out


def _measure(a: argparse.Namespace, model_dir: Path, model: torch.nn.Module, method: str) -> dict[str, Any]:
    cfg = RolloutConfig(
        dtype="bfloat16",
        quantization=method,
        gpu_memory_utilization=a.gpu_memory_utilization,
        max_num_seqs=a.prompts * a.samples,
        free_cache_engine=False,
        seed=0,
    )
    engine = build_engine(model_dir, cfg, max_model_len=PROMPT_LEN + a.max_tokens, device_type=a.device)
    try:
        layers = [n for n, _ in model.named_parameters() if n.endswith(CORRUPT)]
        tol = check_tol(method, cfg.weight_sync_check_tol)
        out: dict[str, Any] = {
            "check_tol": tol,
            **_sync_verdicts(model, engine, tol, layers[len(layers) // 2]),
        }
        prompts = _prompts(a.prompts)
        spec = SamplingSpec(n=a.samples, temperature=1.0, max_tokens=a.max_tokens, seed=0)
        gens = engine.generate(prompts, spec)  # warm-up (and the mismatch's sample)
        times, tokens = [], 0
        for r in range(a.repeats):
            _sync(a.device)
            t0 = time.perf_counter()
            round_gens = engine.generate(
                prompts, SamplingSpec(n=a.samples, max_tokens=a.max_tokens, seed=1 + r)
            )
            _sync(a.device)
            times.append(time.perf_counter() - t0)
            tokens = sum(len(g.token_ids) for g in round_gens)
        out["generate_s"] = statistics.median(times)
        out["tokens_per_s"] = tokens / out["generate_s"]
        batch = pack_generations(prompts, gens, pad_id=0)
        device = torch.device(a.device)
        ids, attn = batch.input_ids_BT.to(device), batch.attention_mask_BT.to(device)
        trainer = _trainer_logprobs(model, ids, attn).cpu()
        model.reshard()
        engine_lp, mask = batch.engine_logprobs_BT, batch.response_mask_BT
        out["before"] = logprob_mismatch(trainer, engine_lp, mask)
        for name, kwargs in {
            "tis": dict(rollout_is="token", rollout_is_threshold=2.0),
            "icepop": dict(rollout_is="token", rollout_is_threshold="0.5_2.0"),
        }.items():
            corr = rollout_correction(trainer, engine_lp, mask, **kwargs)
            out[name] = corrected_mismatch(
                trainer, engine_lp, corr.mask_BT, corr.is_weights_BT, sequence_level=False
            )
        return out
    finally:
        engine.close()
        if a.device == "cuda":
            torch.cuda.empty_cache()


def main() -> None:
    a = _args()
    init_distributed()
    if dist.get_world_size() != 1 or (a.device == "cuda" and not torch.cuda.is_available()):
        raise SystemExit("rollout_quant.py runs on one CUDA GPU: torchrun --nproc_per_node=1")
    dtype = torch.bfloat16 if a.device == "cuda" else torch.float32  # the trainer's default there
    methods = a.methods.split(",")
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(a.model) if a.model else Path(tmp) / "model"
        if not a.model:
            from grpo_step import save_random_qwen2

            params = save_random_qwen2(model_dir, a.shape)
            print(f"random Qwen2 of {a.shape}'s shape: {params / 1e9:.2f}B parameters", flush=True)
        mesh = Placement.colocated(1).build_meshes(a.device).fsdp("actor")
        model = build_fsdp_model(
            ModelSpec(model_dir, dtype, torch.float32, train=False), mesh, torch.device(a.device)
        )
        results = {m: _measure(a, model_dir, model, m) for m in methods}
    base = methods[0]
    figures: list[Figure] = []
    print(f"\n{a.prompts} prompts x {a.samples} samples x <= {a.max_tokens} tokens, {_device_name(a.device)}")
    for m, r in results.items():
        b = results[base]
        ratio = r["tokens_per_s"] / b["tokens_per_s"]
        print(
            f"{m:>5}: {r['tokens_per_s']:9.0f} tokens/s ({fmt_ratio(ratio)}x {base}); sync check (tol {r['check_tol']:.0e}) "
            f"{r['clean']}; doubled tensor {r['corrupted']}\n"
            f"       mismatch before |d| {r['before']['logprob_abs_diff_mean']:.4f} kl_k3 {r['before']['kl_k3']:.2e}; "
            f"after TIS |d| {r['tis']['corrected_logprob_abs_diff_mean']:.4f} kl_k3 {r['tis']['corrected_kl_k3']:.2e}; "
            f"after IcePop |d| {r['icepop']['corrected_logprob_abs_diff_mean']:.4f}"
        )
        baseline = None if m == base else b
        figures += [
            Figure(f"{m}_tokens_per_s", r["tokens_per_s"], "tokens/s", baseline and baseline["tokens_per_s"]),
            Figure(
                f"{m}_mismatch_abs_diff",
                r["before"]["logprob_abs_diff_mean"],
                "nats",
                baseline and baseline["before"]["logprob_abs_diff_mean"],
            ),
            Figure(
                f"{m}_mismatch_kl_k3", r["before"]["kl_k3"], "nats", baseline and baseline["before"]["kl_k3"]
            ),
            Figure(f"{m}_corrected_tis_abs_diff", r["tis"]["corrected_logprob_abs_diff_mean"], "nats"),
            Figure(f"{m}_corrected_icepop_abs_diff", r["icepop"]["corrected_logprob_abs_diff_mean"], "nats"),
            Figure(f"{m}_check_clean_passed", float(r["clean"].startswith("passed")), "bool"),
            Figure(f"{m}_check_corrupted_caught", float(r["corrupted"].startswith("caught")), "bool"),
        ]
    if a.json:
        write_json(a.json, "rollout_quant", figures, shape=a.model or a.shape, device=_device_name(a.device))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
