"""Garbage collection keeps a run store hermetic (docs/design.md#rule-6-the-run-store-is-hermetic):
besides kept checkpoints, it keeps every object the assets index, the lineage log, a pending phase
output, a shared group or the tokenizer names, and it stops rather than delete on a partial view of
those roots."""

import pytest
import torch

from verl_core.checkpoint import CheckpointManager
from verl_core.checkpoint.__main__ import main as checkpoint_cli
from verl_core.errors import CorruptObjectError


def _objects(store) -> set[str]:
    return {sha for sha, _, _ in store.iter_objects()}


def test_gc_keeps_assets_lineage_pending_and_shared_objects(store):
    manager = CheckpointManager(store, keep_last=1, gc_grace_s=0.0)
    roots = {
        # the assets index: model files by path, dataset files by position
        "assets": store.put_bytes(b"model.safetensors bytes"),
        "train": store.put_bytes(b"train parquet"),
        "val": store.put_bytes(b"val parquet"),
        "lineage": store.put_bytes(b"the batch update 3 consumed"),
        "pending": store.put_bytes(b"a reward batch no update has consumed yet"),
        "tokenizer": store.put_bytes(b"tokenizer.json bytes"),
    }
    store.put_json("assets/" + "a" * 64, {"model": {"model.safetensors": roots["assets"]},
                                          "train": [roots["train"]], "val": [roots["val"]],
                                          "id": "a" * 64})
    store.put_json("lineage/0123456789abcdef/000000003", {"step": 3, "batch": roots["lineage"]})
    store.put_json("pending/0123456789abcdef/000000004-reward", {"batch": roots["pending"]})
    store.put_json("shared/tokenizer", {"files": {"tokenizer.json": {"sha": roots["tokenizer"]}},
                                        "objects": {roots["tokenizer"]: 20}})
    orphan = store.put_bytes(b"a batch of a crashed attempt that nothing names")
    for step in (1, 2):  # retention (keep_last=1) deletes step 1 and collects garbage
        manager.save(step, {"policy": {"w": torch.full((4,), float(step))}})
    kept = set(manager.read_manifest("latest")[1]["objects"])
    assert _objects(store) == kept | set(roots.values())
    assert orphan not in _objects(store)


def test_gc_cli_with_zero_grace_keeps_what_a_resume_needs(store):
    lineage = store.put_bytes(b"batch of update 0")
    store.put_json("lineage/0123456789abcdef/000000000", {"step": 0, "batch": lineage})
    orphan = store.put_bytes(b"unreferenced")
    assert checkpoint_cli(["gc", store.uri, "--grace-s", "0"]) == 0
    assert _objects(store) == {lineage}


def test_gc_stops_when_a_root_is_unreadable(store):
    """Deleting on a partial view of the roots could delete what a resume needs."""
    batch = store.put_bytes(b"batch of update 5")
    store.put_json("lineage/0123456789abcdef/000000005", {"step": 5, "batch": batch})
    with open(store.doc_path("lineage/0123456789abcdef/000000005"), "wb") as f:
        f.write(b'{"step": 5, "batch": "')  # torn write
    store.put_bytes(b"unreferenced")
    with pytest.raises(CorruptObjectError, match="000000005"):
        CheckpointManager(store, gc_grace_s=0.0).gc()
    assert batch in _objects(store) and len(_objects(store)) == 2


def test_a_root_may_name_an_object_before_it_exists(store):
    """Writers put a root before its object (so a concurrent gc, which lists objects first, never
    sees the object without its root); a root naming a missing object is harmless."""
    missing = "b" * 64
    store.put_json("pending/0123456789abcdef/000000000-rollout", {"batch": missing})
    assert CheckpointManager(store, gc_grace_s=0.0).gc()["deleted"] == 0
