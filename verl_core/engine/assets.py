"""Run assets (model folder, dataset files, reward model folder) stored once in the run store,
materialised anywhere.

A run must be hermetic: every phase, on any pod, reads the *same* bytes the run was prepared with.
So ``publish_assets`` copies the starting model folder and the dataset parquet files into the
store as content-addressed objects and returns a small JSON-able index; ``materialize_assets``
rebuilds a local folder from it in a per-user cache, so a worker that already has them pays
nothing.

The cache is a convenience, never a source of truth
(docs/design.md#rule-6-the-run-store-is-hermetic): it is private to the user (mode 0700, owned by
them), the size of every file is checked on every use, and the first use in a process re-hashes
every file against the store's hashes. A cached copy that fails either check is thrown away and
filled again from the store.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
import threading

import fsspec

from verl_core.layout import asset_index_doc, asset_record_doc
from verl_core.store import RunStore, check_sha256, resolve_storage_options, sha256_hex
from verl_core.errors import CorruptObjectError, PermanentError
from verl_core.assets import Assets
from verl_core.local_cache import AssetCacheError, cache_root  # noqa: F401  (their home before)
from verl_core.local_cache import file_sha256 as _file_sha
from verl_core.local_cache import files_under as _files_under

log = logging.getLogger(__name__)

_COMPLETE = ".complete"  # written last into a filled entry: {relpath: [sha, size]}
_VERIFIED: set[str] = set()  # cache entries re-hashed by this process
_LOCK = threading.Lock()


def index_assets(assets: Assets, storage_options: dict | None = None
                 ) -> tuple[dict, dict[str, bytes], dict[str, dict[str, str]]]:
    """Hash the model folder and the dataset files without writing anything. Returns the asset
    index (see :func:`publish_assets`), the files' bytes by sha, and the files by their source
    names: ``{"model": {"<folder>/<relpath>": sha}, "train": {uri: sha}, "val": {uri: sha}}``
    (+ ``"reward_model"``, ``"judge_template"``), what :func:`check_pinned` compares and names."""
    blobs: dict[str, bytes] = {}

    def add(data: bytes) -> str:
        sha = sha256_hex([data])
        blobs[sha] = data
        return sha

    def folder(path: str) -> dict[str, str]:
        out = {}
        for rel in _files_under(path):
            with open(os.path.join(path, rel), "rb") as f:
                out[rel] = add(f.read())
        return out

    def read(uri: str) -> bytes:
        with fsspec.open(uri, "rb", **resolve_storage_options(uri, storage_options)) as f:
            return f.read()

    model = folder(assets.model_path) if assets.model_path else {}  # none built: see prepare_run
    train = [add(read(u)) for u in assets.train_files]
    val = [add(read(u)) for u in assets.val_files]
    index = {"model": model, "train": train, "val": val}
    sources = {"model": {os.path.join(assets.model_path, r): h for r, h in model.items()},
               "train": dict(zip(assets.train_files, train)),
               "val": dict(zip(assets.val_files, val))}
    if assets.reward_model_path:
        index["reward_model"] = folder(assets.reward_model_path)
        sources["reward_model"] = {os.path.join(assets.reward_model_path, r): h
                                   for r, h in index["reward_model"].items()}
    if assets.judge_template_path:  # a generative judge's prompt: pinned as its folder is
        with open(assets.judge_template_path, "rb") as f:
            index["judge_template"] = add(f.read())
        sources["judge_template"] = {assets.judge_template_path: index["judge_template"]}
    if assets.teacher_path:  # on-policy distillation's teacher, pinned as the model is
        index["teacher"] = folder(assets.teacher_path)
        sources["teacher"] = {os.path.join(assets.teacher_path, r): h
                              for r, h in index["teacher"].items()}
    index["id"] = hashlib.sha256(json.dumps(index, sort_keys=True).encode()).hexdigest()
    return index, blobs, sources


def publish_assets(store: RunStore, assets: Assets, storage_options: dict | None = None,
                   indexed: tuple | None = None) -> dict:
    """Copy the model folder and the dataset files into ``store``. Returns the asset index:
    ``{"model": {relpath: sha}, "train": [sha...], "val": [sha...], "id": sha-of-index}``, plus
    ``"reward_model": {relpath: sha}`` when the assets have one (``reward_model.enable``; absent
    otherwise, so such an index and its id are what they were before reward models).
    ``indexed``: :func:`index_assets`'s answer, when the caller has it already.

    The index (a gc root) is written before the objects it names, so a concurrent garbage
    collection can never see one of them without its root. If the copy fails, an index this
    call created is removed again: a failed prepare keeps nothing alive (gc may delete what it
    copied)."""
    index, blobs, _ = indexed or index_assets(assets, storage_options)
    created = store.put_json(asset_index_doc(index["id"]), index, create_only=True)
    try:
        store.map(lambda kv: store.put_parts([kv[1]], sha=kv[0]), list(blobs.items()))
    except BaseException:
        if created:
            unpublish_assets(store, index)
        raise
    return index


def unpublish_assets(store: RunStore, index: dict) -> None:
    """Remove the index doc of ``index`` (its objects become garbage unless a recorded run or
    another root names them): what a prepare that failed after :func:`publish_assets` undoes."""
    try:
        store.delete_json(asset_index_doc(index["id"]))
    except Exception as e:  # noqa: BLE001 - the original failure is what the caller reports
        log.warning("could not remove the asset index %s of a failed prepare: %s", index["id"], e)


# ---------------------------------------------------------------------- assets pinned to a run
class AssetsChangedError(PermanentError):
    """A dataset or model file changed since the run (this trajectory) recorded its assets:
    resuming would mix other data (or another reference model) into the same trajectory."""


GIVEN_KINDS = ("model", "train", "val", "reward_model", "judge_template", "teacher")
JUDGE_TEMPLATE = "judge/template.txt"
"""Where a generative judge's prompt template lies in a materialised asset entry."""
SOURCE_MODEL = "source_model"
"""The kind under which a trajectory records the folder its model was made from when the run's
model is a format-warm-started copy of the one you gave (``model.format_warmup_steps``): that
folder, not the generated copy, is what a resume checks for changes."""


def source_files(path: str) -> dict[str, str]:
    """``{"<folder>/<relpath>": sha256}`` for every file of a model folder you gave."""
    return {os.path.join(path, rel): _file_sha(os.path.join(path, rel))
            for rel in _files_under(path)}


def _record_doc(trajectory: str) -> str:
    # under assets/, a gc root folder: a recorded run's files are never collected
    return asset_record_doc(check_sha256(trajectory, "trajectory hash"))


def has_record(store: RunStore, trajectory: str) -> bool:
    """Whether ``trajectory`` recorded its assets when it first ran (:func:`record_assets`)."""
    return store.has_json(_record_doc(trajectory))


def check_pinned(store: RunStore, trajectory: str, given: tuple[str, ...],
                 sources: dict[str, dict[str, str]], index: dict, assets_id: str = ""
                 ) -> dict | None:
    """The asset index this trajectory recorded when it first ran (None: it has none yet), after
    checking that every file the user gave (``given``: the kinds of :data:`GIVEN_KINDS` that came
    from the config, not generated) still has the content recorded then. Generated assets (the
    synthetic data, the warm-started tiny model) are taken from the record, never regenerated
    into another trajectory's files. Raises :class:`AssetsChangedError` naming the file, the old
    and new sha256 and the two ways on. ``assets_id`` (``data.assets_id``): the index id a new
    trajectory was asked for; without a record yet, the files must hash to it."""
    record = store.get_json(_record_doc(trajectory), default=None)
    if record is None:
        if assets_id and assets_id != index["id"]:
            raise AssetsChangedError(
                f"data.assets_id={assets_id} names other files than the ones given now "
                f"(asset index {index['id']}): they changed again. Pass data.assets_id="
                f"{index['id']} to train on them as they are now, or use a new --run-name")
        return None
    changed = []
    for kind in given:
        old, new = record["files"].get(kind, {}), sources.get(kind, {})
        for name in sorted(set(old) | set(new)):
            if old.get(name) != new.get(name):
                changed.append(f"{name} (sha256 {old.get(name, 'absent')} -> "
                               f"{new.get(name, 'absent')})")
    if changed:
        more = f" and {len(changed) - 3} more" if len(changed) > 3 else ""
        raise AssetsChangedError(
            f"{store.uri}: {'; '.join(changed[:3])}{more} changed since this run recorded its "
            f"assets (asset index {record['index']}). Resuming would train the same trajectory "
            "on other files and load its reference model from them. Either start a new run "
            "(another --run-name), or train on the files as they are now as a new trajectory "
            "of this run: --overrides '{\"data.assets_id\": \"" + index["id"] + "\"}'")
    pinned = store.get_json(asset_index_doc(check_sha256(record["index"], "asset index id")))
    return pinned


def record_assets(store: RunStore, trajectory: str, index: dict,
                  sources: dict[str, dict[str, str]], fields: dict | None = None) -> None:
    """Record ``index`` as the assets of ``trajectory`` (once; a recorded run keeps its own),
    with the trajectory's config ``fields`` (what a changed command is compared against)."""
    doc = {"index": index["id"], "files": sources}
    if fields is not None:
        doc["trajectory"] = fields
    store.put_json(_record_doc(trajectory), doc, create_only=True)


def recorded_fields(store: RunStore, trajectory: str) -> dict | None:
    """The config fields ``trajectory`` recorded when it first ran; None for a record written
    before records held them, or none at all."""
    try:
        return store.get_json(_record_doc(trajectory), default={}).get("trajectory")
    except CorruptObjectError:  # only a message's detail depends on it
        return None


def _entries(index: dict) -> dict[str, str]:
    """``{path inside the cache entry: sha}`` for every file of the index."""
    out = {f"model/{rel}": sha for rel, sha in index["model"].items()}
    out.update({f"reward_model/{rel}": sha for rel, sha in index.get("reward_model", {}).items()})
    if "judge_template" in index:
        out[JUDGE_TEMPLATE] = index["judge_template"]
    out.update({f"teacher/{rel}": sha for rel, sha in index.get("teacher", {}).items()})
    for split in ("train", "val"):
        for i, sha in enumerate(index[split]):
            out[f"data/{split}-{i}.parquet"] = sha
    for rel, sha in out.items():
        check_sha256(sha, f"asset {rel}")
        parts = rel.split("/")
        if rel.startswith("/") or any(p in ("", ".", "..") for p in parts):
            raise PermanentError(f"asset index {index.get('id')}: unsafe file name {rel!r}")
    return out


def _check_entry(root: str, want: dict[str, str], rehash: bool) -> str | None:
    """Why the cached entry ``root`` cannot be used (None: it can). Sizes are checked against
    the record written at fill time, hashes (when ``rehash``) against the store's index."""
    try:
        with open(os.path.join(root, _COMPLETE)) as f:
            record = json.load(f)
    except (OSError, ValueError) as e:
        return f"its fill record is unreadable ({e})"
    if not isinstance(record, dict):
        return "its fill record is malformed"
    for rel, sha in want.items():
        rec = record.get(rel)
        if not isinstance(rec, list) or len(rec) != 2 or rec[0] != sha:
            return f"{rel} is not in its fill record"
        path = os.path.join(root, rel)
        try:
            size = os.path.getsize(path)
        except OSError:
            return f"{rel} is missing"
        if size != rec[1]:
            return f"{rel} has {size} bytes, {rec[1]} when filled"
        if rehash and _file_sha(path) != sha:
            return f"{rel} does not hash to {sha[:12]}… (changed since it was filled)"
    return None


def _fill(store: RunStore, cache: str, root: str, want: dict[str, str]) -> bool:
    """Fill ``root`` from the store (every object hash-verified as it is read). False when another
    process filled it first (theirs is then checked like any cached entry)."""
    tmp = tempfile.mkdtemp(prefix=".partial-", dir=cache)
    record = {}
    for rel, sha in want.items():
        data = store.get_bytes(sha, what=f"asset file {rel}")
        _write(os.path.join(tmp, rel), data)
        record[rel] = [sha, len(data)]
    with open(os.path.join(tmp, _COMPLETE), "w") as f:
        json.dump(record, f, sort_keys=True)
    try:
        os.replace(tmp, root)  # atomic: a reader sees all of it or nothing
        return True
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        return False


def materialize_assets(store: RunStore, index: dict) -> Assets:
    """Local folders holding the assets of ``index``, from the private cache (filled from the
    store when absent or failing its checks; see the module docstring)."""
    want = _entries(index)
    cache = cache_root()
    root = os.path.join(cache, check_sha256(index.get("id"), "asset index id"))
    with _LOCK:
        why = "absent"
        if os.path.exists(root):
            why = _check_entry(root, want, rehash=root not in _VERIFIED)
            if why is not None:
                log.warning("cached assets %s are not the run's (%s); filling them again from %s",
                            root, why, store.uri)
                _discard(cache, root)
        if why is not None and not _fill(store, cache, root, want):
            why = _check_entry(root, want, rehash=True)  # another process filled it first
            if why is not None:
                raise PermanentError(f"asset cache {root} was filled by another process and fails "
                                     f"its check ({why}); delete it and re-run")
        _VERIFIED.add(root)
    data = os.path.join(root, "data")
    return Assets(model_path=os.path.join(root, "model"),
                  train_files=[os.path.join(data, f"train-{i}.parquet")
                               for i in range(len(index["train"]))],
                  val_files=[os.path.join(data, f"val-{i}.parquet")
                             for i in range(len(index["val"]))],
                  reward_model_path=os.path.join(root, "reward_model")
                  if "reward_model" in index else "",
                  judge_template_path=os.path.join(root, JUDGE_TEMPLATE)
                  if "judge_template" in index else "",
                  teacher_path=os.path.join(root, "teacher") if "teacher" in index else "")


def _discard(cache: str, root: str) -> None:
    """Move a bad entry aside first (atomic), so no reader ever sees it half-deleted."""
    aside = tempfile.mkdtemp(prefix=".discard-", dir=cache)
    try:
        os.replace(root, os.path.join(aside, "entry"))
    except OSError:
        pass
    shutil.rmtree(aside, ignore_errors=True)


def _write(path: str, data: bytes) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(data)
