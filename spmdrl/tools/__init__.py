"""Tools for multi-turn rollouts: parsing the model's calls, loading tools, running the calls.

- :mod:`spmdrl.tools.parser`: ``<tool_call>`` blocks -> :class:`ToolCall` (``hermes``; pluggable).
- :mod:`spmdrl.tools.base`: the :class:`Tool` protocol (verl's shape, synchronous), :class:`BaseTool`.
- :mod:`spmdrl.tools.registry`: tools from built-in names, verl tool YAML files and Python functions.
- :mod:`spmdrl.tools.builtin`: ``calculator``, ``python`` and ``draw_shape`` (:mod:`spmdrl.tools.draw`).
- :mod:`spmdrl.tools.executor`: a batch of calls, bounded in parallelism and time; never raises.

See docs/tools.md.
"""

from spmdrl.tools.base import BaseTool, Tool, ToolError, ToolResult
from spmdrl.tools.executor import (
    ToolCallOutcome,
    ToolExecutor,
    ToolSession,
    summarize,
    truncate_text,
    truncate_tokens,
)
from spmdrl.tools.parser import ParseResult, ToolCall, get_parser, parse, register_parser
from spmdrl.tools.registry import FunctionTool, load_function_tool, load_tools, load_tools_yaml, tool_schemas

__all__ = [
    "BaseTool",
    "FunctionTool",
    "ParseResult",
    "Tool",
    "ToolCall",
    "ToolCallOutcome",
    "ToolError",
    "ToolExecutor",
    "ToolResult",
    "ToolSession",
    "get_parser",
    "load_function_tool",
    "load_tools",
    "load_tools_yaml",
    "parse",
    "register_parser",
    "summarize",
    "tool_schemas",
    "truncate_text",
    "truncate_tokens",
]
