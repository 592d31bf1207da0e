"""A name -> function table with one signature per table.

Every algorithm family (advantage estimators, policy losses, KL estimators, loss aggregations) is
one :class:`Registry`. Callers look an entry up by the name in the config and call it with the
same arguments whatever the name, so no caller branches on algorithm names. A new algorithm is
one decorated function plus its test.

An entry may also carry *traits*: a frozen record of what the algorithm needs from the rest of
the system (a critic, groups of responses, a greedy baseline rollout …), declared where it is
registered (``@REG.register("gae", needs_critic=True)``). The config and the trainer ask the
registry for them instead of keeping their own lists of names.

What belongs here: the table itself. What does not: any algorithm.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable, Iterator, Optional, TypeVar

F = TypeVar("F", bound=Callable)


class UnknownNameError(KeyError, ValueError):
    """A name that is not registered. Both a ``KeyError`` (it is a lookup) and a ``ValueError``
    (it usually comes from a config value), so either ``except`` catches it."""

    def __str__(self) -> str:  # KeyError would print the message in quotes
        return str(self.args[0]) if self.args else ""


def _signature_key(fn: Callable) -> tuple[tuple[str, inspect._ParameterKind], ...]:
    return tuple((p.name, p.kind) for p in inspect.signature(fn).parameters.values())


class Registry:
    """Functions of one ``kind`` (e.g. ``"advantage estimator"``) under unique names.

    ``prototype``, when given, is a function whose parameter names and kinds every entry must
    repeat exactly (annotations and defaults are not compared); a mismatch raises ``TypeError``
    at registration, i.e. at import time, rather than at step 500 of a run.

    ``traits``, when given, is a frozen dataclass whose fields all have defaults; each entry's
    traits are one instance of it, built from the keywords of :meth:`register` (an unknown trait
    raises ``TypeError`` at registration) and read back with :meth:`traits`.
    """

    def __init__(self, kind: str, prototype: Optional[Callable] = None,
                 traits: Optional[type] = None):
        self.kind = kind
        self._prototype = _signature_key(prototype) if prototype is not None else None
        self._traits_type = traits
        self._fns: dict[str, Callable] = {}  # canonical name -> function
        self._aliases: dict[str, str] = {}  # alias -> canonical name
        self._traits: dict[str, Any] = {}  # canonical name -> traits record (or None)

    def register(self, name: str, *aliases: str, **traits) -> Callable[[F], F]:
        """Decorator: ``@REG.register("k3", "low_var_kl")``, with the entry's traits as keywords
        (``@REG.register("gae", needs_critic=True)``) when the registry has a traits type. Any
        name or alias that is already taken raises ``ValueError``."""
        all_names = (name, *aliases)
        for n in all_names:
            if not isinstance(n, str) or not n:
                raise ValueError(f"{self.kind} names must be non-empty strings, got {n!r}")
        if len(set(all_names)) != len(all_names):
            raise ValueError(f"{self.kind} {name!r}: repeated name among {all_names}")
        self._check_free(all_names)
        if self._traits_type is None:
            if traits:
                raise TypeError(f"{self.kind} {name!r}: this registry has no traits, "
                                f"got {sorted(traits)}")
            record = None
        else:
            try:
                record = self._traits_type(**traits)
            except TypeError as e:
                raise TypeError(f"{self.kind} {name!r}: bad traits {traits}: {e}") from None

        def decorator(fn: F) -> F:
            if self._prototype is not None and _signature_key(fn) != self._prototype:
                raise TypeError(
                    f"{self.kind} {name!r} ({fn.__qualname__}) has signature "
                    f"{inspect.signature(fn)}; every {self.kind} must take exactly "
                    f"({', '.join(p for p, _ in self._prototype)}) with the same kinds")
            self._check_free(all_names)  # again: another decorator may have run in between
            self._fns[name] = fn
            self._traits[name] = record
            for a in aliases:
                self._aliases[a] = name
            return fn

        return decorator

    def _check_free(self, names: tuple[str, ...]) -> None:
        for n in names:
            if n in self:
                raise ValueError(f"{self.kind} {n!r} is already registered "
                                 f"(as {self._fns[self._canonical(n)].__qualname__})")

    def _canonical(self, name: str) -> str:
        return self._aliases.get(name, name)

    def get(self, name: str) -> Callable:
        """The function registered under ``name`` or one of its aliases; an unknown name raises
        :class:`UnknownNameError` listing every accepted name."""
        fn = self._fns.get(self._canonical(name))
        if fn is None:
            raise UnknownNameError(
                f"unknown {self.kind} {name!r}; known: {', '.join(self.names(include_aliases=True))}")
        return fn

    def traits(self, name: str) -> Any:
        """The traits record of ``name`` (or an alias): an instance of the registry's traits type,
        None when it has none; an unknown name raises like :meth:`get`."""
        self.get(name)
        return self._traits[self._canonical(name)]

    def names(self, include_aliases: bool = False) -> tuple[str, ...]:
        """Canonical names, sorted (plus the aliases when ``include_aliases``)."""
        names = set(self._fns)
        if include_aliases:
            names |= set(self._aliases)
        return tuple(sorted(names))

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and (name in self._fns or name in self._aliases)

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def __len__(self) -> int:
        return len(self._fns)

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}, names={list(self.names())})"
