"""Loading user scorers from a spec string (verl's ``custom_reward_function``).

A spec is ``path/to/file.py:function`` or ``package.module:function``; without ``:function`` the
function is ``compute_score`` (verl's default name). The function has verl's signature::

    fn(data_source, solution_str, ground_truth, extra_info) -> float | {"score": float, ...}

Loading only: ``manager.py`` calls :func:`load_scorer` in worker processes, never in the
trainer, and runs it there with timeouts. Every failure raises :class:`ScorerLoadError` naming the
spec.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import os
import sys
from typing import Callable

from verl_core.errors import PermanentError

__all__ = ["ScorerLoadError", "load_scorer", "parse_spec", "DEFAULT_FUNCTION"]

DEFAULT_FUNCTION = "compute_score"

CustomScorer = Callable[[str, str, str, "dict | None"], "float | dict"]


class ScorerLoadError(PermanentError, ValueError):
    """A custom scorer spec cannot be loaded (bad spec, import error, or an import that hangs or
    kills its process); the message names the spec and what to do."""


def _is_file_spec(target: str) -> bool:
    return target.endswith(".py") or "/" in target or os.sep in target


def parse_spec(spec: str) -> tuple[str, str]:
    """Split ``"target:function"`` into ``(target, function)``. The last ``:`` separates them, so
    Windows drive letters and ``file.py`` alone (-> ``compute_score``) both work."""
    if not isinstance(spec, str) or not spec.strip():
        raise ScorerLoadError(f"custom scorer spec {spec!r} is empty; use "
                              "'path/to/file.py:function' or 'package.module:function'")
    target, sep, fn = spec.strip().rpartition(":")
    if not sep or (len(target) == 1 and target.isalpha()):  # no ':' at all, or 'C:\\x.py'
        return spec.strip(), DEFAULT_FUNCTION
    if not target or not fn.isidentifier():
        raise ScorerLoadError(f"custom scorer spec {spec!r}: expected 'path/to/file.py:function' "
                              "or 'package.module:function' with a Python identifier after ':'")
    return target, fn


def load_scorer(spec: str) -> CustomScorer:
    """Import the scorer named by ``spec`` and return the callable."""
    target, fn_name = parse_spec(spec)
    if _is_file_spec(target):
        module = _load_file(spec, target)
    else:
        try:
            module = importlib.import_module(target)
        except ModuleNotFoundError as e:
            raise ScorerLoadError(
                f"custom scorer {spec!r}: module {target!r} is not importable ({e}); check the "
                "name, install the package, or give a file path ('path/to/file.py:function')"
            ) from e
        except Exception as e:
            raise ScorerLoadError(f"custom scorer {spec!r}: importing module {target!r} failed: "
                                  f"{type(e).__name__}: {e}") from e
    if not hasattr(module, fn_name):
        public = sorted(n for n in vars(module) if not n.startswith("_")
                        and callable(getattr(module, n)))
        raise ScorerLoadError(f"custom scorer {spec!r}: {target!r} has no attribute {fn_name!r}; "
                              f"callables defined there: {public}")
    fn = getattr(module, fn_name)
    if not callable(fn):
        raise ScorerLoadError(f"custom scorer {spec!r}: {fn_name!r} is a {type(fn).__name__}, not "
                              "a function")
    return fn


def _load_file(spec: str, target: str):
    path = os.path.abspath(os.path.expanduser(target))
    if not os.path.isfile(path):
        raise ScorerLoadError(f"custom scorer {spec!r}: file {path!r} not found (relative paths "
                              f"are resolved against the working directory {os.getcwd()!r})")
    # One module per file path, registered so that pickling/dataclasses inside it work; the hash
    # keeps two scorer files with the same base name apart.
    stem = os.path.splitext(os.path.basename(path))[0]
    name = f"verl_core_scorer_{stem}_{hashlib.sha1(path.encode()).hexdigest()[:10]}"
    if name in sys.modules:
        return sys.modules[name]
    module_spec = importlib.util.spec_from_file_location(name, path)
    if module_spec is None or module_spec.loader is None:
        raise ScorerLoadError(f"custom scorer {spec!r}: {path!r} cannot be loaded as a Python "
                              "module (is it a .py file?)")
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[name] = module
    try:
        module_spec.loader.exec_module(module)
    except BaseException as e:
        del sys.modules[name]
        if not isinstance(e, Exception):
            raise
        raise ScorerLoadError(f"custom scorer {spec!r}: executing {path!r} failed: "
                              f"{type(e).__name__}: {e}") from e
    return module
