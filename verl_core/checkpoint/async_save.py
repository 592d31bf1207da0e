"""Asynchronous checkpointing: snapshot to CPU memory now, write in the background.

What belongs here: :class:`AsyncCheckpointer`, the background saves of one process, a thin layer
over ``CheckpointManager.async_save_distributed`` (the snapshot, ``snapshot_state``, is
``dcp.py``'s: what torch.distributed.checkpoint writes from). The commit protocol itself is
:class:`~verl_core.checkpoint.manager.CheckpointManager`'s, so a crash or an I/O error during a
background write leaves the previous checkpoint as ``latest`` (nothing half-written is ever
visible).

Training is blocked only for the snapshot (a CPU copy of every tensor: a memcpy, no hashing, no
I/O) and, if the previous background save is still running, for the rest of that one: at most one
save is pending, so memory stays bounded at one extra copy of the state. The snapshot buffers are
reused from one save to the next (pinned host memory for CUDA tensors), so after the first save a
snapshot costs no allocation and no page faults.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Mapping, Optional

from verl_core.checkpoint.dcp import snapshot_state, sync_device
from verl_core.checkpoint.manager import CheckpointManager
from verl_core.checkpoint.manifest import CheckpointInfo
from verl_core.checkpoint.save_job import SaveHandle

log = logging.getLogger(__name__)

__all__ = ["AsyncCheckpointer", "snapshot_state", "sync_device"]


class AsyncCheckpointer:
    """Background saves of one process through a :class:`CheckpointManager` (its
    ``async_save_distributed`` with ``dp=SINGLE``: the same snapshot, buffers and writer thread a
    data-parallel group uses).

    ``save()`` returns as soon as the snapshot is taken; ``wait()`` blocks until the background
    write committed and returns its :class:`CheckpointInfo`. An error of a background save is
    re-raised by the next ``save()`` or ``wait()`` (exactly once). Use as a context manager, or
    call ``close()`` before the process exits, so the last save completes.
    """

    def __init__(self, manager: CheckpointManager):
        self.manager = manager
        self._handle: Optional[SaveHandle] = None
        self._lock = threading.Lock()
        self.last_blocking_s = 0.0
        """Seconds the last ``save()`` blocked its caller (waiting for the previous save plus
        the snapshot)."""
        self.last_info: Optional[CheckpointInfo] = None

    def __enter__(self) -> "AsyncCheckpointer":
        return self

    def __exit__(self, *exc) -> None:
        self.close(raise_errors=exc[0] is None)

    def _collect(self) -> Optional[CheckpointInfo]:
        """Wait for the pending save; re-raise its error once."""
        handle, self._handle = self._handle, None
        if handle is not None:
            self.last_info = handle.wait()  # raises the background error
        return self.last_info

    def save(self, step: int, groups: Mapping[str, Any], meta: Optional[Mapping] = None,
             **save_kwargs: Any) -> None:
        """Snapshot ``groups``/``meta`` and save them in the background, as
        ``manager.save(step, groups, meta, **save_kwargs)`` would (``config_hash``,
        ``shared_groups``). State that cannot be checkpointed is refused here, before returning."""
        t0 = time.perf_counter()
        with self._lock:
            self._collect()  # the previous save is done with the buffers
            self._handle = self.manager.async_save_distributed(step, groups, meta, **save_kwargs)
        self.last_blocking_s = time.perf_counter() - t0

    def wait(self) -> Optional[CheckpointInfo]:
        """Block until the pending save is done; return the last committed info (re-raises the
        background error, if any)."""
        with self._lock:
            return self._collect()

    @property
    def pending(self) -> bool:
        return self._handle is not None and not self._handle.done()

    def close(self, raise_errors: bool = True) -> None:
        try:
            if raise_errors:
                self.wait()
            elif self._handle is not None:
                try:
                    self._handle.wait()
                except Exception as e:  # noqa: BLE001 - already failing; just log it
                    log.error("background checkpoint failed: %s", e)
                self._handle = None
        finally:
            self.manager.close()
