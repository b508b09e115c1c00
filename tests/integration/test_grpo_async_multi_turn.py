"""Multi-turn rollouts under parallel.placement=async (recipes/grpo_async.py), real torchrun with 4 gloo
ranks: the agent loop's continuous scheduler and the tools run on the 2 rollout ranks as they do
colocated, its metrics are reduced over the rollout ranks only (the trainer ranks never enter them) and
reach rank 0's log with the rows; validation's multi-turn metrics too.

grpo_tools_tiny's task and tools (the calculator, and the python tool's child interpreters), on the random
tiny model without a warm-start. A random model never writes a ``<tool_call>`` by itself, so the run
uses the loop's pluggable parser (``rollout.multi_turn.format`` takes an import path; the agent-loop
tests do the same): every finished turn calls both tools, and stop strings end turns early. Everything
else is the real thing: vLLM, the tool executor's threads, the python tool's sandboxed processes.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from spmdrl.logging.metrics import read_metrics
from spmdrl.rollout.agent_loop import TERMINATE_REASONS
from spmdrl.testing.launch import torchrun
from spmdrl.testing.small_runs import SMALL_GRPO, cache_dir

pytestmark = pytest.mark.slow

# tests/integration/test_grpo_async.py's small settings (no warm-start, a gradient at every step).
COMMON = SMALL_GRPO

# configs/recipe/grpo_tools_tiny.yaml's data and multi-turn settings (fewer prompts), plus the python tool.
TOOLS = (
    "data.train_files=[tiny_tools:train]",
    "data.val_files=[tiny_tools:test]",
    "data.max_prompt_length=64",
    "data.max_response_length=128",
    "tools_task.num_train=256",
    "tools_task.num_test=8",
    "tools_task.min_digits=3",
    "tools_task.max_digits=4",
    "rollout.multi_turn.enable=true",
    "rollout.multi_turn.tools=[calculator,python]",
    "rollout.multi_turn.max_assistant_turns=3",
    "rollout.multi_turn.max_user_turns=2",
    "rollout.multi_turn.max_parallel_calls=4",
    "rollout.multi_turn.max_tool_response_length=32",
    "rollout.multi_turn.tool_timeout_s=30",
)

PARSER = '''
from spmdrl.tools import ParseResult, ToolCall


def parse(text):
    """Every turn calls both tools (a random model writes no tool call of its own)."""
    calls = [ToolCall("calculator", {"expression": "6*7"}), ToolCall("python", {"code": "print(6*7)"})]
    return ParseResult(calls=calls, content=text)
'''


@pytest.mark.guarantee("recipe:grpo_tools_tiny")
def test_agent_loop_on_the_rollout_ranks(tmp_path: Path) -> None:
    parser = tmp_path / "every_turn_calls.py"
    parser.write_text(PARSER)
    out = tmp_path / "async_tools"
    res = torchrun(
        [
            "-m", "spmdrl.train", "recipe=grpo_async_tiny", f"trainer.output_dir={out}", *COMMON, *TOOLS,
            # k = 1 (the recipe's): batch 2's trajectories run while update 1 does.
            "trainer.total_steps=2", "trainer.val_every=2",
            f"rollout.multi_turn.format={parser}:parse",
            "rollout.stop=[e,a,o,i]",  # the random model's turns end within a few tokens
            "reward.max_error_frac=1.0",
            "logging.samples_every=1", "logging.samples_per_log=16",
        ],
        nproc=4,
        cwd=tmp_path,
        timeout_s=600,
        env={"SPMDRL_CACHE": str(cache_dir())},
    )  # fmt: skip
    assert res.returncode == 0, res.output[-5000:]

    rows = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1, 2]
    for r in rows[1:]:
        # Measured by the agent loop on the rollout ranks, reduced there, carried to rank 0 with the rows.
        assert 1.0 < r["multi_turn/num_turns"] <= 3.0, r
        assert r["multi_turn/tool_calls"] >= 2.0, r  # two calls per tool turn, at least one tool turn each
        assert r["multi_turn/tool_error_rate"] == 0.0 and r["multi_turn/tool_parse_error_rate"] == 0.0
        assert r["multi_turn/tool_timeout_rate"] == 0.0
        assert r["multi_turn/tool_latency_p99_s"] > 0.0 and r["multi_turn/rollout_s"] > 0.0
        assert r["multi_turn/observation_tokens"] > 0.0
        reasons = sum(r[f"multi_turn/terminate_reason/{x}"] for x in TERMINATE_REASONS)
        assert reasons == pytest.approx(1.0)
        assert r["actor/grad_norm"] > 0
    assert rows[2]["async/policy_age_mean"] == 1  # batch 2's trajectories ran during update 1
    # Validation's trajectories on the rollout ranks, reduced over them (the trainer ranks take no part).
    for r in (rows[0], rows[2]):
        assert r["val/multi_turn/num_turns"] > 1.0 and r["val/multi_turn/tool_calls"] > 0.0, r

    # The tools' results came back into the trajectories the trainer ranks trained on.
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    train = [s for s in samples if s["split"] == "train"]
    assert len(train) == 32 and sum("\n42\n" in s["response"] for s in train) >= len(train) // 2
    # Validation's samples too: decoded on the rollout ranks, written by rank 0 (the first rollout rank's).
    val = [s for s in samples if s["split"] == "val"]
    assert val and 2 in {s["step"] for s in val} and {s["step"] for s in val} <= {0, 2}
