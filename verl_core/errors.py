"""Error classes shared by every ``verl_core`` module.

Two families, so callers never branch on messages or module-specific types:

* :class:`TransientError` – the operation may succeed if repeated (storage unreachable, worker
  died, timeout). The Flyte task layer maps it to ``FlyteRecoverableException`` so a cluster
  retries the phase, and applies the same bounded retry policy itself in local runs.
* :class:`PermanentError` – repeating cannot help (bad config, corrupted data with no fallback,
  an unsafe manifest). The message names the file/field and says what to do.

Every error class of the library lives here (the run store's and the checkpoints' too), so a
caller imports its errors from one place; :class:`verl_core.config.ConfigError` is a
``ValueError`` raised while a config is built, before any of these can happen.
"""

from __future__ import annotations


class VerlError(Exception):
    """Base class of every error raised on purpose by ``verl_core``."""


class TransientError(VerlError):
    """A fault that a retry of the same phase may cure (I/O, network, lost worker, timeout)."""


class PermanentError(VerlError):
    """A fault that a retry cannot cure; fail fast with a message naming the culprit."""


# ------------------------------------------------- the run store (verl_core.store)
class StoreUnavailableError(TransientError):
    """The run store could not be reached or an I/O call failed (network, server gone, timeout,
    disk error). Nothing committed was changed; retrying the phase is safe."""


class CorruptObjectError(PermanentError):
    """A stored object is missing, truncated, has the wrong hash, or is not in the expected format.
    The message names the object (and the checkpoint/group/tensor when known)."""

    def __init__(self, message: str, *, sha: str | None = None, path: str | None = None,
                 quarantined: str | None = None):
        super().__init__(message)
        self.sha = sha
        self.path = path
        self.quarantined = quarantined
        """Where the reader moved the damaged bytes (``quarantine/…``), or None."""


class UnsafeManifestError(PermanentError):
    """A manifest, pointer or reference is malformed or tries to name something outside the store
    (e.g. ``../`` or absolute paths, non-hex object names). Nothing it names is read."""


class StoreFullError(PermanentError):
    """The store's disk or quota is full. Retrying cannot help until space is freed; nothing
    committed was changed (the half-written save is garbage that ``gc`` removes)."""


# ------------------------------------------------- checkpoints (verl_core.checkpoint)
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


# ------------------------------------------------- rollout engines (verl_core.rollout)
class RolloutEngineError(TransientError):
    """A rollout engine running in a process of its own (vLLM's engine core) died or hung more
    often in one call than ``rollout.engine_max_restarts`` rebuilds could cure. The message
    names the engine, the last failure and what to change; the phase may succeed when retried
    (a fresh engine is built then)."""


class StaleBatchError(PermanentError):
    """An update's batch was sampled with weights further behind than ``rollout.max_staleness``
    allows (or ahead of them)."""


RECOVER = ("re-run the same command with --overwrite-cache (pyflyte run --overwrite-cache …), "
           "which recomputes every phase of the run and rewrites what they stored")
"""The one command that recovers a run whose stored data cannot be rebuilt from the store."""
