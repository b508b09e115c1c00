"""spmdrl's tools behind the agent loop's TurnEnv seam (spmdrl.rollout.turn_env.ToolTurnEnv): the real
calculator tool, executor and hermes parser; what a turn with calls, without calls and with a bad call
answers, and the counts each adds."""

from __future__ import annotations

from spmdrl.rollout.turn_env import ToolTurnEnv
from spmdrl.tools import ToolExecutor, get_parser, load_tools


def _env() -> ToolTurnEnv:
    return ToolTurnEnv(ToolExecutor(load_tools(["calculator"])), get_parser("hermes"))


def test_a_turn_with_calls_is_answered_by_the_tools() -> None:
    env = _env()
    session = env.open({"tools_kwargs": None, "other": 1})
    call = '<tool_call>{"name": "calculator", "arguments": {"expression": "6*7"}}</tool_call>'
    reply = env.reply(session, f"Let me compute. {call}")
    assert reply.end == ""
    assert [m["role"] for m in reply.messages] == ["tool"] and "42" in reply.messages[0]["content"]
    assert reply.counts["tool_calls"] == 1 and reply.counts["tool_errors"] == 0
    assert env.finish(session, []) == {}  # tools add nothing to the reward's extra_info


def test_a_turn_without_calls_ends_the_trajectory() -> None:
    env = _env()
    session = env.open({})
    reply = env.reply(session, "The answer is 42.")
    assert (reply.messages, reply.end) == ([], "stop")
    env.finish(session, [])


def test_a_call_that_does_not_parse_goes_back_as_an_error() -> None:
    env = _env()
    session = env.open({})
    reply = env.reply(session, "<tool_call>{not json}</tool_call>")
    assert reply.end == "" and reply.counts["parse_errors"] == 1 and reply.counts["tool_calls"] == 1
    assert reply.messages[0]["role"] == "tool"
    env.finish(session, [])
