"""Multi-turn rollouts: the continuous scheduler against the per-turn barrier, same run, same work.

    torchrun --nproc_per_node=2 benchmarks/multi_turn.py
    torchrun --nproc_per_node=1 benchmarks/multi_turn.py --turns 3 --latency-ms 200 --json multi_turn.json
    torchrun --nproc_per_node=1 benchmarks/multi_turn.py --model /path/to/hf/model      # a GPU

Every rank builds one engine as the recipe does and runs :class:`spmdrl.rollout.agent_loop.AgentLoop`
on ``--prompts`` prompts x ``--n`` samples, alternating ``scheduler=continuous`` and
``scheduler=turn_barrier`` rounds. After each turn a trajectory calls a tool with probability
``turns / (turns + 1)`` (decided by a hash of the turn's text), at most ``--turns`` times, and each call
sleeps a log-normal time (median ``--latency-ms``, sigma ``--sigma``: a few slow calls, as real tools
have). Turns end at stop strings, so the random tiny model's turns are a few tokens long and the tools
dominate, as in agentic tasks; on a trained model with long turns the engine's share grows.

Both schedulers sample with the same per-request seeds, so they produce the same trajectories (checked
and printed: equal work); the ratio continuous / barrier is the time the barrier wastes (below 1:
continuous is faster). Medians of ``--repeats`` rounds after a warm-up, the slowest rank's.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import random
import statistics
import time
from typing import Any

import torch.distributed as dist
from bench_report import Figure, fmt_ratio, write_json
from rollout_vs_engine import model_dir_for

from spmdrl.config import MultiTurnConfig, RolloutConfig
from spmdrl.data.turns import TurnCodec
from spmdrl.distributed.env import init_distributed
from spmdrl.rollout.agent_loop import AgentLoop
from spmdrl.rollout.engine import SamplingSpec, build_engine
from spmdrl.tools import ParseResult, ToolCall, ToolExecutor
from spmdrl.tools.registry import FunctionTool
from spmdrl.tools.schema import function_schema

STOPS = ["e", "a", "o", "i", "."]


def _args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="", help="an HF model directory; default: the built-in tiny model")
    p.add_argument("--prompts", type=int, default=8, help="prompts per rank")
    p.add_argument("--n", type=int, default=4)
    p.add_argument("--turns", type=int, default=3, help="the most tool calls of one trajectory")
    p.add_argument("--latency-ms", type=float, default=100.0, help="median tool latency")
    p.add_argument("--sigma", type=float, default=1.0, help="log-normal sigma of the tool latency")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", default="", help="also write the figures to this JSON file")
    return p.parse_args()


def main() -> None:
    a = _args()
    env = init_distributed()
    device = "cuda" if env.device.type == "cuda" else "cpu"
    model_dir = model_dir_for(a)
    from spmdrl.models.load import load_tokenizer

    tok = load_tokenizer(model_dir)
    engine = build_engine(
        model_dir, RolloutConfig(cpu_kvcache_gib=0.5, seed=1), max_model_len=512, device_type=device
    )
    rng = random.Random(env.rank)
    median_s = a.latency_ms / 1000

    def lookup(x: int) -> str:
        """Look a number up.

        Args:
            x: a number
        """
        time.sleep(min(median_s * rng.lognormvariate(0.0, a.sigma), 20 * median_s))
        return f"value {x}"

    def parse(text: str) -> ParseResult:
        # Stateless, so both schedulers decide alike: a turn calls the tool unless its text hashes to
        # 0 mod (turns + 1); max_user_turns caps the calls at --turns.
        if int(hashlib.sha256(text.encode()).hexdigest(), 16) % (a.turns + 1) == 0:
            return ParseResult()
        return ParseResult(calls=[ToolCall("lookup", {"x": len(text)})])

    tool = FunctionTool(lookup, function_schema(lookup))
    prompts = [[1, 10 + (env.rank * a.prompts + i) % 200, 20, 30] for i in range(a.prompts)]
    spec = SamplingSpec(n=a.n, temperature=1.0, max_tokens=256, seed=7, stop=STOPS)
    times: dict[str, list[float]] = {"continuous": [], "turn_barrier": []}
    tokens: dict[str, list[list[int]]] = {}
    idle: dict[str, list[float]] = {"continuous": [], "turn_barrier": []}
    for r in range(a.repeats + 1):
        for scheduler in ("continuous", "turn_barrier"):
            cfg = MultiTurnConfig(
                enable=True,
                tools=["lookup"],
                scheduler=scheduler,
                max_assistant_turns=a.turns + 1,
                max_user_turns=a.turns,
            )
            agent = AgentLoop(
                cfg,
                executor=ToolExecutor([tool], max_parallel_calls=4, tool_timeout_s=60),
                codec=TurnCodec(tok),
                parser=parse,
                tokenizer=tok,
                max_response_tokens=384,
                max_model_len=512,
            )
            dist.barrier()
            t0 = time.perf_counter()
            gens, stats = agent.run(engine, prompts, spec)
            dist.barrier()
            if r > 0:
                times[scheduler].append(time.perf_counter() - t0)
                idle[scheduler].append(stats.engine_idle_s / max(stats.wall_s, 1e-9))
            tokens[scheduler] = [g.token_ids for g in gens]
    same = [tokens["continuous"] == tokens["turn_barrier"]]
    everyone: list[Any] = [None] * env.world_size
    dist.all_gather_object(everyone, same[0])
    cont, barrier = statistics.median(times["continuous"]), statistics.median(times["turn_barrier"])
    if env.rank == 0:
        figures = [
            Figure("multi_turn/rollout_s", cont, "s", barrier),
            Figure(
                "multi_turn/engine_idle_frac",
                statistics.median(idle["continuous"]),
                "",
                statistics.median(idle["turn_barrier"]),
            ),
        ]
        print(
            f"{env.world_size} rank(s), {a.prompts} prompts x {a.n} samples per rank, up to {a.turns} tool calls "
            f"each, tool latency median {a.latency_ms:g} ms (sigma {a.sigma:g}); same trajectories: {all(everyone)}"
        )
        print(f"{'':24} {'continuous':>11} {'turn_barrier':>13} {'ratio':>6}")
        for f in figures:
            print(f"{f.name:24} {f.value:11.3f} {f.baseline:13.3f} {fmt_ratio(f.ratio):>6}")
        if a.json:
            write_json(
                a.json,
                "multi_turn",
                figures,
                world_size=env.world_size,
                device=device,
                same_trajectories=all(everyone),
            )
    engine.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    main()
