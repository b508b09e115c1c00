"""The two ways a reward function can be called: spmdrl's signature and verl's, told apart once, from the
function's signature, when the function loads (not at the first sample, after the engine is built).

- spmdrl's: ``score(response, ground_truth, *, data_source, extra_info)``;
- verl's ``compute_score(data_source, solution_str, ground_truth, extra_info=None)``, which verl's reward
  managers call by keyword, so its parameter names are what counts (the order does not).

A function with a parameter named ``solution_str`` is verl's, whatever its order: spmdrl's positional call
would bind ``compute_score(ground_truth, solution_str, ...)`` too, to the wrong arguments. Any other function
that takes spmdrl's call (``def score(*args, **kwargs)`` as well) is spmdrl's.
"""

from __future__ import annotations

import enum
import inspect
from collections.abc import Callable
from typing import Any

SPMDRL_SIGNATURE = "score(response, ground_truth, *, data_source, extra_info)"
VERL_SIGNATURE = "compute_score(data_source, solution_str, ground_truth, extra_info=None)"
_VERL_KWARGS = ("data_source", "solution_str", "ground_truth", "extra_info")


class CallStyle(enum.Enum):
    SPMDRL = "spmdrl"
    VERL = "verl"


def call_style(fn: Callable[..., Any]) -> CallStyle:
    """How ``fn`` is called; raises TypeError, naming both signatures, if it takes neither."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return CallStyle.SPMDRL  # a builtin without a signature: it will tell when called
    verl_problem = _bind_problem(signature, (), dict.fromkeys(_VERL_KWARGS))
    if verl_problem is None and "solution_str" in signature.parameters:
        return CallStyle.VERL
    spmdrl_problem = _bind_problem(
        signature, ("response", "ground_truth"), {"data_source": "", "extra_info": {}}
    )
    if spmdrl_problem is None:
        return CallStyle.SPMDRL
    if verl_problem is None:
        return CallStyle.VERL
    raise TypeError(
        f"does not take the arguments of a reward function, neither spmdrl's, {SPMDRL_SIGNATURE} "
        f"({spmdrl_problem}), nor verl's, {VERL_SIGNATURE} ({verl_problem})"
    )


def _bind_problem(signature: inspect.Signature, args: tuple[str, ...], kwargs: dict[str, Any]) -> str | None:
    try:
        signature.bind(*args, **kwargs)
    except TypeError as e:
        return str(e)
    return None


def call(
    fn: Callable[..., Any],
    style: CallStyle,
    response: str,
    ground_truth: str,
    data_source: str,
    extra_info: dict[str, Any],
) -> Any:
    """``fn`` called on one sample the way ``style`` says."""
    if style is CallStyle.VERL:
        return fn(
            data_source=data_source, solution_str=response, ground_truth=ground_truth, extra_info=extra_info
        )
    return fn(response, ground_truth, data_source=data_source, extra_info=extra_info)
