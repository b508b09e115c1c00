"""Multi-turn rollouts (spmdrl.rollout.agent_loop) on the real in-process vLLM engine, several gloo ranks.

The built-in tiny model is random, so it never writes a ``<tool_call>`` by itself. The tests use the
loop's pluggable parser instead (a real extension point: ``rollout.multi_turn.format`` takes a parser's
import path): the test parser turns a finished turn into a tool call, and stop strings end turns
early. Everything else is the real thing: vLLM's engine loop, the tool executor's threads and
timeouts, gloo broadcasts between the ranks of a TP group.
"""

from __future__ import annotations

import random
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from spmdrl.config import MultiTurnConfig
from spmdrl.data.turns import TurnCodec
from spmdrl.rl.batch import pack_generations
from spmdrl.rollout.engine import Generation, SamplingSpec
from spmdrl.testing.spawn import run_distributed

MAX_LEN = 256
VLLM_ENV = {"VLLM_LOGGING_LEVEL": "WARNING"}
STOPS = ["e", "a", "o", "i"]  # the random model's turns end within a few tokens


# ---------------------------------------------------------------------------------------- workers
class _Recorder:
    """Records what the loop asked of the engine and what it answered (delegates every call)."""

    def __init__(self, engine: Any) -> None:
        self.engine, self.groups = engine, engine.groups
        self.adds: list[tuple[str, list[int]]] = []
        self.outputs: dict[str, list[int]] = {}

    def stepper(self):  # noqa: ANN201
        import contextlib

        rec = self

        @contextlib.contextmanager
        def wrapped():  # noqa: ANN202
            with rec.engine.stepper() as st:

                class Proxy:
                    def add(self, rid, ids, params):  # noqa: ANN001, ANN202
                        rec.adds.append((rid, list(ids)))
                        st.add(rid, ids, params)

                    def step(self):  # noqa: ANN202
                        outs = st.step()
                        for o in outs:
                            rec.outputs[o.request_id] = list(o.token_ids)
                        return outs

                    def abort(self, ids):  # noqa: ANN001, ANN202
                        st.abort(ids)

                    def num_unfinished(self):  # noqa: ANN202
                        return st.num_unfinished()

                yield Proxy()

        return wrapped()


def _tools(seed: int, hang_after_s: float = 0.0) -> list[Any]:
    from spmdrl.tools.registry import FunctionTool
    from spmdrl.tools.schema import function_schema

    rng = random.Random(seed)

    def lookup(x: int, create_kwargs: dict | None = None) -> str:
        """Look a number up (sleeps a random while; hangs where the row says so).

        Args:
            x: a number
        """
        if (create_kwargs or {}).get("hang"):
            time.sleep(60)
        time.sleep(rng.random() * 0.2)
        return f"value {x * 7}"

    return [FunctionTool(lookup, function_schema(lookup, hidden=("create_kwargs",)))]


def _parser(always: bool):  # noqa: ANN202
    from spmdrl.tools import ParseResult, ToolCall

    def parse(text: str) -> ParseResult:
        return ParseResult(calls=[ToolCall("lookup", {"x": len(text)})] if always else [])

    return parse


def _agent(tokenizer: Any, tools: list[Any], always: bool, **mt: Any):  # noqa: ANN202
    from spmdrl.rollout.agent_loop import AgentLoop
    from spmdrl.rollout.turn_env import ToolTurnEnv
    from spmdrl.tools import ToolExecutor

    cfg = MultiTurnConfig(enable=True, tools=["lookup"], **mt)
    executor = ToolExecutor(
        tools, max_parallel_calls=cfg.max_parallel_calls, tool_timeout_s=cfg.tool_timeout_s
    )
    return AgentLoop(
        cfg,
        env=ToolTurnEnv(executor, _parser(always)),
        codec=TurnCodec(tokenizer),
        tokenizer=tokenizer,
        max_response_tokens=160,
        max_model_len=MAX_LEN,
    )


def _summary(gens: list[Generation]) -> list[tuple]:
    return [
        (g.prompt_index, g.token_ids, g.loss_mask, g.logprobs, g.finish_reason, g.trajectory.terminate_reason)
        for g in gens
        if g.trajectory is not None
    ]


def _spec(seed: int = 5) -> SamplingSpec:
    return SamplingSpec(n=2, temperature=1.0, max_tokens=160, seed=seed, stop=STOPS)


def _tp1_worker(rank: int, world: int, model_dir: str) -> dict:
    from transformers import AutoTokenizer

    from spmdrl.config import RolloutConfig
    from spmdrl.rollout.engine import build_engine

    tok = AutoTokenizer.from_pretrained(model_dir)
    engine = build_engine(
        Path(model_dir),
        # float32 and vLLM's plain torch GEMM: the parity check does not depend on the host's kernels.
        RolloutConfig(tp=1, cpu_kvcache_gib=0.25, seed=3, dtype="float32", cpu_gemm="torch"),
        max_model_len=MAX_LEN,
        device_type="cpu",
    )
    prompts = [[1, 10 + rank + i, 20, 30] for i in range(3)]
    out: dict = {}

    # Token identity, on the rank whose trajectories run 8 turns.
    rec = _Recorder(engine)
    agent = _agent(tok, _tools(rank), always=rank == 1, max_assistant_turns=8, max_user_turns=8)
    gens, _ = agent.run(rec, prompts, _spec())
    out["identity"] = (rec.adds, rec.outputs, _summary(gens), [list(p) for p in prompts])
    out["parity"] = _logprob_parity(model_dir, prompts, gens)

    # One rank done in 1 turn, the other needing 8, random tool delays, one trajectory whose tool hangs
    # (tool_timeout_s=1): the rollout still ends, the timeout is counted and the model reads an error.
    kwargs = [
        {"tools_kwargs": {"lookup": {"create_kwargs": {"hang": rank == 1 and i == 0}}}} for i in range(3)
    ]
    agent = _agent(
        tok, _tools(rank + 10), always=rank == 1, max_assistant_turns=8, max_user_turns=8, tool_timeout_s=1.0
    )
    t0 = time.monotonic()
    gens, stats = agent.run(engine, prompts, _spec(), kwargs)
    out["hang"] = (
        time.monotonic() - t0,
        _summary(gens),
        [g.trajectory.timeouts for g in gens],
        stats.engine_idle_s,
    )

    # The deadline: 0.6 s tools, 8 turns wanted, 2 s allowed.
    slow = _tools(rank)

    def slow_lookup(x: int) -> str:
        """Slow.

        Args:
            x: a number
        """
        time.sleep(0.6)
        return "late"

    from spmdrl.tools.registry import FunctionTool
    from spmdrl.tools.schema import function_schema

    slow = [FunctionTool(slow_lookup, function_schema(slow_lookup))]
    slow[0].schema["function"]["name"] = "lookup"
    agent = _agent(tok, slow, always=True, max_assistant_turns=8, max_user_turns=8, rollout_deadline_s=2.0)
    t0 = time.monotonic()
    gens, _ = agent.run(engine, prompts, _spec())
    out["deadline"] = (
        time.monotonic() - t0,
        [g.trajectory.terminate_reason for g in gens],
        [g.finish_reason for g in gens],
    )

    # Reproducibility under latency jitter, and the same trajectories from either scheduler.
    runs = []
    for seed, scheduler in ((1, "continuous"), (2, "continuous"), (3, "turn_barrier")):
        agent = _agent(tok, _tools(seed), always=True, max_assistant_turns=4, scheduler=scheduler)
        gens, _ = agent.run(engine, prompts, _spec(seed=11))
        runs.append(_summary(gens))
    out["jitter"] = runs
    engine.close()
    return out


def _logprob_parity(model_dir: str, prompts: list[list[int]], gens: list[Generation]) -> float:
    """The largest |trainer - engine| logprob over mask-1 positions (float32 on both sides)."""
    from transformers import AutoModelForCausalLM

    from spmdrl.models.forward import policy_logprobs

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    rows = pack_generations(prompts, gens, pad_id=0)
    with torch.no_grad():
        lp_BT, _ = policy_logprobs(model, rows.input_ids_BT, rows.attention_mask_BT, temperature=1.0)
    mask = rows.response_mask_BT
    return float((lp_BT - rows.engine_logprobs_BT).abs()[mask].max())


def _tp2_worker(rank: int, world: int, model_dir: str) -> dict:
    from transformers import AutoTokenizer

    from spmdrl.config import RolloutConfig
    from spmdrl.rollout.engine import build_engine

    tok = AutoTokenizer.from_pretrained(model_dir)
    engine = build_engine(
        Path(model_dir),
        RolloutConfig(tp=2, cpu_kvcache_gib=0.25, seed=3),
        max_model_len=MAX_LEN,
        device_type="cpu",
    )
    # Different prompt counts per rank; tools (random delays, different per rank) run on rank 0 only.
    prompts = [[1, 10 + rank + i, 20, 30] for i in range(2 + rank)]
    rec = _Recorder(engine)
    agent = _agent(tok, _tools(100 + rank), always=True, max_assistant_turns=5)
    gens, _ = agent.run(rec, prompts, _spec())
    engine.close()
    return {"adds": rec.adds, "outputs": rec.outputs, "mine": _summary(gens), "n_prompts": len(prompts)}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    from spmdrl.models.tiny import ensure_tiny_model

    return str(ensure_tiny_model(tmp_path_factory.mktemp("cache")))


# ------------------------------------------------------------------------------------------ tests
@pytest.mark.slow
@pytest.mark.cpu_kinds
def test_multi_turn_on_two_engines(model_dir: str) -> None:
    results = run_distributed(_tp1_worker, 2, model_dir, timeout_s=600, env=VLLM_ENV)

    # Token identity: every request's prompt is a prefix of its trajectory's final ids; each sampled
    # span equals what the engine returned; mask 1 exactly on the sampled tokens.
    adds, outputs, summary, prompts = results[1]["identity"]
    assert len(adds) > len(summary)  # several turns per trajectory
    finals = {}
    for (pi, ids, mask, lps, _, _), t in zip(summary, range(len(summary)), strict=True):
        full = prompts[pi] + ids
        finals[t] = (full, len(prompts[pi]), mask, lps)
    for rid, turn_prompt in adds:
        t = int(rid.split("-")[0][1:])
        full, plen, mask, lps = finals[t]
        assert full[: len(turn_prompt)] == turn_prompt
        sampled = outputs.get(rid)
        if sampled is not None:  # not aborted
            span = range(len(turn_prompt) - plen, len(turn_prompt) - plen + len(sampled))
            assert full[len(turn_prompt) : len(turn_prompt) + len(sampled)] == sampled
            assert all(mask[j] == 1 for j in span)
    for t, (_full, _plen, mask, lps) in finals.items():
        sampled_positions = sum(
            len(outputs[rid]) for rid, _ in adds if rid.startswith(f"t{t}-") and rid in outputs
        )
        assert sum(mask) == sampled_positions
        assert all(lp == 0.0 for lp, m in zip(lps, mask, strict=True) if m == 0)
        assert all(lp <= 0.0 for lp in lps)
    assert any(0 in s[2] for s in summary)  # observations were appended

    # Trainer and engine agree on the sampled tokens' logprobs (float32 both; kernels differ).
    assert results[1]["parity"] < 1e-3

    # A rank done after 1 turn, the other after 8, a hanging tool: the rollout ended within its bounds.
    for rank, turns in ((0, {"stop"}), (1, {"max_turns", "length", "tool_overflow"})):
        elapsed, summ, timeouts, _ = results[rank]["hang"]
        assert {s[5] for s in summ} <= turns
        assert elapsed < 40
    elapsed, summ, timeouts, idle = results[1]["hang"]
    assert timeouts[0] >= 1 and timeouts[1] >= 1  # the hanging row's two samples, counted
    assert sum(timeouts[2:]) == 0

    # The deadline aborts what is left, marked truncated.
    for rank in (0, 1):
        elapsed, reasons, finish = results[rank]["deadline"]
        assert elapsed < 2.0 + 1.5
        assert set(reasons) == {"deadline"}
        assert set(finish) == {"length"}

    # Different tool latencies, and either scheduler: the same trajectories.
    for rank in (0, 1):
        a, b, c = results[rank]["jitter"]
        assert [x[1] for x in a] == [x[1] for x in b] == [x[1] for x in c]
        assert [x[2] for x in a] == [x[2] for x in c]


@pytest.mark.slow
def test_multi_turn_tp2_ranks_schedule_identically(model_dir: str) -> None:
    r0, r1 = run_distributed(_tp2_worker, 2, model_dir, timeout_s=600, env=VLLM_ENV)
    # Both ranks of the engine made the same requests in the same order and got the same turns back.
    assert r0["adds"] == r1["adds"]
    assert r0["outputs"] == r1["outputs"]
    assert len(r0["mine"]) == 2 * 2 and len(r1["mine"]) == 3 * 2
    assert all(s[5] in ("max_turns", "length", "tool_overflow") for s in r0["mine"] + r1["mine"])
