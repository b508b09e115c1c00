"""The LM head's forward + backward on N scored positions: plain (N x V logits) against fused and chunked.

    python benchmarks/fused_head.py [--tokens 4096] [--hidden 896] [--vocab 151936] [--chunk 512]

The head of policy_forward alone (spmdrl.models.head's two paths) on random float32 hidden states and a
random head weight of Qwen2.5-0.5B's shape: logprobs with a gradient, the entropy as a metric (the
default loss's pass, entropy_coeff=0), or with a gradient (``--entropy-grad``). Each variant runs in a
fresh process, so that its peak resident set (VmHWM) is its own; the peak is reported above the
process's resident set just before the head runs (inputs and weight allocated), with the time of one
forward + backward after one warm-up on a tenth of the positions. Prints the fused/plain ratios.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time


def _kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def _run_one(args: argparse.Namespace) -> dict[str, float]:
    import torch

    from spmdrl.algos.losses import entropy_from_logits, token_logprobs
    from spmdrl.models.fused_logprob import fused_head

    g = torch.Generator().manual_seed(0)
    w = torch.nn.Parameter(torch.randn(args.vocab, args.hidden, generator=g) * 0.02)
    h_full = torch.randn(args.tokens, args.hidden, generator=g)
    target = torch.randint(0, args.vocab, (args.tokens,), generator=g)

    def step(n: int) -> None:
        h = h_full[:n].clone().requires_grad_()
        if args.variant == "fused":
            out = fused_head(
                h, w, target[:n], chunk_tokens=args.chunk, with_entropy=True, entropy_grad=args.entropy_grad
            )
            lp, ent = out.logprobs_N, out.entropy_N
        else:
            z = torch.nn.functional.linear(h, w)[None]
            lp = token_logprobs(z, target[None, :n])[0]
            if args.entropy_grad:
                ent = entropy_from_logits(z)[0]
            else:
                with torch.no_grad():
                    ent = entropy_from_logits(z.detach())[0]
        loss = lp.sum() + (ent.sum() if args.entropy_grad else 0.0)
        loss.backward()
        w.grad = None

    step(max(1, args.tokens // 10))  # warm-up: kernels, allocator
    before = _kib("VmRSS")
    t0 = time.perf_counter()
    step(args.tokens)
    seconds = time.perf_counter() - t0
    return {"peak_gib": (_kib("VmHWM") - before) / 2**20, "seconds": seconds}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--hidden", type=int, default=896)
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--chunk", type=int, default=512)
    p.add_argument("--entropy-grad", action="store_true")
    p.add_argument("--variant", choices=("plain", "fused"), default="", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.variant:  # a child: one variant, its numbers as JSON
        print(json.dumps(_run_one(args)))
        return
    results = {}
    for variant in ("plain", "fused"):
        cmd = [sys.executable, __file__, *sys.argv[1:], "--variant", variant]
        out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
        results[variant] = json.loads(out.strip().splitlines()[-1])
    print(
        f"N={args.tokens} D={args.hidden} V={args.vocab} chunk={args.chunk} "
        f"entropy {'with' if args.entropy_grad else 'without'} gradient"
    )
    for variant, r in results.items():
        print(
            f"  {variant:6s} peak above start {r['peak_gib']:6.2f} GiB   forward+backward {r['seconds']:6.2f} s"
        )
    plain, fused = results["plain"], results["fused"]
    print(
        f"  fused/plain: memory {fused['peak_gib'] / plain['peak_gib']:.3f}x, time {fused['seconds'] / plain['seconds']:.2f}x"
    )


if __name__ == "__main__":
    main()
