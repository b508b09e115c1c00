"""The tool executor (spmdrl/tools/executor.py): bounded parallelism, timeouts, errors counted and never
raised, truncation."""

from __future__ import annotations

import json
import threading
import time

import pytest

from spmdrl.tools import (
    ToolCall,
    ToolCallOutcome,
    ToolExecutor,
    ToolResult,
    load_tools,
    parse,
    summarize,
    truncate_text,
    truncate_tokens,
)


def call(name: str, **arguments: object) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


# ------------------------------------------------------------------------------------------- executor


class Sleeper:
    """A synchronous tool without BaseTool: records how many of its calls overlap."""

    schema = {
        "type": "function",
        "function": {
            "name": "sleep",
            "parameters": {"type": "object", "properties": {"s": {"type": "number"}}, "required": ["s"]},
        },
    }

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.active = self.peak = 0
        self.created: list[dict] = []
        self.released: list[str] = []

    def create(self, instance_id: str, **kwargs: object) -> str:
        self.created.append(dict(kwargs))
        return instance_id

    def execute(self, instance_id: str, arguments: dict) -> str:
        with self.lock:
            self.active += 1
            self.peak = max(self.peak, self.active)
        try:
            if arguments.get("raise"):
                raise KeyError("boom")
            time.sleep(arguments["s"])
            return f"slept {arguments['s']}"
        finally:
            with self.lock:
                self.active -= 1

    def release(self, instance_id: str) -> None:
        self.released.append(instance_id)


def test_executor_bounds_parallelism() -> None:
    tool = Sleeper()
    ex = ToolExecutor([tool], max_parallel_calls=2, tool_timeout_s=5)
    start = time.monotonic()
    out = ex.run([ToolCall("sleep", {"s": 0.3})] * 4)
    elapsed = time.monotonic() - start
    assert [o.status for o in out] == ["ok"] * 4 and all(o.text == "slept 0.3" for o in out)
    assert tool.peak == 2
    assert 0.58 <= elapsed < 1.15, elapsed  # two rounds of two; one at a time would take 1.2 s
    assert all(0.29 <= o.latency_s < 0.8 for o in out)
    assert len(tool.released) == 4 and tool.created == [{"create_kwargs": {}}] * 4


def test_executor_timeout_frees_the_slot_and_is_counted() -> None:
    tool = Sleeper()
    ex = ToolExecutor([tool], max_parallel_calls=1, tool_timeout_s=0.3)
    start = time.monotonic()
    out = ex.run([ToolCall("sleep", {"s": 2}), ToolCall("sleep", {"s": 0.05})])
    assert time.monotonic() - start < 0.9
    assert out[0].status == "timeout" and out[0].text == "Error: tool 'sleep' timed out after 0.3 s"
    assert out[0].latency_s == 0.3
    assert out[1].status == "ok"
    assert ex.abandoned_threads == 1  # the first call's thread sleeps on
    stats = summarize(out)
    assert stats["tools/timeout"] == 1 and stats["tools/ok"] == 1 and stats["tools/calls"] == 2


def test_executor_counts_errors_and_never_raises() -> None:
    class BadTool:
        schema = {
            "type": "function",
            "function": {"name": "bad", "parameters": {"type": "object", "properties": {}}},
        }

        def create(self, instance_id: str, **kwargs: object) -> None:
            if kwargs["create_kwargs"].get("fail_create"):
                raise RuntimeError("create failed")

        def execute(self, instance_id: str, arguments: dict) -> object:
            if arguments.get("exit"):
                raise SystemExit(2)
            if arguments.get("nan"):
                return ToolResult("x", reward=float("nan"))
            return 42  # not a tool result

        def release(self, instance_id: str) -> None:
            raise OSError("release failed")  # logged; the result stands

    tool = Sleeper()
    ex = ToolExecutor([tool, BadTool()], max_parallel_calls=3, tool_timeout_s=2)
    parsed = parse(call("sleep", s=0, **{"raise": True}) + call("bad") + "<tool_call>{</tool_call>")
    out = ex.run(
        parsed.calls + [ToolCall("bad", {"exit": True}), ToolCall("bad", {"nan": True}), ToolCall("bad", {})],
        [None, None, None, None, {"bad": {"create_kwargs": {"fail_create": True}}}],
    )
    out += [ToolCallOutcome.parse_error(e) for e in parsed.errors]
    assert [o.status for o in out] == ["error"] * 5 + ["parse_error"]
    assert out[0].text == "Error: tool 'sleep' raised KeyError: 'boom'"
    assert out[1].text.startswith("Error: tool 'bad' raised TypeError: a tool returned int")
    assert out[2].text == "Error: tool 'bad' raised SystemExit: 2"
    assert "expected a finite number" in out[3].text
    assert out[4].text == "Error: tool 'bad' raised RuntimeError: create failed"
    assert out[5].text.startswith("Error: tool call 3: not valid JSON")
    assert out[5].message() == {"role": "tool", "content": out[5].text}
    stats = summarize(out)
    assert (stats["tools/calls"], stats["tools/error"], stats["tools/parse_error"], stats["tools/ok"]) == (
        6,
        5,
        1,
        0,
    )
    assert ex.run([]) == []


def test_executor_runs_python_calls_in_parallel() -> None:
    ex = ToolExecutor(load_tools(["python"]), max_parallel_calls=4, tool_timeout_s=10)
    start = time.monotonic()
    out = ex.run(
        [ToolCall("python", {"code": f"import time; time.sleep(0.4); print({i})"}) for i in range(4)]
    )
    assert [o.text for o in out] == ["0", "1", "2", "3"]
    assert time.monotonic() - start < 1.5  # not 4 x 0.4 s one after another
    stats = summarize(out)
    assert stats["tools/python/timed_out"] == 0 and stats["tools/python/wall_s"] >= 0.4


@pytest.mark.parametrize(
    "side, marker, expected",
    [
        ("left", [], [0, 1, 2, 3, 4, 5]),
        ("right", [], [4, 5, 6, 7, 8, 9]),
        ("middle", [], [0, 1, 2, 7, 8, 9]),
        ("left", [-1], [0, 1, 2, 3, 4, -1]),
        ("right", [-1], [-1, 5, 6, 7, 8, 9]),
        ("middle", [-1, -2], [0, 1, -1, -2, 8, 9]),
        ("middle", [-1], [0, 1, 2, -1, 8, 9]),
        ("middle", [-1] * 6, [0, 1, 2, 7, 8, 9]),  # no room for the marker
    ],
)
def test_truncate_tokens(side: str, marker: list[int], expected: list[int]) -> None:
    assert truncate_tokens(list(range(10)), 6, side, marker) == expected  # type: ignore[arg-type]


def test_truncate_edges() -> None:
    assert truncate_tokens([1, 2, 3], 3, "middle", [9]) == [1, 2, 3]
    assert truncate_tokens([1, 2, 3], 0) == []
    assert truncate_tokens(range(5), 1, "middle") == [0]
    with pytest.raises(ValueError, match="side"):
        truncate_tokens([1], 0, "top")  # type: ignore[arg-type]
    assert truncate_text("abcdefgh", 4, "left") == "abcd...(truncated)"
    assert truncate_text("abcdefgh", 4, "right") == "(truncated)...efgh"
    assert truncate_text("abcdefgh", 4, "middle") == "ab...(truncated)...gh"
    assert truncate_text("abc", 4) == "abc"


def test_executor_rejects_bad_settings() -> None:
    with pytest.raises(ValueError, match="max_parallel_calls"):
        ToolExecutor([], max_parallel_calls=0)
    with pytest.raises(ValueError, match="tool_timeout_s"):
        ToolExecutor([], tool_timeout_s=0)
    with pytest.raises(TypeError, match="it has no create, execute, release method"):
        ToolExecutor([object()])
