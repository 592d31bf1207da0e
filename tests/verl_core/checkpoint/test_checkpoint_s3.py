"""The same store on a real S3-compatible server (moto_server on 127.0.0.1)."""

from __future__ import annotations

import logging
import time

import pytest
import torch

from verl_core.checkpoint import (
    CheckpointManager,
    CorruptObjectError,
    RunStore,
    StoreUnavailableError,
)


def _s3_store(moto_s3, prefix="run") -> RunStore:
    endpoint, bucket, opts = moto_s3
    return RunStore(f"s3://{bucket}/{prefix}", opts)


def test_s3_roundtrip_verify_and_fallback(moto_s3, caplog):
    store = _s3_store(moto_s3)
    assert not store.is_local and len(store.incarnation_id) == 32
    assert _s3_store(moto_s3).incarnation_id == store.incarnation_id
    mgr = CheckpointManager(store, chunk_bytes=64 << 10, keep_last=2, gc_grace_s=0.0)
    w1 = torch.randn(200, 300)
    a = mgr.save(1, {"policy": {"w": w1, "b": torch.arange(5)}}, {"step": 1})
    b = mgr.save(2, {"policy": {"w": w1 + 1, "b": torch.arange(5)}}, {"step": 2})
    groups, meta, info = mgr.load("latest")
    assert info == b and torch.equal(groups["policy"]["w"], w1 + 1) and meta == {"step": 2}
    assert mgr.verify(b.name) == [] and [i.step for i in mgr.list_checkpoints()] == [1, 2]
    out = torch.empty(200, 300)  # in place, through torch.distributed.checkpoint's reader
    assert mgr.load_into(b.name, "policy", {"w": out}) == b and torch.equal(out, w1 + 1)

    # overwrite one object of checkpoint 2 with a flipped byte, straight through s3fs
    _, m = mgr.read_manifest(b.name)
    sha = m["groups"]["policy"]["tensors"]["w"]["chunks"][0]["sha"]
    path = store.object_path(sha)
    data = bytearray(store.fs.cat_file(path))
    data[100] ^= 1
    store.fs.pipe_file(path, bytes(data))
    with pytest.raises(CorruptObjectError, match=sha):
        mgr.load(b.name)
    # the damaged object was moved aside (copy + delete on S3), so a later save rewrites it
    assert not store.has_object(sha)
    moved = store.fs.ls(f"{store.root}/quarantine")
    assert len(moved) == 1 and moved[0].rsplit("/", 1)[-1].startswith(sha)
    with caplog.at_level(logging.WARNING):
        _, _, info = CheckpointManager(_s3_store(moto_s3)).load("auto")
    assert info == a and any(sha in r.getMessage() for r in caplog.records)

    store.append_log("events", {"k": 1})
    store.append_log("events", {"k": 2})
    assert [r["k"] for r in _s3_store(moto_s3).read_log("events")] == [1, 2]


def test_s3_exact_resume(moto_s3, resume_equivalence):
    resume_equivalence(CheckpointManager(_s3_store(moto_s3, "resume")))


def _spy(store, monkeypatch):
    """Record every doc name written through ``store``."""
    written = []
    for meth in ("put_json", "put_json_raw"):
        real = getattr(store, meth)

        def wrapped(name, *a, _real=real, **k):
            written.append(name)
            return _real(name, *a, **k)

        monkeypatch.setattr(store, meth, wrapped)
    return written


@pytest.mark.slow
def test_s3_server_killed_during_save(moto_server_factory, monkeypatch):
    server = moto_server_factory()
    bucket = server.create_bucket()
    store = RunStore(f"s3://{bucket}/run", server.storage_options())
    mgr = CheckpointManager(store, chunk_bytes=64 << 10)
    good = mgr.save(1, {"policy": {"w": torch.randn(256, 256)}}, {"step": 1})
    written = _spy(store, monkeypatch)
    real_put = store.put_parts
    calls = {"n": 0}

    def put_then_die(parts, **kw):
        calls["n"] += 1
        if calls["n"] == 3:
            server.kill()  # the S3 endpoint disappears in the middle of the save
        return real_put(parts, **kw)

    monkeypatch.setattr(store, "put_parts", put_then_die)
    t0 = time.monotonic()
    with pytest.raises(StoreUnavailableError):
        mgr.save(2, {"policy": {"w": torch.randn(512, 256)}}, {"step": 2})
    assert time.monotonic() - t0 < 60
    assert "latest" not in written and not any(n.startswith("checkpoints/") for n in written)
    assert mgr._last_name == good.name


@pytest.mark.slow
def test_s3_server_hangs_during_save_then_recovers(moto_server_factory, monkeypatch):
    server = moto_server_factory()
    bucket = server.create_bucket()
    opts = server.storage_options(connect_timeout=1, read_timeout=1,
                                  retries={"max_attempts": 1, "mode": "standard"})
    # the store's own deadline bounds what the client timeouts miss: a PUT to the frozen server
    # once waited forever here (the event loop idle, no timer armed)
    store = RunStore(f"s3://{bucket}/run", opts, op_timeout_s=5)
    store.fs.retries = 1  # s3fs' own retry loop: once is enough here
    mgr = CheckpointManager(store, chunk_bytes=64 << 10)
    w = torch.randn(256, 256)
    good = mgr.save(1, {"policy": {"w": w}}, {"step": 1})
    real_put = store.put_parts
    calls = {"n": 0}

    def put_then_hang(parts, **kw):
        calls["n"] += 1
        if calls["n"] == 3:
            server.pause()  # SIGSTOP: requests hang until the client times out
        return real_put(parts, **kw)

    monkeypatch.setattr(store, "put_parts", put_then_hang)
    try:
        with pytest.raises(StoreUnavailableError):
            mgr.save(2, {"policy": {"w": torch.randn(512, 256)}}, {"step": 2})
    finally:
        server.resume()
    fresh = CheckpointManager(RunStore(f"s3://{bucket}/run", opts))
    assert fresh.resolve("latest") == good.name
    groups, meta, info = fresh.load("auto")
    assert info == good and torch.equal(groups["policy"]["w"], w)


def test_s3_without_credentials_is_a_permanent_error_naming_the_fix(moto_s3, monkeypatch,
                                                                     tmp_path):
    # missing credentials are configuration, not an outage: no retries, and the message says
    # what to set
    from verl_core.checkpoint import StorePermissionError

    endpoint, bucket, opts = moto_s3
    for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SECURITY_TOKEN",
              "AWS_SESSION_TOKEN"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")  # no instance-metadata lookup
    with pytest.raises(StorePermissionError, match="no S3 credentials.*AWS_ACCESS_KEY_ID"):
        RunStore(f"s3://{bucket}/run", opts)


def test_store_deadline_bounds_a_frozen_server(moto_server_factory):
    # client timeouts far longer than the store's deadline: the deadline is what ends the call.
    # The store opens and writes under the default deadline (a loaded machine's first requests
    # to a fresh moto_server once took over 2 s), then the 2 s deadline meets the frozen server
    server = moto_server_factory()
    bucket = server.create_bucket()
    opts = server.storage_options(connect_timeout=60, read_timeout=60,
                                  retries={"max_attempts": 1, "mode": "standard"})
    store = RunStore(f"s3://{bucket}/run", opts)
    store.put_bytes(b"before")
    store.op_timeout_s = 2
    server.pause()
    try:
        t0 = time.monotonic()
        with pytest.raises(StoreUnavailableError, match="store unavailable"):
            store.put_bytes(b"during the outage")
        assert time.monotonic() - t0 < 10
    finally:
        server.resume()
    store.op_timeout_s = 60
    assert store.get_bytes(store.put_bytes(b"after")) == b"after"


def test_s3_default_size_objects_roundtrip(moto_s3):
    # the default 16 MiB objects (PUTs well past botocore's 1 MB "Expect: 100-continue" size)
    store = _s3_store(moto_s3, "big")
    mgr = CheckpointManager(store)
    w = torch.randn(10_000, 1024)  # 41 MB: two full 16 MiB row chunks and a remainder
    small = {f"layers.{i}.norm": torch.randn(1024) for i in range(8)}
    info = mgr.save(1, {"policy": {"w": w, **small}}, {})
    _, m = mgr.read_manifest(info.name)
    sizes = sorted(m["objects"].values())
    assert len(sizes) == 5 and sizes[-1] > 16 << 20  # 3 chunks of w, 1 pack, the meta
    groups, _, _ = CheckpointManager(_s3_store(moto_s3, "big")).load("latest")
    assert torch.equal(groups["policy"]["w"], w)
    assert all(torch.equal(groups["policy"][k], v) for k, v in small.items())
