"""spmdrl's tools behind the agent loop's TurnEnv seam (spmdrl.rollout.turn_env.ToolTurnEnv): the real
calculator tool, executor and hermes parser; what a turn with calls, without calls and with a bad call
answers, and the counts each adds; a tool's images, for a vision-language model and for a text model."""

from __future__ import annotations

import pytest
from PIL import Image

from spmdrl.errors import ConfigError
from spmdrl.rollout.rollout import check_image_tools
from spmdrl.rollout.turn_env import ToolImageError, ToolTurnEnv
from spmdrl.tools import ToolExecutor, ToolResult, get_parser, load_tools
from spmdrl.tools.registry import FunctionTool
from spmdrl.tools.schema import function_schema


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


def _picture_tool(with_image: bool) -> FunctionTool:
    def plot(x: int) -> ToolResult:
        """Plot a number.

        Args:
            x: a number
        """
        return ToolResult(f"plot of {x}", image=[Image.new("RGB", (8, 8), "red")] if with_image else [])

    return FunctionTool(plot, function_schema(plot))


def test_a_tools_images_reach_a_vision_model_and_stop_a_text_model() -> None:
    call = '<tool_call>{"name": "plot", "arguments": {"x": 3}}</tool_call>'
    vision = ToolTurnEnv(ToolExecutor([_picture_tool(True)]), get_parser("hermes"), images=True)
    (message,) = vision.reply(vision.open({}), call).messages
    assert [p["type"] for p in message["content"]] == ["image", "text"]
    assert message["content"][0]["image"].size == (8, 8) and message["content"][1]["text"] == "plot of 3"
    # A text model: the tool is named with the fix, never an image the model cannot see dropped silently.
    text = ToolTurnEnv(ToolExecutor([_picture_tool(True)]), get_parser("hermes"))
    with pytest.raises(ToolImageError, match="tool 'plot' returned 1 image") as e:
        text.reply(text.open({}), call)
    assert "vision-language model" in str(e.value) and "return text only" in str(e.value)
    # The same tool returning text only is fine for a text model.
    plain = ToolTurnEnv(ToolExecutor([_picture_tool(False)]), get_parser("hermes"))
    assert plain.reply(plain.open({}), call).messages == [{"role": "tool", "content": "plot of 3"}]
    # A tool that says it returns images (the built-in draw_shape) is refused at start for a text model.
    with pytest.raises(ConfigError, match="tool 'draw_shape' returns images, but model.path is a text model"):
        check_image_tools(load_tools(["draw_shape"]), processor=None)
    check_image_tools(load_tools(["draw_shape"]), processor=object())
