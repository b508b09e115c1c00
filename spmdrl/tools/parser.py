"""Finding the tool calls in a model's turn: pluggable parsers, ``hermes`` by default.

The Hermes format is the one Qwen2.5 and Qwen3 chat templates teach (and verl's ``format: hermes``)::

    Let me compute that.
    <tool_call>
    {"name": "calculator", "arguments": {"expression": "3 * 7"}}
    </tool_call>

A turn may hold several calls. A parser never raises: what it cannot read (malformed JSON, a
missing name, arguments that are not an object, an unclosed tag) is reported in
:attr:`ParseResult.errors`, one message per bad call, and the rollout counts those as parse
errors; the well-formed calls of the same turn still run.

Another parser: a function ``parse(text: str) -> ParseResult`` (or an object with such a ``parse``
method), registered by name with :func:`register_parser` or named by import path
(``"my_pkg.my_mod:parse"``, ``"path/to/file.py:parse"``) wherever a parser name is accepted.

Why not vLLM's Hermes parser (``vllm.tool_parsers.hermes_tool_parser.Hermes2ProToolParser``, checked
against vLLM 0.32): it serves the OpenAI server, so it needs a tokenizer to be built and a chat request
per call, pulls in the server's imports, and gives OpenAI tool calls whose arguments are JSON text. Its
answers are not the ones the multi-turn loop needs. It is all or nothing: one malformed call in a turn,
or one without ``"arguments"``, and it reports no calls at all with the whole turn as content, where
here the turn's good calls run and each bad one is counted and answered with an error. A
``</tool_call>`` inside a JSON string (code that prints it) ends the call early, so that turn fails
too; a call cut off at the length limit after complete JSON is run as if closed; a stray
``</tool_call>``, an empty name, and arguments that are a list or a JSON-encoded string go through
unchecked; and the content is only the text before the first call.
"""

from __future__ import annotations

import json
import logging
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from spmdrl.errors import ConfigError
from spmdrl.tools.loading import load_object

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict[str, Any]


@dataclass
class ParseResult:
    calls: list[ToolCall] = field(default_factory=list)
    content: str = ""  # the turn's text with the tool calls taken out, stripped
    errors: list[str] = field(default_factory=list)  # one per call that could not be read


Parser = Callable[[str], ParseResult]

_OPEN, _CLOSE = "<tool_call>", "</tool_call>"
# A bad call is quoted in its error message up to this many characters.
_QUOTE_CHARS = 120
_DECODER = json.JSONDecoder()


def parse_hermes(text: str) -> ParseResult:
    """The ``<tool_call>{json}</tool_call>`` blocks of ``text``, in order."""
    result = ParseResult()
    content: list[str] = []
    pos = 0
    index = 0  # 1-based number of the call being read, for messages
    while True:
        start = text.find(_OPEN, pos)
        before = text[pos:] if start < 0 else text[pos:start]
        if _CLOSE in before:
            result.errors.append(f"a {_CLOSE} without a {_OPEN} before it")
            before = before.replace(_CLOSE, "")
        content.append(before)
        if start < 0:
            break
        index += 1
        call, error, pos = _read_call(text, start + len(_OPEN))
        if call is None:
            result.errors.append(f"tool call {index}: {error}")
        else:
            result.calls.append(call)
    result.content = "".join(content).strip()
    return result


def _read_call(text: str, body_start: int) -> tuple[ToolCall | None, str, int]:
    """(the call, or None and why not; where reading goes on) for the call whose body starts at
    ``body_start``. The JSON is decoded first and the closing tag looked for after it, so a
    ``</tool_call>`` inside a JSON string (code that prints it) does not end the call."""
    i = _skip_space(text, body_start)
    try:
        obj, end = _DECODER.raw_decode(text, i)
    except (ValueError, RecursionError) as e:  # JSONDecodeError is a ValueError
        close = text.find(_CLOSE, body_start)
        if close < 0:
            # Often a turn cut off by the length limit; the partial call is not part of the content.
            return None, f"{_OPEN} is never closed by {_CLOSE}", len(text)
        return (
            None,
            f"not valid JSON ({getattr(e, 'msg', e)}): {_quote(text[body_start:close])}",
            close + len(_CLOSE),
        )
    j = _skip_space(text, end)
    if text.startswith(_CLOSE, j):
        call, error = _decode_call(obj, text[body_start:j])
        return call, error, j + len(_CLOSE)
    close = text.find(_CLOSE, j)
    if close < 0:
        return None, f"{_OPEN} is never closed by {_CLOSE}", len(text)
    return None, f"text after the JSON object: {_quote(text[body_start:close])}", close + len(_CLOSE)


def _skip_space(text: str, i: int) -> int:
    while i < len(text) and text[i].isspace():
        i += 1
    return i


def _quote(body: str) -> str:
    body = body.strip()
    return repr(body if len(body) <= _QUOTE_CHARS else body[:_QUOTE_CHARS] + "...")


def _decode_call(obj: Any, body: str) -> tuple[ToolCall | None, str]:
    if not isinstance(obj, dict):
        return None, f'expected a JSON object {{"name": ..., "arguments": {{...}}}}, got {_quote(body)}'
    name = obj.get("name")
    if not isinstance(name, str) or not name.strip():
        return None, f'no "name" string: {_quote(body)}'
    # No "arguments" is a call without arguments (valid for a tool whose schema has no required ones).
    arguments = obj.get("arguments", {})
    if isinstance(arguments, str):
        # Models sometimes encode the arguments object as a JSON string; that string must hold an object.
        try:
            arguments = json.loads(arguments)
        except (ValueError, RecursionError):
            return None, f'"arguments" must be a JSON object, got a string: {_quote(body)}'
    if not isinstance(arguments, dict):
        return None, f'"arguments" must be a JSON object, got {type(arguments).__name__}: {_quote(body)}'
    return ToolCall(name=name.strip(), arguments=arguments), ""


PARSERS: dict[str, Parser] = {"hermes": parse_hermes}


def register_parser(name: str, parser: Parser) -> None:
    """Make ``parser`` available under ``name`` (replacing a parser of that name)."""
    if not callable(parser):
        raise TypeError(f"parser {name!r} must be callable, got {type(parser).__name__}")
    PARSERS[name] = parser


def get_parser(spec: str = "hermes") -> Parser:
    """A registered parser by name, or one loaded by import path; the result never raises."""
    spec = spec.strip()
    if spec in PARSERS:
        return _never_raises(PARSERS[spec], spec)
    if ":" not in spec:
        raise ConfigError(
            f"tool parser {spec!r} is neither a registered parser ({', '.join(sorted(PARSERS))}) nor an "
            "import path 'my_pkg.my_mod:parse' or 'path/to/file.py:parse'"
        )
    obj = load_object(spec, key="tool parser")
    fn = getattr(obj, "parse", obj)
    if not callable(fn):
        raise ConfigError(
            f"tool parser {spec!r} is a {type(obj).__name__}: neither callable nor with a parse()"
        )
    return _never_raises(fn, spec)


def parse(text: str, parser: str = "hermes") -> ParseResult:
    """Parse one model turn with the named parser (:func:`get_parser`)."""
    return get_parser(parser)(text)


def _never_raises(fn: Parser, name: str) -> Parser:
    if fn is parse_hermes:
        return fn

    def safe(text: str) -> ParseResult:
        try:
            result = fn(text)
        except Exception as e:  # a user parser's bug is this turn's parse error, not a crashed rollout
            log.warning("tool parser %s raised:\n%s", name, traceback.format_exc())
            return ParseResult(
                content=text.strip(), errors=[f"tool parser {name} raised {type(e).__name__}: {e}"]
            )
        if not isinstance(result, ParseResult):
            return ParseResult(
                content=text.strip(),
                errors=[f"tool parser {name} returned {type(result).__name__}, not a ParseResult"],
            )
        return result

    return safe
