"""The built-in tools (spmdrl/tools/builtin.py): the calculator's limits are configurable."""

from __future__ import annotations

import pytest

from spmdrl.tools import (
    ToolError,
)
from spmdrl.tools.arith import ArithLimits, ArithmeticRefused, evaluate
from spmdrl.tools.builtin import CalculatorTool


def test_calculator_limits_are_configurable() -> None:
    assert evaluate("2**20", ArithLimits(max_exponent=20)) == 2**20
    with pytest.raises(ArithmeticRefused, match="nested deeper than 3"):
        evaluate("1+1+1+1+1", ArithLimits(max_depth=3))
    tool = CalculatorTool({"type": "native", "max_digits": 3})
    assert tool.execute("i", {"expression": "999 + 0"}).text == "999"
    with pytest.raises(ToolError, match="more than 3 digits"):
        tool.execute("i", {"expression": "999 + 1"})
