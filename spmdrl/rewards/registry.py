"""Reward functions by name: the built-in rules, per-data-source dispatch, and user functions.

A reward function has this signature (the one users write)::

    def score(response: str, ground_truth: str, *, data_source: str, extra_info: dict) -> float:
        ...

It returns a float, or a dict with a float ``"score"`` key plus extra numeric keys that are logged
(say ``{"score": 1.0, "format_ok": 1.0}``). :func:`load_reward_fn` turns the ``reward.fn`` config
string into such a function:

- ``"gsm8k"``, ``"tiny"``, ``"tiny_tools"``: the built-in rules (:mod:`spmdrl.rewards.gsm8k`,
  :mod:`spmdrl.rewards.tiny`, :mod:`spmdrl.rewards.tiny_tools`);
- ``"auto"``: the built-in rule for each sample's ``data_source`` (see :data:`DATA_SOURCE_FNS`);
- ``"my_pkg.my_mod:score"``: a function in an importable module;
- ``"path/to/file.py:score"``: a function in a Python file (relative paths: from the working directory).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from spmdrl.config import ConfigError
from spmdrl.imports import import_file, import_module_named
from spmdrl.rewards import gsm8k, tiny, tiny_tools


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

    def __call__(
        self, response: str, ground_truth: str, *, data_source: str, extra_info: dict[str, Any]
    ) -> Any:
        return self.fn(response, ground_truth, data_source=data_source, extra_info=extra_info)

    def __reduce__(self) -> tuple[Callable[[str], RewardFn], tuple[str]]:
        return (load_reward_fn, (self.spec,))


def gsm8k_score(response: str, ground_truth: str, *, data_source: str, extra_info: dict[str, Any]) -> float:
    return gsm8k.compute_score(response, ground_truth)


def tiny_score(response: str, ground_truth: str, *, data_source: str, extra_info: dict[str, Any]) -> float:
    return tiny.compute_score(response, ground_truth)


def tiny_tools_score(
    response: str, ground_truth: str, *, data_source: str, extra_info: dict[str, Any]
) -> float:
    return tiny_tools.compute_score(response, ground_truth)


# data_source column value -> the built-in rule that ``reward.fn=auto`` uses for it.
DATA_SOURCE_FNS: dict[str, Callable[..., float]] = {
    "openai/gsm8k": gsm8k_score,
    tiny.DATA_SOURCE: tiny_score,
    tiny_tools.DATA_SOURCE: tiny_tools_score,
}


def auto_score(response: str, ground_truth: str, *, data_source: str, extra_info: dict[str, Any]) -> float:
    fn = DATA_SOURCE_FNS.get(data_source)
    if fn is None:
        raise UnknownDataSourceError(
            f"reward.fn=auto has no built-in reward for data_source {data_source!r} "
            f"(known: {', '.join(sorted(DATA_SOURCE_FNS))}); set reward.fn to a built-in "
            f"({', '.join(BUILTINS)}) or to your own function, e.g. reward.fn=my_pkg.my_mod:score"
        )
    return fn(response, ground_truth, data_source=data_source, extra_info=extra_info)


BUILTINS: dict[str, Callable[..., float]] = {
    "gsm8k": gsm8k_score,
    "tiny": tiny_score,
    "tiny_tools": tiny_tools_score,
    "auto": auto_score,
}


def check_data_sources(spec: str, data_sources: set[str]) -> None:
    """``reward.fn=auto`` must know every data_source in the data: checked at start, not at the first
    sample (after a warm-start and an engine build)."""
    if spec.strip() != "auto":
        return
    unknown = sorted(data_sources - set(DATA_SOURCE_FNS))
    if unknown:
        raise UnknownDataSourceError(
            f"reward.fn=auto has no built-in reward for data_source {', '.join(map(repr, unknown))} in the data "
            f"(known: {', '.join(sorted(DATA_SOURCE_FNS))}); set reward.fn to a built-in "
            f"({', '.join(BUILTINS)}) or to your own function, e.g. reward.fn=my_pkg.my_mod:score"
        )


def load_reward_fn(spec: str) -> RewardFn:
    """The reward function that ``spec`` names; raises ConfigError saying what is wrong with it."""
    spec = spec.strip()
    if spec in BUILTINS:
        return RewardFn(spec=spec, fn=BUILTINS[spec], trusted=True)
    target, sep, attr = spec.rpartition(":")
    if not sep or not target or not attr:
        raise ConfigError(
            f"reward.fn={spec!r} is neither a built-in ({', '.join(BUILTINS)}) nor a function given as "
            "'my_pkg.my_mod:score' or 'path/to/file.py:score'"
        )
    if target.endswith(".py") or "/" in target or os.sep in target:
        path = Path(target).expanduser().resolve()
        module = import_file(path, label=f"reward.fn={spec!r}")
        spec = f"{path}:{attr}"  # absolute, so a worker process with another cwd finds it too
    else:
        module = import_module_named(target, label=f"reward.fn={spec!r}", attr=attr)
    fn = getattr(module, attr, None)
    if fn is None:
        defined = sorted(
            name for name, value in vars(module).items() if callable(value) and not name.startswith("_")
        )
        raise ConfigError(
            f"reward.fn={spec!r}: module {target!r} has no attribute {attr!r}; "
            f"its public callables are: {', '.join(defined) or '(none)'}"
        )
    if not callable(fn):
        raise ConfigError(f"reward.fn={spec!r}: {attr!r} is a {type(fn).__name__}, not a function")
    return RewardFn(spec=spec, fn=fn, trusted=False)
