"""Reward functions by name: the built-in rules, per-data-source dispatch, and user functions.

A reward function has this signature (the one users write)::

    def score(response: str, ground_truth: str, *, data_source: str, extra_info: dict) -> float:
        ...

or verl's, ``compute_score(data_source, solution_str, ground_truth, extra_info=None)``: which one is
told from the signature when the function loads (spmdrl.rewards.signature). It returns a float, or a dict
with a float ``"score"`` key plus extra keys, whose numeric ones are logged as ``reward/extra/<key>``
(say ``{"score": 1.0, "format_ok": 1.0}``). :func:`load_reward_fn` turns the ``reward.fn`` config
string into such a function:

- a registered name: the built-in rules ``"gsm8k"``, ``"tiny"``, ``"tiny_tools"``, ``"last_number"``
  (:mod:`spmdrl.rewards.gsm8k`, :mod:`spmdrl.rewards.tiny`, :mod:`spmdrl.rewards.tiny_tools`,
  :mod:`spmdrl.rewards.last_number`), ``"auto"``
  (the built-in rule for each sample's ``data_source``, see :data:`DATA_SOURCE_FNS`), or a user's
  function registered with ``@register_reward_fn("my_score")`` in a module imported before the config
  is validated (the recipe's entry file);
- ``"my_pkg.my_mod:score"``: a function in an importable module;
- ``"path/to/file.py:score"``: a function in a Python file (relative paths: from the working directory).

A function declares ``trusted=True`` to run inline in the trainer, with no worker process, timeout or
resource limit (the built-in rules do: they are bounded); every other one runs in the sandbox's workers
(spmdrl.rewards.sandbox), which import it again by its module, or its file, and name.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from spmdrl.errors import ConfigError
from spmdrl.imports import import_spec_of, is_import_path
from spmdrl.registry import Registered, Registry
from spmdrl.rewards import gsm8k, last_number, math_answers, reasoning_gym_score, tiny, tiny_tools
from spmdrl.rewards.signature import CallStyle, call, call_style


class UnknownDataSourceError(ConfigError):
    """``reward.fn=auto`` met a sample whose data source has no built-in reward."""


@dataclass
class RewardInput:
    """One sample to score. ``prompt`` is kept for sample logging; it is not passed to the function."""

    response: str
    ground_truth: str
    data_source: str
    extra_info: dict[str, Any]
    prompt: str = ""


@dataclass(frozen=True)
class RewardFn:
    """A loaded reward function and the spec it came from.

    ``trusted`` marks the built-in rules: they run inline, without a worker process (see
    :mod:`spmdrl.rewards.sandbox`). A ``RewardFn`` pickles as its spec, so a worker process
    re-loads the function itself; that works for file-path specs too, whose module has a
    made-up name that only the loading process knows.
    """

    spec: str
    fn: Callable[..., Any]
    trusted: bool
    # spmdrl's signature or verl's, from fn's signature (spmdrl.rewards.signature); called as spmdrl's.
    style: CallStyle = CallStyle.SPMDRL

    def __call__(
        self, response: str, ground_truth: str, *, data_source: str, extra_info: dict[str, Any]
    ) -> Any:
        return call(self.fn, self.style, response, ground_truth, data_source, extra_info)

    def __reduce__(self) -> tuple[Callable[[str], RewardFn], tuple[str]]:
        return (load_reward_fn, (self.spec,))


@dataclass(frozen=True)
class RewardFnEntry(Registered):
    """A registered reward function and what it declares."""

    # Runs inline in the trainer process: no worker, no timeout, no resource limit (the built-in rules).
    trusted: bool = False


class _RewardRegistry(Registry[RewardFnEntry]):
    """A Registry whose functions take spmdrl's reward arguments or verl's."""

    def _call_problem(self, fn: Callable[..., Any], extra: tuple[str, ...] = ()) -> str | None:
        try:
            call_style(fn)
        except TypeError as e:
            return str(e)
        return None


REWARD_FNS: Registry[RewardFnEntry] = _RewardRegistry(
    "reward function",
    RewardFnEntry,
    decorator="register_reward_fn",
    args=("response", "ground_truth"),
    kwargs=("data_source", "extra_info"),
    docs="docs/rewards.md",
)


def register_reward_fn(
    name: str, *, trusted: bool = False
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Registers the decorated function as ``reward.fn=name``. ``trusted``: run it inline in the trainer
    (no worker process, timeout or limits); only for functions that cannot hang or crash."""
    return REWARD_FNS.register(name, trusted=trusted)


@register_reward_fn("gsm8k", trusted=True)
def gsm8k_score(response: str, ground_truth: str, *, data_source: str, extra_info: dict[str, Any]) -> float:
    return gsm8k.compute_score(response, ground_truth)


@register_reward_fn("tiny", trusted=True)
def tiny_score(response: str, ground_truth: str, *, data_source: str, extra_info: dict[str, Any]) -> float:
    return tiny.compute_score(response, ground_truth)


# The last number in the reply against the ground truth: for models that answer in prose (docs/real_model.md).
@register_reward_fn("last_number", trusted=True)
def last_number_score(
    response: str, ground_truth: str, *, data_source: str, extra_info: dict[str, Any]
) -> float:
    return last_number.compute_score(response, ground_truth)


@register_reward_fn("tiny_tools", trusted=True)
def tiny_tools_score(
    response: str, ground_truth: str, *, data_source: str, extra_info: dict[str, Any]
) -> float:
    return tiny_tools.compute_score(response, ground_truth)


# Not trusted: sympy has no time or memory bound of its own, and math-verify's time limits need a main
# thread; it runs in the sandbox's workers, under reward.fn=auto too (spmdrl.rewards.math_answers).
@register_reward_fn("math")
def math_score(response: str, ground_truth: str, *, data_source: str, extra_info: dict[str, Any]) -> float:
    return math_answers.compute_score(response, ground_truth)


# Not trusted: some tasks' scorers call sympy, and a few raise on answers they cannot parse; reasoning-gym's
# import (about 2 s) is paid once per worker (spmdrl.rewards.reasoning_gym_score).
@register_reward_fn("reasoning_gym")
def reasoning_gym_rule(
    response: str, ground_truth: str, *, data_source: str, extra_info: dict[str, Any]
) -> dict[str, float]:
    return reasoning_gym_score.compute_score(response, data_source, extra_info)


# data_source column value -> the built-in rule that ``reward.fn=auto`` uses for it.
DATA_SOURCE_FNS: dict[str, Callable[..., float]] = {
    "openai/gsm8k": gsm8k_score,
    tiny.DATA_SOURCE: tiny_score,
    tiny.SHAPES_DATA_SOURCE: tiny_score,
    tiny_tools.DATA_SOURCE: tiny_tools_score,
    **dict.fromkeys(math_answers.DATA_SOURCES, math_score),
}
# data_source prefix -> the rule for every source that starts with it (``reasoning_gym/<task>``).
DATA_SOURCE_PREFIX_FNS: dict[str, Callable[..., Any]] = {reasoning_gym_score.PREFIX: reasoning_gym_rule}


def rule_for(data_source: str) -> Callable[..., Any] | None:
    """The built-in rule ``reward.fn=auto`` uses for ``data_source``: by its name, else by its prefix."""
    fn = DATA_SOURCE_FNS.get(data_source)
    if fn is None:
        fn = next((f for p, f in DATA_SOURCE_PREFIX_FNS.items() if data_source.startswith(p)), None)
    return fn


def _known_sources() -> str:
    return ", ".join([*sorted(DATA_SOURCE_FNS), *(f"{p}<task>" for p in DATA_SOURCE_PREFIX_FNS)])


@register_reward_fn("auto", trusted=True)
def auto_score(response: str, ground_truth: str, *, data_source: str, extra_info: dict[str, Any]) -> Any:
    fn = rule_for(data_source)
    if fn is None:
        raise UnknownDataSourceError(
            f"reward.fn=auto has no built-in reward for data_source {data_source!r} "
            f"(known: {_known_sources()}); set reward.fn to a registered one "
            f"({', '.join(REWARD_FNS)}) or to your own function, e.g. reward.fn=my_pkg.my_mod:score"
        )
    return fn(response, ground_truth, data_source=data_source, extra_info=extra_info)


def check_data_sources(spec: str, data_sources: set[str]) -> None:
    """``reward.fn=auto`` must know every data_source in the data: checked at start, not at the first
    sample (after a warm-start and an engine build)."""
    math_answers.check_available(spec, data_sources)
    _check_reasoning_gym(spec.strip(), data_sources)
    if spec.strip() != "auto":
        return
    unknown = sorted(s for s in data_sources if rule_for(s) is None)
    if unknown:
        raise UnknownDataSourceError(
            f"reward.fn=auto has no built-in reward for data_source {', '.join(map(repr, unknown))} in the data "
            f"(known: {_known_sources()}); set reward.fn to a registered one "
            f"({', '.join(REWARD_FNS)}) or to your own function, e.g. reward.fn=my_pkg.my_mod:score"
        )


def _check_reasoning_gym(spec: str, data_sources: set[str]) -> None:
    """reward.fn=reasoning_gym, or auto on a reasoning_gym/<task> source, needs the package (its extra)."""
    rg_sources = sorted(s for s in data_sources if reasoning_gym_score.is_source(s))
    if spec == "reasoning_gym" or (spec == "auto" and rg_sources):
        on = f" on data_source {', '.join(map(repr, rg_sources))}" if rg_sources else ""
        reasoning_gym_score.require(f"reward.fn={spec}{on}")


def load_reward_fn(spec: str) -> RewardFn:
    """The reward function that ``spec`` names (``reward.fn``: a registered name or an import path);
    raises ConfigError saying what is wrong with it."""
    entry = REWARD_FNS.get(spec.strip(), key="reward.fn")
    style = call_style(entry.fn)  # the registry checked it takes one of the two signatures
    if entry.trusted:
        return RewardFn(spec=entry.name, fn=entry.fn, trusted=True, style=style)
    # What a worker process (a fresh interpreter) imports it by: the import path as given (a file's made
    # absolute), or, for a name a user registered, where the function is defined.
    where = entry.name
    if not is_import_path(where):
        try:
            where = import_spec_of(entry.fn)
        except ValueError as e:
            raise ConfigError(f"reward.fn={spec!r}: {e}; define it at the top level of a module") from None
    return RewardFn(spec=where, fn=entry.fn, trusted=False, style=style)
