"""Trainer tokens/s with padding vs packed sequences, fixed micro-batches vs a token budget.

    python benchmarks/packing.py [--model DIR] [--rows 64] [--json out.json]

One process, the actor's forward + backward (``policy_logprobs`` with entropy, the loss's pass) over a
GRPO-like batch: prompts of 40-60 tokens, responses of 2-24 (grpo_tiny's shape: short answers, many
cut off early) or ``--long`` (responses of 16-512, a reasoning run's spread). Variants alternate within
each repetition, so the ratios hold under a busy machine; the median of ``--reps`` is reported.
Tokens/s counts real tokens only, so padding shows up as a lower rate.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

VARIANTS = {
    # name: (micro_batch_size, micro_batch_tokens, pack_sequences)
    "padded, 16 sequences": (16, 0, False),
    "packed, 16 sequences": (16, 0, True),
    "padded, token budget": (16, -1, False),
    "packed, token budget": (16, -1, True),
}


def _args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="", help="an HF model directory (default: the built-in tiny model)")
    p.add_argument("--rows", type=int, default=64)
    p.add_argument("--long", action="store_true", help="responses of 16-512 tokens instead of 2-24")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--json", default="", help="also write one JSON object per figure to this file")
    return p.parse_args()


def _batch(rows: int, long: bool, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(40, 61, (rows,), generator=g)
    resp = (
        torch.randint(16, 513, (rows,), generator=g) if long else torch.randint(2, 25, (rows,), generator=g)
    )
    lengths = prompt + resp
    T = int(lengths.max())
    attn = (torch.arange(T) < lengths[:, None]).long()
    ids = torch.randint(3, vocab, (rows, T), generator=g) * attn
    return ids, attn


def _step(
    model: torch.nn.Module, ids: torch.Tensor, attn: torch.Tensor, variant: tuple[int, int, bool], budget: int
) -> float:
    from spmdrl.models.forward import policy_logprobs
    from spmdrl.rl.micro_batches import micro_batch_rows

    micro, tokens, pack = variant
    parts = micro_batch_rows(
        attn.sum(1), micro_batch_size=micro, token_budget=budget if tokens < 0 else tokens
    )
    t0 = time.perf_counter()
    for idx in parts:
        mb_attn = attn[idx]
        width = int(mb_attn.sum(1).max())
        lp, ent = policy_logprobs(
            model,
            ids[idx][:, :width],
            mb_attn[:, :width],
            with_entropy=True,
            entropy_grad=False,
            pack_sequences=pack,
        )
        (lp * mb_attn[:, :width]).sum().backward()
    model.zero_grad(set_to_none=True)
    return time.perf_counter() - t0


def main() -> None:
    a = _args()
    from transformers import AutoModelForCausalLM

    from spmdrl.models.tiny import default_cache_dir, ensure_tiny_model

    model_dir = Path(a.model) if a.model else ensure_tiny_model(default_cache_dir(""))
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.config.use_cache = False
    ids, attn = _batch(a.rows, a.long, model.config.vocab_size)
    real = int(attn.sum())
    # The budget: the tokens 16 average rows hold, so the token-budget variants run about as many
    # micro-batches as the fixed ones.
    budget = int(real / a.rows * 16)
    times: dict[str, list[float]] = {k: [] for k in VARIANTS}
    for rep in range(a.reps + 1):
        for name, v in VARIANTS.items():
            s = _step(model, ids, attn, v, budget)
            if rep > 0:  # the first repetition warms up
                times[name].append(s)
    base = statistics.median(times["padded, 16 sequences"])
    padded_tokens = a.rows * ids.shape[1]
    print(
        f"{a.rows} rows, {real} real tokens ({real / padded_tokens:.0%} of the padded batch), budget {budget} tokens"
    )
    print(f"{'variant':<24} {'s':>8} {'tokens/s':>10} {'x padded':>9}")
    out = []
    for name in VARIANTS:
        s = statistics.median(times[name])
        print(f"{name:<24} {s:8.3f} {real / s:10.0f} {base / s:9.2f}")
        out.append({"name": f"train_tokens_per_s[{name}]", "value": real / s, "unit": "tokens/s",
                    "baseline": real / base, "ratio": base / s})  # fmt: skip
    if a.json:
        Path(a.json).write_text("\n".join(json.dumps(o) for o in out) + "\n")


if __name__ == "__main__":
    main()
