"""Safe arithmetic for the calculator tool: Python's expression grammar, walked with ``ast``, never
``eval``.

Allowed: int and float literals, ``+ - * / // % **``, unary ``+ -`` and parentheses. Everything else
(names, calls, attributes, subscripts, comparisons, strings, ``^``) is refused before anything is
computed. Integers stay exact (``2**100``); ``/`` of two integers that divide evenly gives an
integer. The cost is bounded: the expression's length and nesting, exponents, and every
intermediate integer's number of digits are limited, so no input takes more than milliseconds.
"""

from __future__ import annotations

import ast
import math
import operator
from dataclasses import dataclass
from typing import Any


class ArithmeticRefused(ValueError):
    """The expression is not allowed or not computable; the message says why, for the model."""


@dataclass(frozen=True)
class ArithLimits:
    max_chars: int = 1000  # expression length
    # Nesting of operations; a sum of n terms nests n deep, and 1000 characters hold at most 500 terms.
    max_depth: int = 500
    max_exponent: int = 10_000  # |exponent| of any power
    max_digits: int = 1000  # decimal digits of any integer, intermediate results included


_BINOPS: dict[type[ast.operator], Any] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY: dict[type[ast.unaryop], Any] = {ast.UAdd: operator.pos, ast.USub: operator.neg}
# Symbols models write for the same operators.
_SYMBOLS = str.maketrans({"×": "*", "÷": "/", "−": "-", "·": "*"})


def evaluate(expression: str, limits: ArithLimits | None = None) -> int | float:
    """The value of ``expression``; raises :class:`ArithmeticRefused` with a reason otherwise."""
    limits = limits or ArithLimits()
    if not isinstance(expression, str):
        raise ArithmeticRefused(f"the expression must be a string, got {type(expression).__name__}")
    text = expression.translate(_SYMBOLS).strip()
    if not text:
        raise ArithmeticRefused("the expression is empty")
    if len(text) > limits.max_chars:
        raise ArithmeticRefused(f"the expression is longer than {limits.max_chars} characters")
    try:
        tree = ast.parse(text, mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError) as e:  # MemoryError: deep nesting
        raise ArithmeticRefused(
            f"not an arithmetic expression ({type(e).__name__}: {getattr(e, 'msg', e)})"
        ) from None
    return _Evaluator(limits).eval(tree.body, 0)


def format_number(value: int | float) -> str:
    """Integers in full; floats to 15 significant digits (so 0.1 + 0.2 reads 0.3)."""
    if isinstance(value, int):
        return str(value)
    return f"{value:.15g}"


class _Evaluator:
    def __init__(self, limits: ArithLimits) -> None:
        self.limits = limits
        self.int_bound = 10**limits.max_digits

    def eval(self, node: ast.AST, depth: int) -> int | float:
        if depth > self.limits.max_depth:
            raise ArithmeticRefused(f"the expression is nested deeper than {self.limits.max_depth} levels")
        if isinstance(node, ast.Constant):
            value = node.value
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise ArithmeticRefused(f"only numbers are allowed, not {type(value).__name__} {value!r}")
            return self.check(value)
        if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
            return self.check(_UNARY[type(node.op)](self.eval(node.operand, depth + 1)))
        if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
            left = self.eval(node.left, depth + 1)
            right = self.eval(node.right, depth + 1)
            return self.check(self.binop(node.op, left, right))
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitXor):
            raise ArithmeticRefused("'^' is not a power here; write ** (2**10)")
        raise ArithmeticRefused(f"{_describe(node)} is not allowed; only numbers and + - * / // % ** ( )")

    def binop(self, op: ast.operator, left: int | float, right: int | float) -> int | float:
        if isinstance(op, ast.Pow):
            self.check_power(left, right)
        if (
            isinstance(op, ast.Div)
            and isinstance(left, int)
            and isinstance(right, int)
            and right
            and left % right == 0
        ):
            return left // right  # exact: 10**30 / 5 stays an integer
        try:
            return _BINOPS[type(op)](left, right)
        except ZeroDivisionError:
            raise ArithmeticRefused("division by zero") from None
        except OverflowError:
            raise ArithmeticRefused("the result is too large for a float") from None

    def check_power(self, base: int | float, exponent: int | float) -> None:
        if abs(exponent) > self.limits.max_exponent:
            raise ArithmeticRefused(
                f"exponent {format_number(exponent)} is larger than {self.limits.max_exponent}"
            )
        if isinstance(base, int) and isinstance(exponent, int) and exponent > 0 and abs(base) > 1:
            digits = math.floor(exponent * math.log10(abs(base))) + 1  # log10 takes ints past float range
            if digits > self.limits.max_digits:
                raise ArithmeticRefused(
                    f"the result would have about {digits:.0f} digits, more than {self.limits.max_digits}"
                )

    def check(self, value: Any) -> int | float:
        if isinstance(value, complex):
            raise ArithmeticRefused(
                "the result is a complex number (a fractional power of a negative number)"
            )
        if isinstance(value, int):
            if abs(value) >= self.int_bound:
                raise ArithmeticRefused(
                    f"an intermediate result has more than {self.limits.max_digits} digits"
                )
        elif not math.isfinite(value):
            raise ArithmeticRefused("the result is not a finite number")
        return value


def _describe(node: ast.AST) -> str:
    if isinstance(node, ast.Name):
        return f"the name {node.id!r}"
    if isinstance(node, ast.Call):
        return "a function call"
    if isinstance(node, ast.Attribute):
        return f"attribute access (.{node.attr})"
    if isinstance(node, ast.BinOp | ast.UnaryOp):
        return f"the operator {type(node.op).__name__}"
    return f"{type(node).__name__.lower()} syntax"
