"""Asynchronous checkpointing: snapshot to CPU memory now, write in the background.

What belongs here: the snapshot and the single background writer. The commit protocol itself is
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
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Mapping, Optional

import numpy as np
import torch

from verl_core.checkpoint.manager import CheckpointInfo, CheckpointManager
from verl_core.checkpoint.state import from_json, to_json
from verl_core.checkpoint.tensors import RowShard, _dtensor_type, as_row_shard

log = logging.getLogger(__name__)

__all__ = ["AsyncCheckpointer", "snapshot_state"]


def _copy_into(dst: torch.Tensor, src: torch.Tensor) -> None:
    """CPU -> CPU: one single-threaded memcpy through numpy. torch's intra-op-parallel ``copy_`` of
    many medium tensors is up to 20x slower on a busy machine (threads wait on each other)."""
    if src.device.type == "cpu" and src.is_contiguous():
        np.copyto(dst.reshape(-1).view(torch.uint8).numpy(),
                  src.reshape(-1).view(torch.uint8).numpy())
    else:
        dst.copy_(src, non_blocking=src.device.type == "cuda")


def _copy_tensor(t: torch.Tensor, key: Any = None, pool: Optional[dict] = None) -> torch.Tensor:
    t = t.detach()
    buf = pool.get(key) if pool is not None else None
    if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
        buf = torch.empty(t.shape, dtype=t.dtype, device="cpu",
                          pin_memory=t.device.type == "cuda" and torch.cuda.is_available())
        if pool is not None:
            pool[key] = buf
    _copy_into(buf, t)
    return buf


def snapshot_state(obj: Any, pool: Optional[dict] = None, _path: tuple = ()) -> Any:
    """Deep copy of nested state with every tensor copied to CPU (DTensors become :class:`RowShard`
    of their local rows), so training may modify the originals right away.

    ``pool`` (``{path: tensor}``) lets repeated snapshots reuse the same CPU buffers: after the
    first save a snapshot is a plain memcpy (no allocation, no page faults). The caller must not
    reuse a pool while a save that reads its buffers is still running."""
    if isinstance(obj, RowShard):
        return RowShard(_copy_tensor(obj.local, _path, pool), obj.global_shape, obj.row_offset)
    if isinstance(obj, torch.Tensor):
        DTensor = _dtensor_type()
        if DTensor is not None and isinstance(obj, DTensor):
            rs = as_row_shard(obj)
            return RowShard(_copy_tensor(rs.local, _path, pool), rs.global_shape, rs.row_offset)
        return _copy_tensor(obj, _path, pool)
    if isinstance(obj, np.ndarray):
        return obj.copy()
    if isinstance(obj, Mapping):
        return {k: snapshot_state(v, pool, _path + (k,)) for k, v in obj.items()}
    if isinstance(obj, list):
        return [snapshot_state(v, pool, _path + (i,)) for i, v in enumerate(obj)]
    if isinstance(obj, tuple):
        return tuple(snapshot_state(v, pool, _path + (i,)) for i, v in enumerate(obj))
    return obj  # immutable scalars; anything else is refused by flatten_state in the writer


def _sync_cuda() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


class AsyncCheckpointer:
    """Background saves through a :class:`CheckpointManager`.

    ``save()`` returns as soon as the snapshot is taken; ``wait()`` blocks until the background
    write committed and returns its :class:`CheckpointInfo`. An error of a background save is
    re-raised by the next ``save()`` or ``wait()`` (exactly once). Use as a context manager, or
    call ``close()`` before the process exits, so the last save completes.
    """

    def __init__(self, manager: CheckpointManager, *, reuse_buffers: bool = True):
        self.manager = manager
        self._pool: Optional[dict] = {} if reuse_buffers else None
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="async-checkpoint")
        self._future: Optional[Future] = None
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
        fut, self._future = self._future, None
        if fut is None:
            return self.last_info
        result = fut.result()  # raises the background error
        if isinstance(result, CheckpointInfo):
            self.last_info = result
        return self.last_info

    def save(self, step: int, groups: Mapping[str, Any], meta: Optional[Mapping] = None,
             **save_kwargs: Any) -> None:
        """Snapshot ``groups``/``meta`` and save them in the background with
        ``manager.save(step, groups, meta, **save_kwargs)``."""
        t0 = time.perf_counter()
        with self._lock:
            self._collect()  # the previous save is done with the buffers
            snap = {g: snapshot_state(v, self._pool, (g,)) for g, v in groups.items()}
            _sync_cuda()  # non_blocking device->host copies must land before we return
            meta_copy = from_json(to_json(dict(meta or {})))  # JSON-able now, immutable later
            self._future = self._executor.submit(self.manager.save, step, snap, meta_copy,
                                             **save_kwargs)
        self.last_blocking_s = time.perf_counter() - t0

    def save_shard(self, step: int, shard_id: int, num_shards: int, groups: Mapping[str, Any],
                   **kwargs: Any) -> None:
        """Background ``manager.save_shard``; call ``wait()`` (all ranks) before ``commit``."""
        t0 = time.perf_counter()
        with self._lock:
            self._collect()
            snap = {g: snapshot_state(v, self._pool, (g,)) for g, v in groups.items()}
            _sync_cuda()
            self._future = self._executor.submit(self.manager.save_shard, step, shard_id,
                                                 num_shards, snap, **kwargs)
        self.last_blocking_s = time.perf_counter() - t0

    def wait(self) -> Optional[CheckpointInfo]:
        """Block until the pending save is done; return the last committed info (re-raises the
        background error, if any)."""
        with self._lock:
            return self._collect()

    @property
    def pending(self) -> bool:
        return self._future is not None and not self._future.done()

    def close(self, raise_errors: bool = True) -> None:
        try:
            if raise_errors:
                self.wait()
            elif self._future is not None:
                try:
                    self._future.result()
                except Exception as e:  # noqa: BLE001 - already failing; just log it
                    log.error("background checkpoint failed: %s", e)
                self._future = None
        finally:
            self._executor.shutdown(wait=True)
