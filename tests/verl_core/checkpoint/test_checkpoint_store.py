"""RunStore: content addressing, verification, safe names, incarnation id, append-only logs."""

from __future__ import annotations

import hashlib
import os
import threading

import pytest

from verl_core.checkpoint import (
    CorruptObjectError,
    NotFoundError,
    RunStore,
    StoreUnavailableError,
    TransientError,
    UnsafeManifestError,
)
from verl_core.errors import PermanentError


def test_put_get_roundtrip_and_dedupe(store):
    sha = store.put_bytes(b"hello")
    assert sha == hashlib.sha256(b"hello").hexdigest()
    assert store.get_bytes(sha) == b"hello"
    assert os.path.exists(f"{store.root}/objects/{sha[:2]}/{sha}")
    again = store.put_bytes(b"hello")  # already there: not written again
    assert again == sha
    assert store.stats.objects_written == 1 and store.stats.objects_skipped == 1
    assert store.stats.bytes_written == 5


def test_flipped_byte_and_missing_object_name_the_object(store):
    sha = store.put_bytes(b"x" * 100)
    path = store.object_path(sha)
    data = bytearray(open(path, "rb").read())
    data[10] ^= 1
    open(path, "wb").write(bytes(data))
    with pytest.raises(CorruptObjectError, match=sha) as e:
        store.get_bytes(sha)
    assert isinstance(e.value, PermanentError) and e.value.sha == sha
    os.unlink(path)
    with pytest.raises(CorruptObjectError, match=f"{sha}.*missing"):
        store.get_bytes(sha)


@pytest.mark.parametrize("bad", ["../etc/passwd", "/abs", "ab" * 32 + "/x", "AB" * 32, "a" * 63,
                                 ""])
def test_object_names_must_be_hex_sha(store, bad):
    with pytest.raises(UnsafeManifestError):
        store.get_bytes(bad)


@pytest.mark.parametrize("bad", ["../x", "a/../b", "/etc/x", ".hidden", "a//b", "a/.b", ""])
def test_doc_names_cannot_escape(store, bad):
    with pytest.raises(UnsafeManifestError):
        store.put_json(bad, {})
    with pytest.raises(UnsafeManifestError):
        store.get_json(bad)


def test_json_docs(store):
    store.put_json("shared/thing", {"a": [1, 2], "b": "c"})
    assert store.get_json("shared/thing") == {"a": [1, 2], "b": "c"}
    assert store.list_json("shared") == ["shared/thing"]
    assert store.get_json("nope", default=None) is None
    with pytest.raises(NotFoundError):
        store.get_json("nope")
    assert store.put_json("shared/thing", {"x": 1}, create_only=True) is False
    assert store.get_json("shared/thing")["a"] == [1, 2]
    with open(store.doc_path("shared/broken"), "w") as f:
        f.write("{not json")
    with pytest.raises(CorruptObjectError, match="shared/broken"):
        store.get_json("shared/broken")
    # no temp files are left behind by atomic writes
    assert not [n for n in os.listdir(f"{store.root}/shared") if n.startswith(".tmp")]


def test_incarnation_id_is_stable_and_changes_when_store_is_recreated(tmp_path):
    root = str(tmp_path / "s")
    a = RunStore(root).incarnation_id
    assert RunStore(root).incarnation_id == a  # read back, not regenerated
    import shutil

    shutil.rmtree(root)
    assert RunStore(root).incarnation_id != a  # a recreated store misses old cache entries


def test_append_log_is_append_only_and_survives_torn_line(store):
    threads = [threading.Thread(target=lambda i=i: [store.append_log("events", {"t": i, "k": k})
                                                    for k in range(50)]) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    recs = store.read_log("events")
    assert len(recs) == 200 and all(set(r) == {"t", "k"} for r in recs)
    with open(f"{store.root}/logs/events.jsonl", "a") as f:
        f.write('{"torn": ')  # a writer killed mid-record
    assert len(store.read_log("events")) == 200
    assert store.read_log("other") == []


def test_append_after_a_torn_line_starts_a_new_line(store):
    """A record appended after a torn tail is not glued to it (and lost with it) on read."""
    store.append_log("phases", {"k": 0})
    with open(f"{store.root}/logs/phases.jsonl", "a") as f:
        f.write('{"torn": ')  # a writer killed mid-record
    store.append_log("phases", {"k": 1})
    store.append_log("phases", {"k": 2})  # a whole tail: no extra newline
    assert store.read_log("phases") == [{"k": 0}, {"k": 1}, {"k": 2}]
    with open(f"{store.root}/logs/phases.jsonl") as f:
        assert f.read().splitlines() == ['{"k":0}', '{"torn": ', '{"k":1}', '{"k":2}']


def test_io_errors_are_transient(store, monkeypatch):
    import errno

    def eio(*a, **k):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(os, "replace", eio)
    with pytest.raises(StoreUnavailableError, match="I/O error") as e:
        store.put_json("x", {"a": 1})
    assert isinstance(e.value, TransientError)
    assert not [n for n in os.listdir(store.root) if n.startswith(".tmp")]  # temp file removed


def test_full_disk_is_permanent_and_keeps_latest(tmp_path, monkeypatch):
    import errno

    import torch

    from verl_core.checkpoint import CheckpointManager, PermanentError, StoreFullError

    mgr = CheckpointManager(RunStore(str(tmp_path / "s")))
    first = mgr.save(1, {"policy": {"w": torch.zeros(8, 8)}}, {})
    real_replace = os.replace

    def enospc(src, dst, *a, **k):
        if "/objects/" in dst:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_replace(src, dst, *a, **k)

    monkeypatch.setattr(os, "replace", enospc)
    with pytest.raises(StoreFullError, match="store is full.*keep_last.*gc") as e:
        mgr.save(2, {"policy": {"w": torch.ones(8, 8)}}, {})
    assert isinstance(e.value, PermanentError)  # retrying cannot free space: fail fast
    monkeypatch.undo()
    assert mgr.resolve("latest") == first.name and mgr.load("auto")[2] == first


def test_any_fsspec_url_works(tmp_path):
    """The generic (non-local, non-S3) code path, through fsspec's in-memory filesystem."""
    import uuid

    import torch

    from verl_core.checkpoint import CheckpointManager

    store = RunStore(f"memory://run-{uuid.uuid4().hex}")
    assert not store.is_local
    mgr = CheckpointManager(store, keep_last=1, gc_grace_s=0.0)
    w = torch.randn(30, 20)
    mgr.save(1, {"policy": {"w": w}}, {"a": 1})
    info = mgr.save(2, {"policy": {"w": w * 2}}, {"a": 2})
    groups, meta, got = mgr.load("auto")
    assert got == info and torch.equal(groups["policy"]["w"], w * 2) and meta == {"a": 2}
    assert mgr.verify("latest") == [] and len(mgr.list_checkpoints()) == 1
    assert len(list(store.iter_objects())) == 2  # step 1's objects were collected
    store.append_log("l", {"x": 1})
    assert store.read_log("l") == [{"x": 1}]
