"""Checkpoint-specific errors; all derive from :mod:`verl_core.errors`.

Transient (retry the phase): :class:`StoreUnavailableError`.
Permanent (fail fast, name the object): everything else.
"""

from __future__ import annotations

from verl_core.errors import PermanentError, TransientError, VerlError

__all__ = [
    "VerlError", "TransientError", "PermanentError",
    "StoreUnavailableError", "CorruptObjectError", "UnsafeManifestError",
    "CheckpointNotFoundError", "NoValidCheckpointError", "CheckpointDisagreementError",
    "CheckpointSaveError", "StoreFullError",
]


class StoreUnavailableError(TransientError):
    """The run store could not be reached or an I/O call failed (network, server gone, timeout,
    disk error). Nothing committed was changed; retrying the phase is safe."""


class CorruptObjectError(PermanentError):
    """A stored object is missing, truncated, has the wrong hash, or is not in the expected format.
    The message names the object (and the checkpoint/group/tensor when known)."""

    def __init__(self, message: str, *, sha: str | None = None, path: str | None = None):
        super().__init__(message)
        self.sha = sha
        self.path = path


class UnsafeManifestError(PermanentError):
    """A manifest, pointer or reference is malformed or tries to name something outside the store
    (e.g. ``../`` or absolute paths, non-hex object names). Nothing it names is read."""


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


class StoreFullError(PermanentError):
    """The store's disk or quota is full. Retrying cannot help until space is freed; nothing
    committed was changed (the half-written save is garbage that ``gc`` removes)."""
