"""The field machinery every config section is built on: :class:`ConfigError`, the type pass
driven by the annotations (:func:`_check_types`), the range helpers (``_positive``,
``_non_negative``, ``_one_of``, ``_fail``), and the :data:`TRAJECTORY` metadata that
:func:`in_trajectory` / :func:`not_in_trajectory` put on every field.

The sections live beside the components that read them (``guard/config.py``,
``checkpoint/config.py``, ``rollout/config.py`` ...) and ``verl_core/config.py`` composes them into
:class:`~verl_core.config.RunConfig`; all of them import this module, which imports nothing of
``verl_core``, so no import circle can form. No section, preset or override logic belongs here.
The helpers keep their leading underscore: they are for config modules, not for callers (who
import everything from ``verl_core.config``).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers
import typing
from dataclasses import field


class ConfigError(ValueError):
    """A configuration value is invalid. The message names the field and the fix."""


def _fail(section: str, name: str, value, why: str) -> None:
    raise ConfigError(f"{section}.{name}={value!r}: {why}")


_KINDS = {bool: "True or False", int: "an integer", float: "a finite number", str: "a string"}


@functools.cache
def _fields_of(cls) -> dict[str, tuple[type, object]]:
    """``{name: (annotated type, default)}``; the annotations resolved, since ``from __future__
    import annotations`` leaves strings in ``dataclasses.fields``."""
    hints = typing.get_type_hints(cls)
    return {f.name: (hints[f.name], f.default) for f in dataclasses.fields(cls)}


def _coerce(kind: type, value):
    """``value`` as ``kind``, or None when it is not one. A float field takes ints (2 -> 2.0) and
    an int field integral floats (4.0 -> 4, what JSON tools and ``1e3`` give), so equal configs
    serialise, and hash, the same. bool is never a number here, though Python says it is an int."""
    if isinstance(value, bool):
        return value if kind is bool else None
    if kind is float and isinstance(value, numbers.Real):
        try:
            f = float(value)
        except OverflowError:  # an int beyond float range
            return None
        return f if math.isfinite(f) else None
    if kind is int and isinstance(value, numbers.Integral):
        return int(value)
    if kind is int and isinstance(value, numbers.Real) and math.isfinite(value) \
            and float(value).is_integer():
        return int(value)
    if kind is str and isinstance(value, str):
        return value
    if kind not in _KINDS and isinstance(value, kind):
        return value
    return None


def _checked(section: str, name: str, kind: type, default, value):
    """``value`` canonicalised for a field annotated ``kind``, or ConfigError naming the field."""
    ok = _coerce(kind, value)
    if ok is None:
        what = _KINDS.get(kind, f"a {kind.__name__}")
        got = f"not {type(value).__name__}"
        if kind is float and isinstance(value, numbers.Real) and not isinstance(value, bool):
            got = "NaN and infinity are refused"
        hint = "" if default is dataclasses.MISSING else f"; e.g. the default {default!r}"
        _fail(section, name, value, f"must be {what} ({got}){hint}")
    return ok


def _check_types(section: str, obj) -> None:
    """The type pass every section runs first, driven by the field annotations: an int field
    refuses 2.5 and True, a float field refuses "abc", NaN and infinity, a str field refuses
    numbers. Valid values are stored canonicalised (see :func:`_coerce`); the range checks of
    each section run after it, on values of the right type."""
    for name, (kind, default) in _fields_of(type(obj)).items():
        value = getattr(obj, name)
        ok = _checked(section, name, kind, default, value)
        if ok is not value:
            object.__setattr__(obj, name, ok)  # frozen: store the canonical value, once, here


def _positive(section: str, obj, *names: str) -> None:
    for n in names:
        v = getattr(obj, n)
        if v is None or v <= 0:
            _fail(section, n, v, "must be > 0")


def _non_negative(section: str, obj, *names: str) -> None:
    for n in names:
        v = getattr(obj, n)
        if v is None or v < 0:
            _fail(section, n, v, "must be >= 0")


def _one_of(section: str, name: str, value, allowed) -> None:
    if value not in allowed:
        _fail(section, name, value, f"unknown value; known: {', '.join(sorted(allowed))}")


TRAJECTORY = "trajectory"
"""Field metadata: whether the field decides the training trajectory (the state after step k for
every k; :meth:`RunConfig.trajectory_hash`): True, False, or a predicate of the
:class:`RunConfig`. Every field declares it through :func:`in_trajectory` or
:func:`not_in_trajectory` (a test walks them all), so no new field joins the trajectory, or
leaves it, silently."""


def in_trajectory(default=dataclasses.MISSING, *, factory=dataclasses.MISSING, when=None):
    """A field that decides the trajectory; with ``when``, only in the configs where
    ``when(run)`` holds."""
    return field(default=default, default_factory=factory, metadata={TRAJECTORY: when or True})


def not_in_trajectory(default=dataclasses.MISSING, *, factory=dataclasses.MISSING):
    """A field that never changes the trajectory (evaluation, checkpointing, reports, wall-clock
    limits, memory-only sizes, where the workers run): a run that changes it continues from the
    same checkpoints and lineage."""
    return field(default=default, default_factory=factory, metadata={TRAJECTORY: False})
