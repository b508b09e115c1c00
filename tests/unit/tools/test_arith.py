"""The calculator's arithmetic (spmdrl/tools/arith.py): results, and refusals that come quickly."""

from __future__ import annotations

import time

import pytest

from spmdrl.tools.arith import ArithmeticRefused, evaluate, format_number

# ----------------------------------------------------------------------------------------- calculator


@pytest.mark.parametrize(
    "expression, expected",
    [
        ("1 + 2 * 3", "7"),
        ("(1 + 2) * 3", "9"),
        ("2**100", "1267650600228229401496703205376"),
        ("2**100 + 1 - 2**100", "1"),  # exact: no float rounding
        ("7 // 2", "3"),
        ("-7 // 2", "-4"),
        ("7 % 3", "1"),
        ("6 / 3", "2"),  # integers that divide evenly stay integers
        ("10**30 / 5", "200000000000000000000000000000"),
        ("7 / 2", "3.5"),
        ("0.1 + 0.2", "0.3"),
        ("2 ** -2", "0.25"),
        ("-(3 - 5)", "2"),
        ("+4", "4"),
        ("2 ** 0.5", "1.4142135623731"),
        ("1e3 * 2", "2000"),
        ("3 × 4 ÷ 2 − 1", "5"),  # the symbols models write
        ("1" + "+1" * 400, "401"),  # long sums nest deep
    ],
)
def test_calculator_arithmetic(expression: str, expected: str) -> None:
    assert format_number(evaluate(expression)) == expected


@pytest.mark.parametrize(
    "expression, reason",
    [
        ("__import__('os').system('true')", "a function call is not allowed"),
        ("(1, 2)", "tuple syntax is not allowed"),
        ("().__class__", "attribute access (.__class__)"),
        ("(1).__class__", "attribute access (.__class__)"),
        ("x + 1", "the name 'x'"),
        ("'a' * 3", "only numbers are allowed, not str"),
        ("True + 1", "only numbers are allowed, not bool"),
        ("1j * 2", "only numbers are allowed, not complex"),
        ("[1, 2][0]", "not allowed"),
        ("1 < 2", "compare syntax is not allowed"),
        ("lambda: 1", "not allowed"),
        ("2 ^ 3", "'^' is not a power here"),
        ("1 << 100", "the operator LShift"),
        ("1 / 0", "division by zero"),
        ("5 % 0", "division by zero"),
        ("0 ** -1", "division by zero"),
        ("9**9**9", "exponent 387420489 is larger than 10000"),
        ("2**10**10", "larger than 10000"),
        ("7**5000", "about 4226 digits"),
        ("(10**999) * (10**999)", "more than 1000 digits"),
        ("10.0 ** 400", "too large for a float"),
        ("1e308 * 10", "not a finite number"),
        ("(-8) ** (1/3)", "complex number"),
        ("", "empty"),
        ("1 +", "not an arithmetic expression"),
        ("(" * 300 + "1" + ")" * 300, "not an arithmetic expression"),
        ("1+" * 600 + "1", "longer than 1000 characters"),
    ],
)
def test_calculator_refuses_quickly(expression: str, reason: str) -> None:
    start = time.monotonic()
    with pytest.raises(ArithmeticRefused) as info:
        evaluate(expression)
    assert reason in str(info.value)
    assert time.monotonic() - start < 0.5
