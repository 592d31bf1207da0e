"""Chunked safetensors serialisation: exact round trips, determinism, row slices, strict reads."""

from __future__ import annotations

import struct

import pytest
import safetensors.torch
import torch

from verl_core.checkpoint import CorruptObjectError, UnsafeManifestError, load_tensors, save_tensors
from verl_core.checkpoint.tensors import RowShard, merge_indexes


def _all_dtypes():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(37, 5, generator=g)
    out = {f"t_{d}": x.to(d) for d in (torch.float64, torch.float32, torch.float16, torch.bfloat16,
                                        torch.int64, torch.int32, torch.int16, torch.int8,
                                        torch.uint8, torch.bool)}
    out["scalar"] = torch.tensor(-0.0)
    out["empty"] = torch.zeros(0, 3)
    out["zero_width"] = torch.zeros(4, 0)
    out["transposed"] = torch.randn(6, 9, generator=g).t()  # non-contiguous
    out["nan"] = torch.tensor([float("nan"), float("inf"), -float("inf")])
    return out


def test_roundtrip_is_bit_exact(store):
    ts = _all_dtypes()
    index = save_tensors(store, ts, chunk_bytes=256)
    got = load_tensors(store, index)
    for k, v in ts.items():
        assert got[k].dtype == v.dtype and got[k].shape == v.shape, k
        # bit-exact (NaN payloads and -0.0 included): compare raw bytes
        assert got[k].contiguous().view(-1).view(torch.uint8).tolist() == \
            v.contiguous().view(-1).view(torch.uint8).tolist(), k
    assert index["t_torch.float32"]["dtype"] == "float32"
    assert len(index["t_torch.float64"]["chunks"]) > 1  # really chunked


def test_identical_tensors_give_identical_objects(store):
    a = torch.arange(1000, dtype=torch.float32).reshape(100, 10)
    i1 = save_tensors(store, {"a": a}, chunk_bytes=1000)
    written = store.stats.bytes_written
    i2 = save_tensors(store, {"b": a.clone()}, chunk_bytes=1000)
    assert i1["a"] == i2["b"]
    assert store.stats.bytes_written == written  # nothing new was written


def test_chunks_are_valid_safetensors(store):
    a = torch.randn(10, 4).to(torch.bfloat16)
    index = save_tensors(store, {"a": a})
    blob = store.get_bytes(index["a"]["chunks"][0]["sha"])
    assert torch.equal(safetensors.torch.load(blob)["data"], a)


def test_row_slice_reads_only_needed_chunks(store):
    a = torch.randn(100, 8)  # 32 bytes per row, 10 rows per chunk
    index = save_tensors(store, {"a": a}, chunk_bytes=320)
    assert len(index["a"]["chunks"]) == 10
    store.reset_stats()
    part = load_tensors(store, index, row_slice=(25, 47))["a"]
    assert torch.equal(part, a[25:47])
    assert store.stats.objects_read == 3  # rows 20-30, 30-40, 40-50
    out = torch.empty(10, 8)
    load_tensors(store, index, row_slice={"a": (90, 100)}, out={"a": out})
    assert torch.equal(out, a[90:])


def test_row_shards_merge_into_one_index(store):
    a = torch.randn(11, 3)
    p0 = save_tensors(store, {"a": RowShard(a[:6], (11, 3), 0), "r": a}, chunk_bytes=48)
    p1 = save_tensors(store, {"a": RowShard(a[6:], (11, 3), 6), "r": a}, chunk_bytes=48)
    merged = merge_indexes([p0, p1])
    assert torch.equal(load_tensors(store, merged)["a"], a)
    assert torch.equal(load_tensors(store, merged)["r"], a)
    with pytest.raises(UnsafeManifestError, match="cover"):
        merge_indexes([p0])  # rows 6..11 missing


def _first_chunk_path(store, index, name):
    return store.object_path(index[name]["chunks"][0]["sha"])


def test_corrupt_truncated_and_foreign_chunks_are_refused(store):
    a = torch.randn(64, 4)
    index = save_tensors(store, {"a": a})
    path = _first_chunk_path(store, index, "a")
    good = open(path, "rb").read()
    sha = index["a"]["chunks"][0]["sha"]

    bad = bytearray(good)
    bad[-3] ^= 0x40
    open(path, "wb").write(bytes(bad))
    with pytest.raises(CorruptObjectError, match=f"{sha}.*tensor 'a'.*corrupted"):
        load_tensors(store, index)

    open(path, "wb").write(good[:-10])
    with pytest.raises(CorruptObjectError, match=f"{sha}.*truncated"):
        load_tensors(store, index)

    # right hash, wrong content: a valid chunk of another shape passed off as this one
    other = save_tensors(store, {"b": torch.randn(32, 8)})
    forged = {"a": {**index["a"], "chunks": [{**other["b"]["chunks"][0], "rows": [0, 64]}]}}
    open(path, "wb").write(good)
    with pytest.raises(CorruptObjectError, match="not the expected safetensors chunk"):
        load_tensors(store, forged)


def test_index_is_validated_before_use(store):
    a = torch.randn(4, 4)
    index = save_tensors(store, {"a": a})
    for bad in ({"a": {**index["a"], "dtype": "object"}},
                {"a": {**index["a"], "chunks": [{**index["a"]["chunks"][0], "sha": "../../x"}]}},
                {"a": {**index["a"], "shape": [8, 4]}},
                {"a": {**index["a"], "extra": 1}}):
        with pytest.raises(UnsafeManifestError):
            load_tensors(store, bad)


def test_header_size_field_is_bounded(store):
    # a blob whose first 8 bytes claim a 2**60-byte header is refused, not allocated
    blob = struct.pack("<Q", 1 << 60) + b"x" * 100
    sha = store.put_bytes(blob)
    index = {"a": {"dtype": "uint8", "shape": [100], "chunks": [{"sha": sha, "size": len(blob),
                                                                 "rows": [0, 100]}]}}
    with pytest.raises(CorruptObjectError, match="no valid safetensors header"):
        load_tensors(store, index)
