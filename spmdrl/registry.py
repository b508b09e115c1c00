"""Registries of the functions a config names: by a registered name, or by import path.

``algorithm.policy_loss=gspo`` names the function that ``@register_policy_loss("gspo")`` decorates, next
to it in spmdrl/algos/policy_losses.py: grep the name and you are at the code (verl's registries, one
hop). A user registers their own the same way, in any module imported before the config is validated (a
recipe's entry file is), or names a function by import path instead, as ``reward.fn`` always could:
``algorithm.policy_loss=my_pkg.losses:my_loss`` or ``algorithm.policy_loss=path/to/losses.py:my_loss``.

Each kind has one :class:`Registry`, a ``register_*`` decorator and an entry type, a :class:`Registered`
subclass whose extra fields are the properties a function declares when it registers
(``@register_adv_estimator("gae", needs_critic=True)``); the code that depends on a property reads the
entry, never a list of names kept elsewhere. A function named by import path has its own registration's
properties if it has one (the import runs its decorator), else the defaults.

The kinds: advantage estimators (spmdrl.algos.advantages), policy losses (spmdrl.algos.policy_losses),
KL estimators (spmdrl.algos.kl), reward functions (spmdrl.rewards.registry). Each checks, at registration
and at lookup by path, that the function can be called with its kind's arguments (:attr:`Registry.contract`).
spmdrl.config.validate resolves every config value that names one (``registered(...)`` fields), so a
wrong name fails at load, before any model is built, with the registered names and a did-you-mean.
"""

from __future__ import annotations

import dataclasses
import difflib
import inspect
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from spmdrl.errors import ConfigError
from spmdrl.imports import import_object, is_import_path

F = TypeVar("F", bound=Callable[..., Any])


@dataclass(frozen=True)
class Registered:
    """A function and the name it goes by: its registered name, or the import path a config gave."""

    name: str
    fn: Callable[..., Any]

    def extra_kwargs(self) -> tuple[str, ...]:
        """Keyword arguments this function is called with besides its kind's, by what it declared."""
        return ()


E = TypeVar("E", bound=Registered)


def _where(fn: Callable[..., Any]) -> str:
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"


def _same_function(a: Callable[..., Any], b: Callable[..., Any]) -> bool:
    """One function, maybe from two imports of its file (by module name and by path, or a notebook cell
    run again): the same source file and qualified name."""
    if a is b:
        return True
    a, b = inspect.unwrap(a), inspect.unwrap(b)
    code_a, code_b = getattr(a, "__code__", None), getattr(b, "__code__", None)
    if code_a is None or code_b is None:
        return _where(a) == _where(b)
    return (code_a.co_filename, a.__qualname__) == (code_b.co_filename, b.__qualname__)


class Registry(Mapping[str, Callable[..., Any]], Generic[E]):
    """Registered name -> function of one kind (a read-only mapping, in registration order), plus
    :meth:`get`, which also takes an import path and returns the entry with its declared properties."""

    def __init__(
        self,
        kind: str,
        entry_type: type[E],
        *,
        decorator: str,
        args: tuple[str, ...],
        kwargs: tuple[str, ...] = (),
        suffix: str = "",
        docs: str = "docs/algorithms.md",
    ) -> None:
        self.kind = kind  # "policy loss": for messages
        self.entry_type = entry_type
        self.decorator = decorator  # the register_* function users call, for messages
        # The arguments every function of this kind is called with: positional, then keyword.
        self.args, self.kwargs = args, kwargs
        # A modifier a name may carry (the KL estimators' "+": the value of k, the gradient of k2); get()
        # strips it, the kind's own code reads it.
        self.suffix = suffix
        self.docs = docs
        self._entries: dict[str, E] = {}

    # Mapping: registered names only (an import path is not "in" the registry).
    def __getitem__(self, name: str) -> Callable[..., Any]:
        return self._entries[name].fn

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def contract(self) -> str:
        """How every function of this kind is called, e.g. ``fn(inputs)``."""
        keywords = f", *, {', '.join(self.kwargs)}" if self.kwargs else ""
        return f"fn({', '.join(self.args)}{keywords})"

    def register(self, name: str, **properties: Any) -> Callable[[F], F]:
        """A decorator registering its function as ``name`` with ``properties`` (the entry type's fields).
        Registering a name again replaces it only with the same function (its file imported twice, by
        module name and by path, or a notebook cell run again); another function under a taken name is an
        error."""

        def decorate(fn: F) -> F:
            self._add(self.entry_type(name=name, fn=fn, **properties))
            return fn

        if not name or is_import_path(name) or (self.suffix and name.endswith(self.suffix)):
            no_suffix = f" and not end with {self.suffix!r}" if self.suffix else ""
            raise ValueError(
                f"@{self.decorator}({name!r}): a {self.kind}'s name must be non-empty, hold no ':' (an "
                f"import path has one){no_suffix}"
            )
        return decorate

    def unregister(self, name: str) -> None:
        """Forget ``name`` (tests, notebooks). A KeyError if it is not registered."""
        del self._entries[name]

    def get(self, spec: str, *, key: str | None = None) -> E:
        """The entry ``spec`` names: a registered name (without the kind's suffix), or an import path
        ``'my_pkg.my_mod:fn'`` / ``'path/to/file.py:fn'``, imported now. ``key`` (``algorithm.policy_loss``)
        starts the error messages. Raises ConfigError naming what is wrong and the registered names."""
        label = f"{key}={spec!r}" if key else f"{self.kind} {spec!r}"
        name = spec.removesuffix(self.suffix) if self.suffix else spec
        entry = self._entries.get(name)
        if entry is not None:
            return entry
        if not is_import_path(name):
            raise ConfigError(self._unknown(name, key, label))
        fn, canonical = import_object(name, label=label)
        problem = self._call_problem(fn)
        if problem:
            raise ConfigError(f"{label}: {_where(fn)} {problem}")
        # Its own registration, if the import ran one, declares its properties; else the defaults.
        registered = next((e for e in self._entries.values() if _same_function(e.fn, fn)), None)
        if registered is not None:
            problem = self._call_problem(fn, registered.extra_kwargs())
            if problem:
                raise ConfigError(f"{label}: {_where(fn)} {problem}")
            return dataclasses.replace(registered, name=canonical, fn=fn)
        return self.entry_type(name=canonical, fn=fn)

    def _add(self, entry: E) -> None:
        problem = self._call_problem(entry.fn, entry.extra_kwargs())
        if problem:
            raise TypeError(f"@{self.decorator}({entry.name!r}): {_where(entry.fn)} {problem}")
        old = self._entries.get(entry.name)
        if old is not None and not _same_function(old.fn, entry.fn):
            raise ValueError(
                f"{self.kind} {entry.name!r} is already registered, by {_where(old.fn)}; "
                f"register {_where(entry.fn)} under another name"
            )
        self._entries[entry.name] = entry

    def _call_problem(self, fn: Callable[..., Any], extra: tuple[str, ...] = ()) -> str | None:
        """Why ``fn`` cannot be called as :attr:`contract` says (plus the ``extra`` keywords its entry
        declared), as the end of a sentence (None: it can)."""
        try:
            signature = inspect.signature(fn)
        except (TypeError, ValueError):
            return None  # a builtin without a signature: it will tell when called
        try:
            signature.bind(*self.args, **dict.fromkeys(self.kwargs + extra))
        except TypeError as e:
            also = f" (and, as it declared, {', '.join(extra)})" if extra else ""
            return f"does not take the arguments of a {self.kind}, {self.contract}{also}: {e}"
        return None

    def _unknown(self, name: str, key: str | None, label: str) -> str:
        close = difflib.get_close_matches(name, list(self._entries), n=3)
        head = f"{label}: unknown {self.kind}" if key else f"unknown {label}"
        hint = f" Did you mean {' or '.join(map(repr, close))}?" if close else ""
        with_suffix = f" (each also with {self.suffix!r})" if self.suffix else ""
        return (
            f"{head}.{hint} Registered: {', '.join(self._entries)}{with_suffix}. Your own: a function by "
            f"import path ('my_pkg.my_mod:fn' or 'path/to/file.py:fn'), or one decorated with "
            f'@{self.decorator}("name") in a module imported before the config is validated, such as '
            f"the recipe's entry file ({self.docs})"
        )
