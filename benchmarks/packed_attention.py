"""Packed micro-batches: the block-diagonal mask vs varlen attention (trainer.packed_attention).

    python benchmarks/packed_attention.py [--model DIR] [--rows 16] [--long] [--reps 5] [--json out.json]

One process, the actor's forward + backward (``policy_logprobs`` with entropy, the loss's pass) over one
packed micro-batch of GRPO-like rows (benchmarks/packing.py's batch), once with the model's SDPA and its
(R, 1, C, C) mask, once with varlen attention; on CPU varlen is the exact per-segment reference
(spmdrl/models/varlen.py). The two alternate within each repetition; the median of ``--reps`` is reported,
with the ratio.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from pathlib import Path

import torch
from bench_report import Figure, write_json
from packing import _batch


def _args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="", help="an HF model directory (default: the built-in tiny model)")
    p.add_argument("--rows", type=int, default=16)
    p.add_argument("--long", action="store_true", help="responses of 16-512 tokens instead of 2-24")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--json", default="", help="also write the figures to this file (bench_report.py)")
    return p.parse_args()


def _step(model: torch.nn.Module, ids: torch.Tensor, attn: torch.Tensor, lengths: list[int]) -> float:
    from spmdrl.models.forward import policy_logprobs

    t0 = time.perf_counter()
    lp, _ = policy_logprobs(
        model, ids, attn, with_entropy=True, entropy_grad=False, pack_sequences=True, lengths_B=lengths
    )
    (lp * attn).sum().backward()
    model.zero_grad(set_to_none=True)
    return time.perf_counter() - t0


def main() -> None:
    a = _args()
    from transformers import AutoModelForCausalLM

    from spmdrl.models.packing import pack
    from spmdrl.models.tiny import default_cache_dir, ensure_tiny_model
    from spmdrl.models.varlen import apply_packed_attention

    model_dir = Path(a.model) if a.model else ensure_tiny_model(default_cache_dir(""))
    mask = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa")
    mask.config.use_cache = False
    varlen = copy.deepcopy(mask)
    choice = apply_packed_attention(
        varlen, "varlen", packed=True, device=torch.device("cpu"), dtype=torch.float32
    )
    ids, attn = _batch(a.rows, a.long, mask.config.vocab_size)
    lengths = [int(n) for n in attn.sum(1)]
    p = pack(ids, attn, lengths_B=lengths)
    R, C = p.input_ids_RC.shape
    print(f"{a.rows} sequences packed into {R} rows of {C} tokens; varlen kernel: {choice.kernel}")
    times: dict[str, list[float]] = {"mask": [], "varlen": []}
    for rep in range(a.reps + 1):
        for name, model in (("mask", mask), ("varlen", varlen)):
            s = _step(model, ids, attn, lengths)
            if rep > 0:  # the first repetition warms up
                times[name].append(s)
    base = statistics.median(times["mask"])
    for name, ts in times.items():
        s = statistics.median(ts)
        print(f"{name:<8} {s:8.3f} s  {base / s:5.2f}x the mask path")
    if a.json:
        figure = Figure("packed_attention/varlen_step_s", statistics.median(times["varlen"]), "s", base)
        write_json(
            a.json, "packed_attention", [figure], device="cpu", rows=R, capacity=C, kernel=choice.kernel
        )


if __name__ == "__main__":
    main()
