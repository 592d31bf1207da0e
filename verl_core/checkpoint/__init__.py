"""Durable checkpoints: content-addressed chunks, verified manifests, async save, HF export.

Modules (imports point down): ``store`` (bytes over fsspec) <- ``tensors`` (safetensors chunks)
and ``state`` (nested state without pickle) <- ``manager`` (manifests, commit, load, retention)
<- ``async_save`` and ``hf_export``. ``python -m verl_core.checkpoint`` lists, verifies and exports.

Typical use::

    store = RunStore("s3://bucket/run-1")                      # or a local folder
    ckpt = CheckpointManager(store, keep_last=3, keep_every=100)
    ckpt.save(step, {"policy": model.state_dict(), "optimizer": opt.state_dict(),
                     "scheduler": sched.state_dict(), "rng": capture_rng_state()},
              meta={"hf_config": model.config.to_dict(), "sampler": sampler.state_dict()},
              config_hash=cfg.config_hash())
    groups, meta, info = ckpt.load("auto")                     # newest *valid* checkpoint
"""

from verl_core.checkpoint.async_save import AsyncCheckpointer, snapshot_state
from verl_core.checkpoint.errors import (
    CheckpointNotFoundError,
    CheckpointSaveError,
    CorruptObjectError,
    IncompleteCheckpointError,
    NoValidCheckpointError,
    PermanentError,
    StoreFullError,
    StoreUnavailableError,
    TransientError,
    UnsafeManifestError,
    VerlError,
)
from verl_core.checkpoint.hf_export import export_hf, load_tokenizer_files, store_tokenizer
from verl_core.checkpoint.manager import CheckpointInfo, CheckpointManager, open_checkpoint
from verl_core.checkpoint.state import (
    capture_rng_state,
    flatten_state,
    restore_rng_state,
    unflatten_state,
)
from verl_core.checkpoint.store import NotFoundError, RunStore, StorePermissionError
from verl_core.checkpoint.tensors import RowShard, load_tensors, save_tensors

__all__ = [
    "RunStore", "CheckpointManager", "CheckpointInfo", "AsyncCheckpointer", "open_checkpoint",
    "save_tensors", "load_tensors", "RowShard", "flatten_state", "unflatten_state",
    "capture_rng_state", "restore_rng_state", "snapshot_state", "export_hf", "store_tokenizer",
    "load_tokenizer_files",
    "VerlError", "TransientError", "PermanentError", "StoreUnavailableError", "CorruptObjectError",
    "UnsafeManifestError", "CheckpointNotFoundError", "NoValidCheckpointError",
    "IncompleteCheckpointError", "CheckpointSaveError", "NotFoundError", "StorePermissionError",
    "StoreFullError",
]
