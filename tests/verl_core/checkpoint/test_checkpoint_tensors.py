"""Chunked safetensors serialisation: exact round trips, determinism, row reads, strict reads."""

from __future__ import annotations

import json
import struct

import pytest
import safetensors.torch
import torch

from verl_core.checkpoint import CorruptObjectError, UnsafeManifestError, load_tensors, save_tensors
from verl_core.checkpoint.tensors import ChunkRead, index_objects, read_chunks, validate_index


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


def test_objects_are_valid_safetensors(store):
    # a pack of mixed dtypes: safetensors' own reader (bytes and mmap) sees every tensor, aligned
    ts = {"a": torch.randn(3, 3).to(torch.bfloat16), "b": torch.arange(5, dtype=torch.int64),
          "c": torch.tensor([True, False, True]), "d": torch.randn(7)}
    index = save_tensors(store, ts)
    assert len(index_objects(index)) == 1  # all four packed into one object
    sha = index["a"]["chunks"][0]["sha"]
    blob = store.get_bytes(sha)
    with safetensors.safe_open(store.object_path(sha), "pt") as f:
        for name, t in ts.items():
            key = index[name]["chunks"][0]["key"]
            assert torch.equal(safetensors.torch.load(blob)[key], t), name
            assert torch.equal(f.get_tensor(key), t), name
            start = struct.unpack("<Q", blob[:8])[0] + 8
            offset = json.loads(blob[8:start])[key]["data_offsets"][0]
            assert offset % t.element_size() == 0, name  # every tensor starts aligned


def _layered_state(layers: int, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    st = {}
    for i in range(layers):
        st[f"model.layers.{i}.attn.weight"] = torch.randn(32, 32, generator=g)  # 4 KiB
        st[f"model.layers.{i}.mlp.weight"] = torch.randn(32, 64, generator=g)  # 8 KiB
        st[f"model.layers.{i}.norm.weight"] = torch.randn(32, generator=g)
    return st


def test_small_tensors_are_packed_into_few_objects(store):
    st = _layered_state(8, 0)  # 24 tensors, ~12.1 KiB per layer
    assert len(index_objects(save_tensors(store, st, chunk_bytes=1 << 20))) == 1
    index = save_tensors(store, st, chunk_bytes=32 << 10)
    # a layer (12.1 KiB) fills more than a quarter of a 32 KiB object: one object per layer
    assert len(index_objects(index)) == 8
    got = load_tensors(store, index)
    assert all(torch.equal(got[k], v) for k, v in st.items())
    store.reset_stats()
    load_tensors(store, index, names=["model.layers.5.norm.weight"])
    assert store.stats.objects_read == 1  # the whole pack is read and verified, nothing else


def test_frozen_layers_cost_little_when_packed(store):
    # layers 0-3 frozen, 4-7 change: the second save writes the changed half plus at most the
    # one pack that straddles the boundary (bounded by a quarter chunk of frozen bytes)
    chunk = 32 << 10
    first = _layered_state(8, 0)
    save_tensors(store, first, chunk_bytes=chunk)
    full = store.reset_stats().bytes_written
    second = dict(first)
    changed = _layered_state(8, 1)
    for k in second:
        if int(k.split(".")[2]) >= 4:
            second[k] = changed[k]
    index = save_tensors(store, second, chunk_bytes=chunk)
    written = store.reset_stats().bytes_written
    assert written <= full / 2 + chunk // 4 + 1024, (written, full)
    got = load_tensors(store, index)
    assert all(torch.equal(got[k], v) for k, v in second.items())


def test_indexes_without_keys_still_load(store):
    # objects written before packing: one tensor named "data", chunk entries without "key"
    a = torch.randn(6, 2)
    header = json.dumps({"data": {"dtype": "F32", "shape": [6, 2], "data_offsets": [0, 48]}},
                        separators=(",", ":")).encode()
    header += b" " * (-len(header) % 8)
    blob = struct.pack("<Q", len(header)) + header + a.numpy().tobytes()
    sha = store.put_bytes(blob)
    index = {"a": {"dtype": "float32", "shape": [6, 2],
                   "chunks": [{"sha": sha, "size": len(blob), "rows": [0, 6]}]}}
    assert torch.equal(load_tensors(store, index)["a"], a)


def test_pack_header_must_tile_its_data(store):
    # a header whose entries leave a gap (or overlap) is refused before any byte is used
    header = json.dumps({"0": {"dtype": "U8", "shape": [4], "data_offsets": [0, 4]},
                         "1": {"dtype": "U8", "shape": [4], "data_offsets": [6, 10]}},
                        separators=(",", ":")).encode()
    header += b" " * (-len(header) % 8)
    blob = struct.pack("<Q", len(header)) + header + bytes(10)
    sha = store.put_bytes(blob)
    index = {"a": {"dtype": "uint8", "shape": [4],
                   "chunks": [{"sha": sha, "size": len(blob), "rows": [0, 4], "key": "0"}]}}
    with pytest.raises(CorruptObjectError, match="gap or overlap"):
        load_tensors(store, index)


def test_row_reads_fetch_only_the_objects_holding_them(store):
    # what dcp.StoreReader does for a worker that owns rows 25:47 (resharding)
    a = torch.randn(100, 8)  # 32 bytes per row, 10 rows per chunk
    index = save_tensors(store, {"a": a}, chunk_bytes=320)
    e = index["a"]
    assert len(e["chunks"]) == 10
    out = torch.empty(22, 8)
    reads = []
    for c in e["chunks"]:
        lo, hi = max(c["rows"][0], 25), min(c["rows"][1], 47)
        if lo < hi:
            reads.append(ChunkRead(e, c, lo - c["rows"][0], hi - c["rows"][0],
                                   out[lo - 25:hi - 25], "a"))
    store.reset_stats()
    read_chunks(store, reads)
    assert torch.equal(out, a[25:47])
    assert store.stats.objects_read == 3  # rows 20-30, 30-40, 40-50
    with pytest.raises(ValueError, match="does not fit"):
        read_chunks(store, [ChunkRead(e, e["chunks"][0], 0, 5, torch.empty(4, 8), "a")])


def test_row_pieces_of_two_workers_join_into_one_index(store):
    # each worker writes its rows of "a" (FSDP2 shard) and the whole replicated "r"; whole
    # tensors are packed apart from row pieces, so both write the same objects for "r"
    a, r, step = torch.randn(11, 3), torch.randn(4, 4), torch.tensor(7.0)
    p0 = save_tensors(store, {"a": a[:6], "r": r, "step": step}, chunk_bytes=48,
                      layout={"a": ((11, 3), 0)})
    p1 = save_tensors(store, {"a": a[6:], "r": r, "step": step}, chunk_bytes=48,
                      layout={"a": ((11, 3), 6)})
    assert p0["r"] == p1["r"] and p0["a"]["shape"] == [11, 3]
    assert {c["sha"] for c in p0["a"]["chunks"]}.isdisjoint(c["sha"] for c in p0["r"]["chunks"])
    joined = {**p0, "a": {**p0["a"], "chunks": p0["a"]["chunks"] + p1["a"]["chunks"]}}
    got = load_tensors(store, validate_index(joined))
    assert torch.equal(got["a"], a) and torch.equal(got["r"], r) and torch.equal(got["step"], step)
    with pytest.raises(UnsafeManifestError, match="cover"):
        validate_index(p0)  # rows 6..11 are missing
    with pytest.raises(Exception, match="do not fit"):
        save_tensors(store, {"a": a[6:]}, layout={"a": ((11, 3), 7)})


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


def _packed_index(store):
    """``a`` and ``b`` share one object (keys "0" and "1"); ``c`` has one of its own."""
    g = torch.Generator().manual_seed(0)
    index = save_tensors(store, {"a": torch.randn(4, 4, generator=g),
                                 "b": torch.randn(4, 4, generator=g)})
    index.update(save_tensors(store, {"c": torch.randn(8, 4, generator=g)}))
    assert index["a"]["chunks"][0]["sha"] == index["b"]["chunks"][0]["sha"]
    return index


def _absurd_shape(ix):
    ix["a"]["shape"], ix["a"]["chunks"][0]["rows"] = [1 << 24, 1 << 24], [0, 1 << 24]


def _wider_dtype(ix):
    ix["c"]["dtype"] = "float64"  # 256 bytes of data in an object that holds 128


def _inflated_size(ix):
    ix["c"]["chunks"][0]["size"] += 2 << 20  # more than any header could explain


def _two_sizes(ix):
    ix["b"]["chunks"][0]["size"] += 8  # the object a and b share, listed twice differently


def _one_key_two_shapes(ix):
    ix["b"]["shape"] = [2, 8]
    ix["b"]["chunks"][0].update(rows=[0, 2], key="0")  # a's key, claimed with another shape


def _keys_overfill_object(ix):
    # b alone would fit in the shared object, but not next to a's 64 bytes
    size = ix["b"]["chunks"][0]["size"]
    ix["b"]["shape"] = [4, (size - 9) // 16]


def _rows_not_a_list(ix):
    ix["a"]["chunks"][0]["rows"] = 4


def _unhashable_dtype(ix):
    ix["a"]["dtype"] = ["float32"]


def _bool_rows(ix):
    ix["a"]["chunks"][0]["rows"] = [False, 4]


@pytest.mark.parametrize("edit", [_absurd_shape, _wider_dtype, _inflated_size, _two_sizes,
                                  _one_key_two_shapes, _keys_overfill_object, _rows_not_a_list,
                                  _unhashable_dtype, _bool_rows], ids=lambda f: f.__name__[1:])
def test_index_must_be_self_consistent_before_anything_is_allocated(store, edit):
    index = _packed_index(store)
    assert validate_index(index) is index and set(load_tensors(store, index)) == {"a", "b", "c"}
    bad = json.loads(json.dumps(index))
    edit(bad)
    with pytest.raises(UnsafeManifestError, match="my-index tensor '[abc]'"):
        validate_index(bad, "my-index")
    with pytest.raises(UnsafeManifestError):
        load_tensors(store, bad)
