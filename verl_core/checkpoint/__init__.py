"""Durable checkpoints: content-addressed chunks, verified manifests, async save, HF export.

Built on the run store (``verl_core.store``: bytes over fsspec, sha256/BLAKE3 names, which also
holds batches, assets, lineage and logs). Modules (imports point down): ``tensors``
(safetensors chunks) and ``state`` (nested state without pickle) <- ``dcp`` (the run store as
torch.distributed.checkpoint's storage layer) <- ``manager`` (manifests, commit, load, retention,
the collective save/load of a data-parallel group) <- ``async_save`` and ``hf_export``.
``python -m verl_core.checkpoint`` lists, verifies and exports.

Typical use::

    store = RunStore("s3://bucket/run-1")                      # or a local folder
    ckpt = CheckpointManager(store, keep_last=3, keep_every=100)
    ckpt.save(step, {"policy": model.state_dict(), "optimizer": opt.state_dict(),
                     "scheduler": sched.state_dict(), "rng": capture_rng_state()},
              meta={"hf_config": model.config.to_dict(), "sampler": sampler.state_dict()},
              config_hash=cfg.trajectory_hash())
    groups, meta, info = ckpt.load("auto")                     # newest *valid* checkpoint

Every rank of an FSDP2 group (``dp`` from ``verl_core.training.dist``)::

    state = {"policy": get_model_state_dict(model),
             "optimizer": get_optimizer_state_dict(model, optim)}
    info = ckpt.save_distributed(step, state, meta, config_hash=h, dp=dp)   # or async_save_…
    meta, info = ckpt.load_distributed("auto", state, dp=dp)   # any W: DCP reshards, in place
    set_model_state_dict(model, state["policy"]); set_optimizer_state_dict(model, optim, …)
"""

from verl_core.lazy import exports

# imported on first use (verl_core/lazy.py): the run's config reads checkpoint/config.py without
# paying for torch.distributed.checkpoint
__all__, __getattr__ = exports(__name__, {
    "verl_core.checkpoint.async_save": ("AsyncCheckpointer", "snapshot_state"),
    "verl_core.errors": ("CheckpointDisagreementError", "CheckpointNotFoundError",
                         "CheckpointSaveError", "CorruptObjectError", "NoValidCheckpointError",
                         "PermanentError", "StoreFullError", "StoreUnavailableError",
                         "TransientError", "UnsafeManifestError", "VerlError"),
    "verl_core.checkpoint.hf_export": ("export_hf", "load_tokenizer_files", "store_tokenizer"),
    "verl_core.checkpoint.manager": ("CheckpointManager", "open_checkpoint"),
    "verl_core.checkpoint.manifest": ("CheckpointInfo",),
    "verl_core.checkpoint.save_job": ("SaveHandle",),
    "verl_core.checkpoint.state": ("capture_rng_state", "flatten_state", "restore_rng_state",
                                   "unflatten_state"),
    "verl_core.store": ("NotFoundError", "RunStore", "StorePermissionError"),
    "verl_core.checkpoint.tensors": ("load_tensors", "save_tensors"),
})
