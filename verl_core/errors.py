"""Error classes shared by every ``verl_core`` module.

Two families, so callers never branch on messages or module-specific types:

* :class:`TransientError` – the operation may succeed if repeated (storage unreachable, worker
  died, timeout). The Flyte task layer maps it to ``FlyteRecoverableException`` so a cluster
  retries the phase, and applies the same bounded retry policy itself in local runs.
* :class:`PermanentError` – repeating cannot help (bad config, corrupted data with no fallback,
  an unsafe manifest). The message names the file/field and says what to do.
"""

from __future__ import annotations


class VerlError(Exception):
    """Base class of every error raised on purpose by ``verl_core``."""


class TransientError(VerlError):
    """A fault that a retry of the same phase may cure (I/O, network, lost worker, timeout)."""


class PermanentError(VerlError):
    """A fault that a retry cannot cure; fail fast with a message naming the culprit."""
