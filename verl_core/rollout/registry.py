"""The rollout-engine registry: engine name -> factory (:func:`register_engine`), and the names a
run's ``rollout.engine`` may take (:func:`engine_names`).

Apart from ``base.py`` because it imports nothing: the run's config (``rollout/config.py``) asks
it which engines exist without paying for torch or an engine. The built-in engines register when
their modules are first imported (``engines.py``, on the first ``make_engine``), so until then
their names come from :data:`BUILTIN_ENGINES` (a test holds it to what those modules register).
"""

from __future__ import annotations

from typing import Callable

BUILTIN_ENGINES = ("hf", "vllm")
"""The engines ``engines.py`` imports: module ``verl_core.rollout.<name>`` registers ``<name>``."""

_ENGINES: dict[str, Callable] = {}


def register_engine(name: str):
    def deco(factory):
        if name in _ENGINES:
            raise ValueError(f"rollout engine {name!r} is registered twice")
        _ENGINES[name] = factory
        return factory
    return deco


def engine_factory(name: str) -> Callable:
    """The factory registered as ``name``; an unknown name raises listing the registered ones."""
    if name not in _ENGINES:
        raise ValueError(f"unknown rollout engine {name!r}; known: {', '.join(sorted(_ENGINES))}")
    return _ENGINES[name]


def engine_names() -> set[str]:
    """Every engine a run may name: the built-ins (registered or not yet) and any registered."""
    return {*BUILTIN_ENGINES, *_ENGINES}
