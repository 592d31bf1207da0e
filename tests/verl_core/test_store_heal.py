"""Damaged store objects and docs are set aside and rewritten (issue 21 item 2): a write of the
same content never trusts an object just because its size matches, a reader can quarantine what
it found damaged, and nothing intact is ever moved."""
import json
import os

import pytest

from verl_core.errors import CorruptObjectError
from verl_core.store import RunStore, sha256_hex
from tests.damage import flip_bytes


@pytest.fixture
def store(tmp_path):
    return RunStore(str(tmp_path / "store"), fsync=False)


def _flip(path, n=64):
    flip_bytes(path, n, at=16)


def _quarantined(store):
    d = os.path.join(store.root, "quarantine")
    return sorted(os.listdir(d)) if os.path.isdir(d) else []


def test_same_size_damaged_object_is_rewritten_by_put_parts(store):
    data = os.urandom(4096)
    sha, size, written = store.put_parts([data])
    assert written and size == 4096
    _flip(store.object_path(sha))
    assert os.path.getsize(store.object_path(sha)) == size  # the size cannot tell
    with pytest.raises(CorruptObjectError):
        store.get_bytes(sha)

    assert store.put_parts([data]) == (sha, size, True)  # rewritten, not skipped
    assert store.get_bytes(sha) == data
    (moved,) = _quarantined(store)  # the damaged bytes are kept for inspection
    assert moved.startswith(sha)
    assert store.stats.objects_written == 2 and store.stats.objects_skipped == 0


def test_intact_object_is_still_skipped_and_opt_out_trusts_the_size(store):
    data = b"x" * 1000
    sha, _, _ = store.put_parts([data])
    assert store.put_parts([data]) == (sha, 1000, False)  # verified intact: skipped
    _flip(store.object_path(sha), n=8)
    # checkpoint chunks opt out (their loads and `verify --repair` quarantine instead)
    assert store.put_parts([data], verify_existing=False) == (sha, 1000, False)
    assert _quarantined(store) == []


def test_get_bytes_quarantines_a_damaged_object_when_asked(store):
    data = os.urandom(512)
    sha = store.put_bytes(data)
    _flip(store.object_path(sha))
    with pytest.raises(CorruptObjectError) as plain:
        store.get_bytes(sha)
    assert plain.value.quarantined is None and store.has_object(sha)  # a plain read moves nothing

    with pytest.raises(CorruptObjectError) as e:
        store.get_bytes(sha, quarantine=True, what="batch")
    assert e.value.quarantined and os.path.exists(e.value.quarantined)
    assert "moved to" in str(e.value) and "batch" in str(e.value)
    assert not store.has_object(sha)
    assert store.put_bytes(data) == sha and store.get_bytes(sha) == data  # written afresh


def test_truncated_doc_is_quarantined_by_a_reader_that_asks(store):
    store.put_json("lineage/abc/000000002", {"step": 2, "batch": sha256_hex([b"b"])})
    path = store.doc_path("lineage/abc/000000002")
    raw = open(path, "rb").read()
    with open(path, "wb") as f:
        f.write(raw[:len(raw) // 2])  # torn: half a JSON doc
    with pytest.raises(CorruptObjectError) as plain:
        store.get_json("lineage/abc/000000002")
    assert plain.value.quarantined is None and store.has_json("lineage/abc/000000002")

    with pytest.raises(CorruptObjectError) as e:
        store.get_json("lineage/abc/000000002", default=None, quarantine=True)
    assert "lineage/abc/000000002.json" in str(e.value) and "moved to" in str(e.value)
    assert not store.has_json("lineage/abc/000000002")
    (moved,) = _quarantined(store)
    assert moved.startswith("lineage__abc__000000002-") and moved.endswith(".json")
    assert open(e.value.quarantined, "rb").read() == raw[:len(raw) // 2]
    assert store.get_json("lineage/abc/000000002", default=None, quarantine=True) is None


def test_quarantine_doc_leaves_a_doc_a_writer_replaced(store):
    store.put_json("pending/abc/x", {"batch": "old"})
    stale = b'{"batch": "ol'  # what a reader saw before the writer replaced it
    assert store.quarantine_doc("pending/abc/x", stale) is None
    assert store.get_json("pending/abc/x") == {"batch": "old"}
    assert _quarantined(store) == []
    assert json.loads(store.get_json_raw("pending/abc/x")) == {"batch": "old"}


def test_on_s3_a_same_size_damaged_object_and_a_torn_doc_are_moved_aside(moto_s3):
    """The object-store branch (copy + delete, whole-object hashing) against a real S3 server."""
    _, bucket, opts = moto_s3
    store = RunStore(f"s3://{bucket}/heal", opts)
    data = os.urandom(2048)
    sha = store.put_bytes(data)
    path = store.object_path(sha)
    damaged = bytearray(data)
    damaged[100:164] = bytes(b ^ 0xFF for b in damaged[100:164])
    store.fs.pipe_file(path, bytes(damaged))

    assert store.put_parts([data]) == (sha, 2048, True)
    assert store.get_bytes(sha) == data
    store.put_json("lineage/abc/000000001", {"step": 1})
    store.fs.pipe_file(store.doc_path("lineage/abc/000000001"), b'{"st')
    with pytest.raises(CorruptObjectError) as e:
        store.get_json("lineage/abc/000000001", quarantine=True)
    assert e.value.quarantined and not store.has_json("lineage/abc/000000001")
    moved = [p.rsplit("/", 1)[-1] for p in store.fs.ls(f"{store.root}/quarantine")]
    assert len(moved) == 2
    assert {m.startswith(sha) for m in moved} == {True, False}
    assert any(m.startswith("lineage__abc__000000001-") for m in moved)
    assert store.fs.cat_file(e.value.quarantined) == b'{"st'
