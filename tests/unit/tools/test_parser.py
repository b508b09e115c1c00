"""The tool-call parser (spmdrl/tools/parser.py): calls among text, malformed and unclosed calls, stray
tags, garbage, and registering parsers of one's own."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

from spmdrl.errors import ConfigError
from spmdrl.tools import (
    ParseResult,
    ToolCall,
    get_parser,
    parse,
    register_parser,
)
from spmdrl.tools.parser import PARSERS


def call(name: str, **arguments: object) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


# --------------------------------------------------------------------------------------------- parser


def test_parse_single_call_with_text_around() -> None:
    r = parse(f"Let me compute.\n{call('calculator', expression='3*7')}\nDone.")
    assert r.calls == [ToolCall("calculator", {"expression": "3*7"})]
    assert r.content == "Let me compute.\n\nDone."
    assert r.errors == []


def test_parse_several_calls_in_order() -> None:
    r = parse(call("a", x=1) + "\n" + call("b") + call("a", x=2, nested={"k": [1, 2]}))
    assert [c.name for c in r.calls] == ["a", "b", "a"]
    assert r.calls[1].arguments == {}
    assert r.calls[2].arguments == {"x": 2, "nested": {"k": [1, 2]}}
    assert r.content == ""


def test_parse_no_calls_is_all_content() -> None:
    assert parse("  The answer is 4.  ") == ParseResult(calls=[], content="The answer is 4.", errors=[])


@pytest.mark.parametrize(
    "body, message",
    [
        ('{"name": "a", "arguments": {"x": 1}', "not valid JSON"),
        ("{'name': 'a'}", "not valid JSON"),
        ('{"arguments": {}}', 'no "name"'),
        ('{"name": "", "arguments": {}}', 'no "name"'),
        ('{"name": 3}', 'no "name"'),
        ('{"name": "a", "arguments": [1, 2]}', '"arguments" must be a JSON object, got list'),
        ('{"name": "a", "arguments": "x=1"}', '"arguments" must be a JSON object, got a string'),
        ('["a", {}]', "expected a JSON object"),
    ],
)
def test_parse_malformed_call_is_an_error_and_others_still_parse(body: str, message: str) -> None:
    r = parse(f"x <tool_call>{body}</tool_call> {call('ok', v=1)}")
    assert r.calls == [ToolCall("ok", {"v": 1})]
    assert len(r.errors) == 1 and r.errors[0].startswith("tool call 1: ") and message in r.errors[0], r.errors
    assert r.content == "x"


def test_parse_closing_tag_inside_a_json_string() -> None:
    code = "print('</tool_call>')"
    r = parse(call("python", code=code) + " after")
    assert r.calls == [ToolCall("python", {"code": code})] and not r.errors and r.content == "after"
    r = parse('<tool_call>{"name": "a"} extra</tool_call>' + call("b"))
    assert r.calls == [ToolCall("b", {})] and r.errors == [
        'tool call 1: text after the JSON object: \'{"name": "a"} extra\''
    ]


def test_parse_arguments_encoded_as_a_json_string_are_accepted() -> None:
    r = parse('<tool_call>{"name": "a", "arguments": "{\\"x\\": 1}"}</tool_call>')
    assert r.calls == [ToolCall("a", {"x": 1})] and not r.errors


def test_parse_unclosed_and_stray_tags() -> None:
    r = parse(f'{call("a")} then <tool_call>\n{{"name": "b", "argu')  # cut off by the length limit
    assert r.calls == [ToolCall("a", {})]
    assert r.errors == ["tool call 2: <tool_call> is never closed by </tool_call>"]
    assert r.content == "then"
    r = parse("oops </tool_call> " + call("a"))
    assert r.calls == [ToolCall("a", {})] and r.errors == ["a </tool_call> without a <tool_call> before it"]


def test_parse_never_raises_on_garbage() -> None:
    for text in ["", "<tool_call>", "</tool_call>" * 3, "<tool_call>" * 3 + "</tool_call>", "[" * 100_000]:
        assert isinstance(parse(text), ParseResult)
    deep = "<tool_call>" + "[" * 100_000 + "]" * 100_000 + "</tool_call>"
    assert parse(deep).errors and not parse(deep).calls


def test_register_and_load_parsers(tmp_path: Path) -> None:
    def upper(text: str) -> ParseResult:
        return ParseResult(calls=[ToolCall(text.upper(), {})])

    register_parser("test_upper", upper)
    try:
        assert parse("x", parser="test_upper").calls == [ToolCall("X", {})]
    finally:
        del PARSERS["test_upper"]
    path = tmp_path / "my_parser.py"
    path.write_text(
        textwrap.dedent(
            """
            from spmdrl.tools.parser import ParseResult, ToolCall

            def parse(text):
                if text == "boom":
                    raise RuntimeError("bad parser")
                if text == "wrong":
                    return "not a ParseResult"
                return ParseResult(calls=[ToolCall("echo", {"text": text})])
            """
        )
    )
    p = get_parser(f"{path}:parse")
    assert p("hi").calls == [ToolCall("echo", {"text": "hi"})]
    assert "raised RuntimeError: bad parser" in p("boom").errors[0]  # a user parser's bug never raises
    assert "not a ParseResult" in p("wrong").errors[0]
    with pytest.raises(ConfigError, match="neither a registered parser"):
        get_parser("llama3_json")
    with pytest.raises(ConfigError, match="no module named"):
        get_parser("no_such_module_xyz:parse")
