"""Run assets (model folder, dataset files) stored once in the run store, materialised anywhere.

A run must be hermetic: every phase, on any pod, reads the *same* bytes the run was prepared with.
So ``publish_assets`` copies the starting model folder and the dataset parquet files into the
store as content-addressed objects and returns a small JSON-able index; ``materialize_assets``
rebuilds a local folder from it (verifying every hash) in a per-host cache, so a worker that
already has them pays nothing.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile

import fsspec

from verl_core.checkpoint.store import RunStore
from verl_core.trainer import Assets

_CACHE = os.environ.get("VERL_ASSET_CACHE", os.path.join(tempfile.gettempdir(), "verl-assets"))


def _files_under(folder: str) -> list[str]:
    out = []
    for dirpath, _, files in os.walk(folder):
        for f in files:
            out.append(os.path.relpath(os.path.join(dirpath, f), folder))
    return sorted(out)


def publish_assets(store: RunStore, assets: Assets, storage_options: dict | None = None) -> dict:
    """Copy the model folder and the dataset files into ``store``. Returns the asset index:
    ``{"model": {relpath: sha}, "train": [sha...], "val": [sha...], "id": sha-of-index}``."""
    model = {}
    for rel in _files_under(assets.model_path):
        with open(os.path.join(assets.model_path, rel), "rb") as f:
            model[rel] = store.put_bytes(f.read())

    def put_file(uri: str) -> str:
        with fsspec.open(uri, "rb", **(storage_options or {})) as f:
            return store.put_bytes(f.read())

    index = {"model": model, "train": [put_file(u) for u in assets.train_files],
             "val": [put_file(u) for u in assets.val_files]}
    index["id"] = hashlib.sha256(json.dumps(index, sort_keys=True).encode()).hexdigest()
    store.put_json(f"assets/{index['id']}", index)
    return index


def materialize_assets(store: RunStore, index: dict) -> Assets:
    """Local folders holding the assets of ``index`` (hash-verified on first use, then cached)."""
    root = os.path.join(_CACHE, index["id"])
    done = os.path.join(root, ".complete")
    if not os.path.exists(done):
        tmp = tempfile.mkdtemp(prefix=".partial-", dir=_ensure(_CACHE))
        for rel, sha in index["model"].items():
            _write(os.path.join(tmp, "model", rel), store.get_bytes(sha, what=f"model file {rel}"))
        for split in ("train", "val"):
            for i, sha in enumerate(index[split]):
                _write(os.path.join(tmp, "data", f"{split}-{i}.parquet"),
                       store.get_bytes(sha, what=f"{split} dataset file {i}"))
        open(os.path.join(tmp, ".complete"), "w").close()
        try:
            os.replace(tmp, root)  # atomic: a reader sees all of it or nothing
        except OSError:  # another process finished first: theirs is identical
            shutil.rmtree(tmp, ignore_errors=True)
    data = os.path.join(root, "data")
    return Assets(model_path=os.path.join(root, "model"),
                  train_files=[os.path.join(data, f"train-{i}.parquet")
                               for i in range(len(index["train"]))],
                  val_files=[os.path.join(data, f"val-{i}.parquet")
                             for i in range(len(index["val"]))])


def _ensure(path: str) -> str:
    os.makedirs(path, exist_ok=True)
    return path


def _write(path: str, data: bytes) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(data)
