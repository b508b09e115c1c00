"""The built-in tools: ``calculator`` (exact, safe arithmetic), ``python`` (runs code in a
limited child process) and ``draw_shape`` (returns a picture: an image observation for a
vision-language model, :mod:`spmdrl.tools.draw`). Load them by name
(``tools: [calculator, python]``) or by class in a tool YAML, where ``config`` sets their limits and ``tool_schema`` may rename or re-describe them::

    tools:
      - class_name: spmdrl.tools.builtin.PythonTool
        config: {type: native, timeout_s: 5, memory_mb: 512}
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from spmdrl.errors import ConfigError
from spmdrl.tools.arith import ArithLimits, ArithmeticRefused, evaluate, format_number
from spmdrl.tools.base import BaseTool, ToolError, ToolResult
from spmdrl.tools.draw import DrawShapeTool
from spmdrl.tools.pyexec import PythonLimits, run_python

# verl's config keys that say how a tool is loaded, not how it behaves.
_LOADER_KEYS = frozenset({"type"})


def limits_from_config(cls: type[Any], config: Mapping[str, Any], where: str) -> Any:
    """A ``cls`` dataclass from a tool's ``config`` mapping; unknown keys are ConfigErrors (typos)."""
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(config) - names - _LOADER_KEYS)
    if unknown:
        raise ConfigError(f"{where}: unknown config keys {unknown}; known: {', '.join(sorted(names))}")
    try:
        limits = cls(**{k: v for k, v in config.items() if k in names})
        check = getattr(limits, "check", None)
        if check is not None:
            check()
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{where}: {e}") from e
    return limits


class CalculatorTool(BaseTool):
    """Evaluates an arithmetic expression (see :mod:`spmdrl.tools.arith`); config: ArithLimits' fields."""

    default_schema = {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": "Evaluate an arithmetic expression with + - * / // % ** and parentheses. "
            "Integers are exact.",
            "parameters": {
                "type": "object",
                "properties": {
                    "expression": {"type": "string", "description": "The expression, e.g. (3 + 4) * 2**10"}
                },
                "required": ["expression"],
            },
        },
    }

    def __init__(self, config: Mapping[str, Any] | None = None, tool_schema: Any = None) -> None:
        super().__init__(config, tool_schema)
        self.limits: ArithLimits = limits_from_config(ArithLimits, self.config, f"tool {self.name!r}")

    def execute(self, instance_id: str, arguments: dict[str, Any]) -> ToolResult:
        try:
            return ToolResult(format_number(evaluate(arguments.get("expression", ""), self.limits)))
        except ArithmeticRefused as e:
            raise ToolError(str(e)) from None


class PythonTool(BaseTool):
    """Runs Python code in a fresh, limited child process (see :mod:`spmdrl.tools.pyexec`) and returns
    its output; config: PythonLimits' fields. Each call is a new interpreter: no state is kept
    between calls. Its metrics: ``timed_out``, ``failed`` (non-zero exit), ``wall_s``."""

    default_schema = {
        "type": "function",
        "function": {
            "name": "python",
            "description": "Run a Python 3 program and return what it prints (stdout, then stderr). "
            "Each call starts a fresh interpreter; use print() to see results.",
            "parameters": {
                "type": "object",
                "properties": {"code": {"type": "string", "description": "The program to run"}},
                "required": ["code"],
            },
        },
    }

    def __init__(self, config: Mapping[str, Any] | None = None, tool_schema: Any = None) -> None:
        super().__init__(config, tool_schema)
        self.limits: PythonLimits = limits_from_config(PythonLimits, self.config, f"tool {self.name!r}")

    def execute(self, instance_id: str, arguments: dict[str, Any]) -> ToolResult:
        code = arguments.get("code")
        if not isinstance(code, str):
            raise ToolError("the 'code' argument must be a string")
        run = run_python(code, self.limits)
        return ToolResult(
            text=run.text(),
            metrics={
                "timed_out": float(run.timed_out),
                "failed": float(run.returncode != 0),
                "wall_s": run.wall_s,
            },
        )


# Names usable wherever a tool spec is accepted (spmdrl.tools.registry.load_tools).
BUILTIN_TOOLS: dict[str, type[BaseTool]] = {
    "calculator": CalculatorTool,
    "python": PythonTool,
    "draw_shape": DrawShapeTool,
}
