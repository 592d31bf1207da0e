"""Checkpoint errors; all derive from :mod:`verl_core.errors`, which also holds the run store's
(unavailable, corrupt object, unsafe name, full), re-exported here.

Transient (retry the phase): :class:`StoreUnavailableError`.
Permanent (fail fast, name the object): everything else.
"""

from __future__ import annotations

from verl_core.errors import (CorruptObjectError, PermanentError, StoreFullError,
                              StoreUnavailableError, TransientError, UnsafeManifestError,
                              VerlError)

__all__ = [
    "VerlError", "TransientError", "PermanentError",
    "StoreUnavailableError", "CorruptObjectError", "UnsafeManifestError",
    "CheckpointNotFoundError", "NoValidCheckpointError", "CheckpointDisagreementError",
    "CheckpointSaveError", "StoreFullError",
]


class CheckpointNotFoundError(PermanentError):
    """The requested checkpoint reference does not resolve to any manifest in the store."""


class NoValidCheckpointError(PermanentError):
    """``auto`` resume found checkpoints but every one of them failed verification."""


class CheckpointDisagreementError(PermanentError):
    """Data-parallel workers were about to restore different checkpoints (or some found none).
    The message names every rank and the manifest (step and sha256) it chose; nothing was loaded.
    Usually the workers do not see the same run store (different paths or buckets, a stale
    mount), or a save committed between their reads of ``latest``."""

    def __init__(self, message: str, choices: dict | None = None):
        super().__init__(message)
        self.choices = dict(choices or {})
        """``{rank: manifest name or None}``."""


class CheckpointSaveError(PermanentError):
    """A save was refused (e.g. unsupported value type in the state); nothing was committed."""
