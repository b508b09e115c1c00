"""The recipe's rollout path against the bare vLLM engine it wraps: same process, same engine, same work.

    torchrun --nproc_per_node=2 benchmarks/rollout_vs_engine.py
    torchrun --nproc_per_node=1 benchmarks/rollout_vs_engine.py --cases 8x4x128 --json rollout.json
    torchrun --nproc_per_node=1 benchmarks/rollout_vs_engine.py --model /path/to/hf/model      # a GPU

Every rank builds one engine (spmdrl.rollout.engine.build_engine, as the recipe does) and, for each case
``PxNxT`` (P prompts per rank, N samples each, up to T new tokens, temperature 1), times in alternating
order:

- ``spmdrl``: ``engine.generate(prompts, SamplingSpec(n=N, max_tokens=T, seed=s))``, exactly as
  ``rollout_and_score`` calls it: prompt gathering for tensor parallelism, RNG and settings isolation,
  one ``LLM.generate``, then each completion's token ids and sampled-token logprobs as Python lists;
- ``bare``: ``engine.llm.generate`` (the same ``vllm.LLM`` object) on the same token prompts with the
  same ``SamplingParams`` (n, max_tokens, temperature, the same per-request seeds, ``logprobs=0``,
  ``detokenize=False``), returning vLLM's ``RequestOutput`` objects.

With the same seeds both sample the same tokens (checked and printed), so the work is equal and the
difference is the wrapper's cost. Each figure is the median of ``--repeats`` after one warm-up round, the
slowest rank's. The ratio is spmdrl / bare (1.00: no overhead). Prompts are the tiny task's,
chat-templated; the model is the built-in tiny model unless ``--model``.
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from bench_report import Figure, fmt_ratio, write_json

from spmdrl.config import RolloutConfig
from spmdrl.distributed.env import init_distributed
from spmdrl.rollout.engine import Generation, RolloutEngine, SamplingSpec, build_engine


def _args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="", help="an HF model directory; default: the built-in tiny model")
    p.add_argument(
        "--cases",
        default="16x8x24,8x4x128",
        help="PxNxT per rank, comma-separated; default: grpo_tiny's rollout and benchmarks/grpo_step.py's",
    )
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--dtype", default="auto", help="rollout.dtype")
    p.add_argument("--cpu-gemm", default="auto", help="rollout.cpu_gemm (CPU)")
    p.add_argument("--json", default="", help="also write the figures to this JSON file")
    return p.parse_args()


@dataclass(frozen=True)
class Case:
    prompts: int
    n: int
    max_tokens: int

    @classmethod
    def parse(cls, s: str) -> Case:
        p, n, t = (int(x) for x in s.lower().split("x"))
        return cls(p, n, t)

    @property
    def name(self) -> str:
        return f"{self.prompts}x{self.n}x{self.max_tokens}"


@dataclass
class CaseResult:
    case: Case
    spmdrl_s: float
    bare_s: float
    tokens: float  # generated tokens per round, all ranks
    identical: bool  # both sides sampled the same tokens in every round, on every rank


def model_dir_for(a: argparse.Namespace) -> Path:
    if a.model:
        return Path(a.model)
    from spmdrl.models.tiny import default_cache_dir, ensure_tiny_model

    return ensure_tiny_model(default_cache_dir())


def tiny_prompts(model_dir: Path, count: int, offset: int) -> list[list[int]]:
    """``count`` of the tiny task's training prompts from ``offset`` on, chat-templated and tokenized."""
    from spmdrl.config_loader import load_config
    from spmdrl.data import tiny_task
    from spmdrl.data.prompts import encode, render_prompt
    from spmdrl.models.load import load_tokenizer

    tok = load_tokenizer(model_dir)
    train, _ = tiny_task.generate(load_config(["recipe=grpo_tiny"]).section(tiny_task.TinyTaskConfig))
    rows = train[offset : offset + count]
    return [encode(tok, render_prompt(tok, r["prompt"], where="tiny task")) for r in rows]


def bare_generate(engine: Any, prompts: list[list[int]], spec: SamplingSpec) -> list[Any]:
    """What a caller of vLLM itself writes for the same request: the same SamplingParams, per-request seeds."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from spmdrl.rollout.engine import request_seed

    assert spec.seed is not None
    params = [
        SamplingParams(
            n=spec.n,
            temperature=spec.temperature,
            top_p=spec.top_p,
            top_k=spec.top_k,
            max_tokens=spec.max_tokens,
            seed=request_seed(spec.seed, engine.groups.dp_index, i),
            logprobs=0,
            flat_logprobs=True,
            detokenize=False,
        )
        for i in range(len(prompts))
    ]
    return engine.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)


def _timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    """``fn()`` and its wall time on the slowest rank (barriers before and after)."""
    dist.barrier()
    t0 = time.perf_counter()
    out = fn()
    dist.barrier()
    return out, time.perf_counter() - t0


def _bare_tokens(outputs: list[Any], start: int, count: int) -> list[list[int]]:
    """Token ids of this rank's prompts' completions (a TP group generates for all its ranks' prompts)."""
    mine = outputs[start : start + count]
    return [list(c.token_ids) for out in mine for c in sorted(out.outputs, key=lambda c: c.index)]


def run_case(engine: RolloutEngine, case: Case, prompts: list[list[int]], repeats: int) -> CaseResult:
    gathered = engine.groups.gather_for_tp(prompts)  # type: ignore[attr-defined]
    ours_s, bare_s, tokens, identical = [], [], [], True
    for r in range(repeats + 1):
        spec = SamplingSpec(n=case.n, temperature=1.0, max_tokens=case.max_tokens, seed=1000 + r)
        run_ours = functools.partial(engine.generate, prompts, spec)
        run_bare = functools.partial(bare_generate, engine, gathered.prompts, spec)
        if r % 2 == 0:
            (gens, t_ours), (outs, t_bare) = _timed(run_ours), _timed(run_bare)
        else:
            (outs, t_bare), (gens, t_ours) = _timed(run_bare), _timed(run_ours)
        gens_list: list[Generation] = gens
        same = [g.token_ids for g in gens_list] == _bare_tokens(outs, gathered.start, len(prompts))
        flags = torch.tensor([sum(len(g.token_ids) for g in gens_list), float(not same)], dtype=torch.float64)
        dist.all_reduce(flags)
        identical = identical and flags[1].item() == 0
        if r > 0:  # round 0 warms up
            ours_s.append(t_ours)
            bare_s.append(t_bare)
            tokens.append(flags[0].item() / engine.groups.tp)  # type: ignore[attr-defined]
    return CaseResult(
        case, statistics.median(ours_s), statistics.median(bare_s), statistics.median(tokens), identical
    )


def figures(results: list[CaseResult]) -> list[Figure]:
    out = []
    for r in results:
        out.append(Figure(f"rollout_vs_engine/{r.case.name}/generate_s", r.spmdrl_s, "s", r.bare_s))
        out.append(
            Figure(
                f"rollout_vs_engine/{r.case.name}/tokens_per_s",
                r.tokens / r.spmdrl_s,
                "tokens/s",
                r.tokens / r.bare_s,
            )
        )
    return out


def print_table(results: list[CaseResult], world: int, device: str, engine: Any, repeats: int) -> None:
    print(
        f"\nrollout path vs bare vLLM: {world} rank(s) on {device}, engine {str(engine.dtype).removeprefix('torch.')}, "
        f"median of {repeats} alternating rounds (slowest rank)"
    )
    print(
        f"{'case (per rank)':<22} {'spmdrl ms':>10} {'bare ms':>10} {'spmdrl/bare':>12} {'overhead ms':>12} "
        f"{'tokens/s':>10} {'same tokens':>12}"
    )
    for r, f in zip(results, figures(results)[::2], strict=True):
        c = r.case
        label = f"{c.prompts} x {c.n}, <= {c.max_tokens} tok"
        print(
            f"{label:<22} {r.spmdrl_s * 1e3:>10.1f} {r.bare_s * 1e3:>10.1f} {fmt_ratio(f.ratio):>12} "
            f"{(r.spmdrl_s - r.bare_s) * 1e3:>12.1f} {r.tokens / r.spmdrl_s:>10.0f} {'yes' if r.identical else 'NO':>12}"
        )


def main() -> None:
    a = _args()
    env = init_distributed("auto")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    model_dir = model_dir_for(a)
    cases = [Case.parse(s) for s in a.cases.split(",")]
    most = max(c.prompts for c in cases)
    prompts = tiny_prompts(model_dir, most, offset=env.rank * most)
    max_len = max(len(p) for p in prompts) + max(c.max_tokens for c in cases) + 1
    cfg = RolloutConfig(
        tp=a.tp, cpu_kvcache_gib=1.0, max_num_seqs=256, dtype=a.dtype, cpu_gemm=a.cpu_gemm, seed=0
    )
    engine = build_engine(model_dir, cfg, max_model_len=max_len, device_type=env.device.type)
    results = []
    for c in cases:
        results.append(run_case(engine, c, prompts[: c.prompts], a.repeats))
        if env.is_main:
            r = results[-1]
            print(
                f"{c.name}: spmdrl {r.spmdrl_s * 1e3:.1f} ms, bare {r.bare_s * 1e3:.1f} ms, "
                f"same tokens: {'yes' if r.identical else 'NO'}",
                flush=True,
            )
    if env.is_main:
        print_table(results, env.world_size, env.device.type, engine, a.repeats)
        if a.json:
            write_json(
                a.json,
                "rollout_vs_engine",
                figures(results),
                world_size=env.world_size,
                device=env.device.type,
                tp=a.tp,
                engine_dtype=str(engine.dtype).removeprefix("torch."),
                model=a.model or "tiny",
                repeats=a.repeats,
                same_tokens={r.case.name: r.identical for r in results},
            )
    engine.close()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
