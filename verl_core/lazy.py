"""Package namespaces that import their modules on first use (PEP 562), so that reading a config
or printing ``--help`` does not pay for transformers or torch.distributed.checkpoint.

``from verl_core.models import load_causal_lm`` and ``verl_core.models.load_causal_lm`` behave as
before; only the moment of the import moves. Importing a submodule directly
(``verl_core.models.loading``) is unchanged.
"""

from __future__ import annotations

import importlib
import sys


def exports(package: str, modules: dict[str, tuple[str, ...]]):
    """``(__all__, __getattr__)`` for ``package``: ``modules`` maps each submodule (absolute
    name) to the names the package re-exports from it."""
    where = {name: mod for mod, names in modules.items() for name in names}

    def __getattr__(name: str):
        mod = where.get(name)
        if mod is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(mod), name)
        setattr(sys.modules[package], name, value)  # the next access is a plain attribute
        return value

    return sorted(where), __getattr__
