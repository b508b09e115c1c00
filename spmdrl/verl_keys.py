"""verl's config names on spmdrl's command line: :func:`translate` rewrites the command-line overrides
before Hydra composes them (spmdrl.config_loader), by the table of spmdrl.verl_key_table: each verl key it
names becomes its spmdrl key (its value transformed where needed), is accepted where its value is what
spmdrl does anyway, or is refused with what to do instead. Nothing is dropped silently: the run logs the
mapping once, and a key under a verl-only section that the table does not name fails as unknown, saying
it is verl's (:func:`unknown_key_hint`, for check_key).
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from spmdrl.errors import ConfigError
from spmdrl.verl_key_table import DOC_PATH, SHARED_SECTIONS, VERL_ONLY_SECTIONS, VerlKey, entry_for


def is_verl_only(key: str) -> bool:
    return any(key == s or key.startswith(s + ".") for s in VERL_ONLY_SECTIONS)


def unknown_key_hint(key: str) -> str | None:
    """check_key's hint for a key the table does not name: under a section only verl has, a verl key spmdrl
    has no equivalent for; under a section both have, possibly one."""
    where = f"the verl keys spmdrl understands: {DOC_PATH}"
    if is_verl_only(key):
        return f"'{key}' is a verl key spmdrl has no equivalent for ({where})"
    if key.split(".", 1)[0] in SHARED_SECTIONS:
        return f"If it is a verl key, spmdrl has no equivalent for it ({where})"
    return None


@dataclass(frozen=True)
class Applied:
    """One verl key of the command line and what became of it (for the log)."""

    verl: str
    spmdrl: str | None  # None: accepted as what spmdrl does anyway
    value: str

    def __str__(self) -> str:
        return f"{self.verl} -> {self.spmdrl}" if self.spmdrl else f"{self.verl}={self.value} (accepted)"


# ---------------------------------------------------------------------------------------------- rewriting


def _parse(override: str) -> tuple[str, Any] | None:
    """``key``, parsed value of a ``key=value`` / ``+key=value`` / ``++key=value`` override; None for other
    forms (deletions, group selections) and for what Hydra's grammar does not read (Hydra reports it)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    if override.startswith("~") or "=" not in override:
        return None
    try:
        parsed = OverridesParser.create().parse_override(override)
    except HydraException:
        return None
    if parsed.package is not None or parsed.is_sweep_override():
        return None
    return parsed.key_or_group, parsed.value()


def render(value: Any) -> str:
    """``value`` in Hydra's override grammar."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, list | tuple):
        return "[" + ",".join(render(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ",".join(f"{k}:{render(v)}" for k, v in value.items()) + "}"
    # Bare where Hydra's grammar reads it back as the same string (a word or a path that starts with a
    # letter, not one of the grammar's constants); quoted otherwise.
    bare = isinstance(value, str) and re.fullmatch(r"[A-Za-z_][\w./:@-]*", value)
    if bare and value.lower() not in ("true", "false", "null", "inf", "nan"):
        return value
    text = str(value)
    body = re.sub(r"(\\*)('|$)", lambda m: m.group(1) * 2 + ("\\'" if m.group(2) else ""), text)
    return f"'{body}'"


def translate(overrides: list[str], spmdrl_key: Callable[[str], bool]) -> tuple[list[str], list[Applied]]:
    """The overrides with each verl key the table names rewritten to its spmdrl key (or dropped where it
    is accepted as what spmdrl does anyway), and what was applied. ``spmdrl_key(key)``: whether ``key`` is
    spmdrl's own, which stays as it is unless the table transforms its value (the names both share).
    Raises ConfigError for a refused key or value, and for two verl keys that set one spmdrl key to
    different values."""
    keyed = [_parse(ov) for ov in overrides]
    # Every table key of the command line, with its value: what an entry's value is checked against.
    given = {kv[0]: kv[1] for kv in keyed if kv is not None and entry_for(kv[0]) is not None}
    parsed: list[tuple[str, Any, VerlKey] | None] = []
    for ov, kv in zip(overrides, keyed, strict=True):
        entry = entry_for(kv[0]) if kv is not None else None
        if kv is None or entry is None:
            parsed.append(None)  # not in the table: composed as written (an unknown key fails there)
        elif entry.spmdrl == kv[0] and entry.convert is None and not ov.startswith("+"):
            parsed.append(None)  # a name both share, its value as it is
        elif spmdrl_key(kv[0]) and entry.spmdrl != kv[0]:
            parsed.append(None)  # spmdrl has this name itself (as another setting): spmdrl's meaning wins
        else:
            parsed.append((kv[0], kv[1], entry))
    out: list[str] = []
    applied: list[Applied] = []
    written: dict[str, tuple[str, str]] = {}  # spmdrl key -> (verl key, rendered value)
    for ov, item in zip(overrides, parsed, strict=True):
        if item is None:
            out.append(ov)
            continue
        key, value, entry = item
        if entry.spmdrl is None:
            if entry.accepts is None or not entry.accepts(value, given):
                what = (
                    "has no spmdrl equivalent" if entry.accepts is None else "differs from what spmdrl does"
                )
                raise ConfigError(f"verl's {key}={render(value)} {what}: {entry.note}")
            applied.append(Applied(key, None, render(value)))
            continue
        text = render(entry.convert(value, given) if entry.convert is not None else value)
        target = entry.spmdrl
        if target in written and written[target][1] != text:
            other = written[target][0]
            raise ConfigError(
                f"verl's {other} and {key} both set {target} here, to different values "
                f"({written[target][1]} and {text}); give one of them"
            )
        written[target] = (key, text)
        out.append(f"{target}={text}")
        # A name both share, its value only normalized (one path -> a list), is not logged.
        if entry.spmdrl != key:
            applied.append(Applied(key, entry.spmdrl, text))
    return out, applied


def log_line(applied: list[Applied]) -> str:
    return "spmdrl: verl keys: " + ", ".join(str(a) for a in applied)


def log_applied(applied: list[Applied]) -> None:
    """The mapping, once for the job (rank 0; the single process of --check / --cfg job), on stderr: stdout
    is --cfg job's YAML."""
    if applied and os.environ.get("RANK", "0") == "0":
        print(log_line(applied), file=sys.stderr, flush=True)
