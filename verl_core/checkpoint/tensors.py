"""Chunked, content-addressed tensor serialisation (safetensors chunks, no pickle).

What belongs here: turning a flat ``dict[str, Tensor]`` into store objects and an *index*, and back.
Nested state (optimizer, RNG, counters) is flattened first by ``state.py``; manifests are
``manager.py``'s business.

Each tensor is cut along dim 0 into chunks of about ``chunk_bytes`` (default 4 MiB); each chunk is
one valid single-tensor safetensors blob named ``"data"`` with a canonical header, so identical
rows always produce identical bytes and the same sha256: an unchanged layer (or the reference
model, or a frozen half of the network) is written once per store, ever. Chunking along dim 0 also
lets a reader with a different data-parallel layout fetch only the rows it owns
(``load_tensors(..., row_slice=...)``): resharding W -> W' reads each byte at most once overall.

The index of one tensor (JSON, embedded in manifests)::

    {"dtype": "float32", "shape": [rows, ...],
     "chunks": [{"sha": <sha256>, "size": <object bytes>, "rows": [start, stop]}, ...]}

A 0-dim tensor has one chunk with rows [0, 1]. A tensor saved from several workers (FSDP row shards,
see :class:`RowShard`) has the same index once the pieces are merged (``merge_indexes``).

Reading verifies every chunk: size, sha256 of the whole object, and a header that must describe
exactly the dtype/shape the index promises. Anything else is a :class:`CorruptObjectError` naming
the object; the bytes are never interpreted any other way (no pickle, no ``torch.load``).
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Sequence, Union

import torch

from verl_core.checkpoint.errors import CheckpointSaveError, CorruptObjectError, UnsafeManifestError
from verl_core.checkpoint.store import RunStore, check_sha256

__all__ = ["RowShard", "DEFAULT_CHUNK_BYTES", "save_tensors", "load_tensors", "validate_index",
           "merge_indexes", "index_objects", "check_chunk", "index_nbytes", "encode_chunk",
           "DTYPE_NAMES"]

DEFAULT_CHUNK_BYTES = 4 << 20
_MAX_HEADER = 1 << 16  # our headers are < 200 bytes; anything bigger is not ours

# torch dtype <-> (manifest name, safetensors code). A whitelist: names read from a manifest are
# looked up here, never passed to getattr(torch, ...).
_DTYPES: list[tuple[torch.dtype, str, str]] = [
    (torch.float64, "float64", "F64"), (torch.float32, "float32", "F32"),
    (torch.float16, "float16", "F16"), (torch.bfloat16, "bfloat16", "BF16"),
    (torch.int64, "int64", "I64"), (torch.int32, "int32", "I32"), (torch.int16, "int16", "I16"),
    (torch.int8, "int8", "I8"), (torch.uint8, "uint8", "U8"), (torch.bool, "bool", "BOOL"),
]
for _name, _code in (("float8_e4m3fn", "F8_E4M3"), ("float8_e5m2", "F8_E5M2"),
                     ("uint16", "U16"), ("uint32", "U32"), ("uint64", "U64")):
    if hasattr(torch, _name):
        _DTYPES.append((getattr(torch, _name), _name, _code))
_BY_DTYPE = {d: (n, c) for d, n, c in _DTYPES}
_BY_NAME = {n: (d, c) for d, n, c in _DTYPES}
DTYPE_NAMES = tuple(_BY_NAME)


@dataclass(frozen=True)
class RowShard:
    """Rows ``[row_offset, row_offset + local.shape[0])`` of a tensor whose full shape is
    ``global_shape``: what one data-parallel worker owns (FSDP2 shards dim 0)."""

    local: torch.Tensor
    global_shape: tuple[int, ...]
    row_offset: int


def _dtensor_type():
    try:
        from torch.distributed.tensor import DTensor

        return DTensor
    except Exception:  # noqa: BLE001 - torch without distributed
        return None


def as_row_shard(t: Any, name: str = "") -> RowShard:
    """A plain tensor -> the whole tensor; a DTensor sharded on dim 0 -> this rank's rows."""
    if isinstance(t, RowShard):
        return t
    DTensor = _dtensor_type()
    if DTensor is not None and isinstance(t, DTensor):
        from torch.distributed.tensor import Replicate, Shard

        for p in t.placements:
            if not (isinstance(p, Replicate) or (type(p) is Shard and p.dim == 0)):
                raise CheckpointSaveError(
                    f"tensor {name!r}: placement {p} is not supported (only Shard(0) and "
                    "Replicate); call .full_tensor() before saving or use FSDP2's default dim-0 "
                    "sharding")
        local = t.to_local()
        global_shape = tuple(t.shape)
        if local.dim() == 0 or not any(isinstance(p, Shard) for p in t.placements):
            return RowShard(local, global_shape, 0)
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        local_shape, offset = compute_local_shape_and_global_offset(
            global_shape, t.device_mesh, t.placements)
        # FSDP2 may keep padding in storage; to_local() is the unpadded shard of local_shape.
        local = local[: local_shape[0]] if local.shape[0] != local_shape[0] else local
        return RowShard(local, global_shape, int(offset[0]) if local_shape[0] else 0)
    if isinstance(t, torch.Tensor):
        return RowShard(t, tuple(t.shape), 0)
    raise CheckpointSaveError(f"tensor {name!r}: expected a torch.Tensor, got {type(t).__name__}")


def _header(code: str, shape: Sequence[int], nbytes: int) -> bytes:
    h = json.dumps({"data": {"dtype": code, "shape": list(shape), "data_offsets": [0, nbytes]}},
                   separators=(",", ":"), sort_keys=True).encode()
    h += b" " * (-len(h) % 8)  # safetensors aligns the data to 8 bytes
    return struct.pack("<Q", len(h)) + h


def _raw_bytes(t: torch.Tensor):
    """Zero-copy uint8 numpy view of a contiguous CPU tensor (any dtype, incl. bf16, 0-dim)."""
    return t.reshape(-1).view(torch.uint8).numpy()


def encode_chunk(t: torch.Tensor) -> tuple[bytes, Any]:
    """(header bytes, raw data view) of one chunk: a single-tensor safetensors file named "data"."""
    if t.dtype not in _BY_DTYPE:
        raise CheckpointSaveError(f"dtype {t.dtype} is not supported; known: "
                                  f"{', '.join(DTYPE_NAMES)}")
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous()
    data = _raw_bytes(t)
    return _header(_BY_DTYPE[t.dtype][1], t.shape, data.nbytes), data


def _row_ranges(shape: Sequence[int], elem: int, chunk_bytes: int,
                rows: int) -> list[tuple[int, int]]:
    if not shape:
        return [(0, 1)]
    row_bytes = elem
    for s in shape[1:]:
        row_bytes *= s
    if rows == 0:
        return [(0, 0)]
    per = rows if row_bytes == 0 else max(1, chunk_bytes // row_bytes)
    return [(a, min(a + per, rows)) for a in range(0, rows, per)]


def save_tensors(store: RunStore, tensors: Mapping[str, Any], *,
                 chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> dict:
    """Write every tensor as content-addressed chunks; return the index ``{name: entry}``.

    Values may be tensors (any device; copied to CPU chunk by chunk), DTensors sharded on dim 0
    (this rank's rows are written, the entry covers only them) or :class:`RowShard`. Existing
    chunks are not rewritten (see ``store.stats`` for bytes written vs skipped).
    """
    jobs = []  # (name, row_start, tensor_rows)
    index: dict[str, dict] = {}
    for name, value in tensors.items():
        if not isinstance(name, str):
            raise CheckpointSaveError(f"tensor names must be str, got {name!r}")
        rs = as_row_shard(value, name)
        t = rs.local
        if t.dtype not in _BY_DTYPE:
            raise CheckpointSaveError(f"tensor {name!r}: dtype {t.dtype} is not supported; "
                                      f"known: {', '.join(DTYPE_NAMES)}")
        shape = list(rs.global_shape)
        if list(t.shape[1:]) != shape[1:] or (shape == [] and t.dim() != 0):
            raise CheckpointSaveError(f"tensor {name!r}: local shape {tuple(t.shape)} does not fit "
                                      f"global shape {tuple(shape)}")
        entry = {"dtype": _BY_DTYPE[t.dtype][0], "shape": shape, "chunks": []}
        index[name] = entry
        if shape and t.shape[0] == 0 and shape[0] != 0:
            continue  # this worker owns no rows of it
        for a, b in _row_ranges(list(t.shape), t.element_size(), chunk_bytes,
                                t.shape[0] if shape else 1):
            piece = t if not shape else t[a:b]
            off = rs.row_offset if shape else 0
            jobs.append((name, off + a, off + b, piece))

    def write(job):
        name, a, b, piece = job
        header, data = encode_chunk(piece)
        sha, size, _ = store.put_parts([header, data])
        return name, {"sha": sha, "size": size, "rows": [a, b]}

    for name, chunk in store.map(write, jobs):
        index[name]["chunks"].append(chunk)
    for entry in index.values():
        entry["chunks"].sort(key=lambda c: c["rows"][0])
    return index


# ---------------------------------------------------------------------------- index checks
def _fail(what: str, why: str) -> None:
    raise UnsafeManifestError(f"{what}: {why}")


def validate_index(index: Any, what: str = "index", *, partial: bool = False) -> dict:
    """Check an index read from a manifest before anything in it is used as a path or a size.

    ``partial`` allows chunk lists that cover only some rows (one shard's record); otherwise the
    chunks of each tensor must tile its rows exactly once."""
    if not isinstance(index, dict):
        _fail(what, "must be an object of tensor entries")
    for name, e in index.items():
        w = f"{what} tensor {name!r}"
        if not isinstance(e, dict) or set(e) != {"dtype", "shape", "chunks"}:
            _fail(w, "entry must have exactly dtype, shape, chunks")
        if e["dtype"] not in _BY_NAME:
            _fail(w, f"unknown dtype {e['dtype']!r}")
        shape = e["shape"]
        if not isinstance(shape, list) or not all(isinstance(s, int) and not isinstance(s, bool)
                                                  and 0 <= s < 1 << 48 for s in shape):
            _fail(w, f"bad shape {shape!r}")
        rows = shape[0] if shape else 1
        chunks = e["chunks"]
        if not isinstance(chunks, list):
            _fail(w, "chunks must be a list")
        pos = 0
        for c in sorted(chunks, key=lambda c: c.get("rows", [0])[0] if isinstance(c, dict) else 0):
            if not isinstance(c, dict) or set(c) != {"sha", "size", "rows"}:
                _fail(w, f"chunk {c!r} must have exactly sha, size, rows")
            check_sha256(c["sha"], f"{w} chunk")
            r = c["rows"]
            if (not isinstance(r, list) or len(r) != 2 or not all(isinstance(x, int) for x in r)
                    or not 0 <= r[0] <= r[1] <= rows):
                _fail(w, f"chunk rows {r!r} outside [0, {rows}]")
            if not isinstance(c["size"], int) or c["size"] < 8:
                _fail(w, f"chunk size {c['size']!r} invalid")
            if not partial and r[0] != pos:
                _fail(w, f"chunks do not tile the rows: gap or overlap at row {pos}")
            pos = r[1]
        if not partial and rows > 0 and pos != rows:
            _fail(w, f"chunks cover rows [0, {pos}) of {rows}")
    return index


def merge_indexes(pieces: Sequence[dict], what: str = "tensors") -> dict:
    """Merge per-worker indexes (each covering some rows of each tensor) into one full index.
    Replicated tensors (identical chunks from several workers) are kept once; conflicting or
    missing rows raise :class:`IncompleteCheckpointError`-worthy :class:`UnsafeManifestError`."""
    merged: dict[str, dict] = {}
    for piece in pieces:
        validate_index(piece, what, partial=True)
        for name, e in piece.items():
            m = merged.setdefault(name, {"dtype": e["dtype"], "shape": e["shape"], "chunks": {}})
            if (m["dtype"], m["shape"]) != (e["dtype"], e["shape"]):
                _fail(f"{what} tensor {name!r}", f"workers disagree on dtype/shape: "
                      f"{m['dtype']}{m['shape']} vs {e['dtype']}{e['shape']}")
            for c in e["chunks"]:
                key = tuple(c["rows"])
                old = m["chunks"].get(key)
                if old is not None and old["sha"] != c["sha"]:
                    _fail(f"{what} tensor {name!r}", f"workers wrote different data for rows {key}")
                m["chunks"][key] = c
    out = {}
    for name, m in merged.items():
        chunks = sorted(m["chunks"].values(), key=lambda c: c["rows"])
        out[name] = {"dtype": m["dtype"], "shape": m["shape"], "chunks": chunks}
    return validate_index(out, what)


def index_objects(index: Mapping[str, dict]) -> dict[str, int]:
    """``{sha: size}`` of every chunk referenced by ``index``."""
    return {c["sha"]: c["size"] for e in index.values() for c in e["chunks"]}


def index_nbytes(index: Mapping[str, dict]) -> int:
    """Bytes of tensor data described by ``index`` (without headers)."""
    total = 0
    for e in index.values():
        n = _BY_NAME[e["dtype"]][0].itemsize
        for s in e["shape"]:
            n *= s
        total += n
    return total


# ---------------------------------------------------------------------------- loading
def _check_header(raw_header: bytes, sha: str, code: str, shape: list, nbytes: int, label: str):
    try:
        h = json.loads(raw_header)
        ok = (isinstance(h, dict) and set(h) - {"__metadata__"} == {"data"}
              and h["data"] == {"dtype": code, "shape": shape, "data_offsets": [0, nbytes]})
    except (ValueError, UnicodeDecodeError, TypeError):
        ok = False
    if not ok:
        raise CorruptObjectError(f"object {sha} ({label}) is not the expected safetensors chunk "
                                 f"({code}{shape}); refusing to interpret it", sha=sha)


def _read_chunk_local(path: str, sha: str, size: int, code: str, shape: list, dest, label: str):
    """Read chunk ``sha`` straight into ``dest`` (uint8 numpy view) and verify its hash."""
    h = hashlib.sha256()
    try:
        with open(path, "rb", buffering=0) as f:
            actual = os.fstat(f.fileno()).st_size
            if actual != size:
                raise CorruptObjectError(f"object {sha} ({label}) at {path} has {actual} bytes, "
                                         f"the manifest says {size} (truncated or replaced)",
                                         sha=sha, path=path)
            head = f.read(8)
            n = struct.unpack("<Q", head)[0] if len(head) == 8 else -1
            if not 0 < n <= min(_MAX_HEADER, size - 8):
                raise CorruptObjectError(f"object {sha} ({label}) at {path} has no valid "
                                         "safetensors header; refusing to interpret it",
                                         sha=sha, path=path)
            header = f.read(n)
            _check_header(header, sha, code, shape, dest.nbytes, label)
            if 8 + n + dest.nbytes != size:
                raise CorruptObjectError(f"object {sha} ({label}) size does not match its header",
                                         sha=sha, path=path)
            h.update(head)
            h.update(header)
            mv = memoryview(dest).cast("B")
            got = 0
            while got < dest.nbytes:
                k = f.readinto(mv[got:])
                if not k:
                    raise CorruptObjectError(f"object {sha} ({label}) at {path} is truncated",
                                             sha=sha, path=path)
                got += k
            h.update(mv)
    except FileNotFoundError as e:
        raise CorruptObjectError(f"object {sha} ({label}) is missing (expected at {path})",
                                 sha=sha, path=path) from e
    digest = h.hexdigest()
    if digest != sha:
        raise CorruptObjectError(f"object {sha} ({label}) at {path} is corrupted: its bytes hash "
                                 f"to {digest}", sha=sha, path=path)


def _decode_chunk(data: bytes, sha: str, code: str, shape: list, nbytes: int, label: str):
    """Parse verified object bytes; return a read-only uint8 numpy view of the tensor data."""
    import numpy as np

    n = struct.unpack("<Q", data[:8])[0] if len(data) >= 8 else -1
    if not 0 < n <= min(_MAX_HEADER, len(data) - 8):
        raise CorruptObjectError(f"object {sha} ({label}) has no valid safetensors header; "
                                 "refusing to interpret it", sha=sha)
    _check_header(data[8:8 + n], sha, code, shape, nbytes, label)
    if 8 + n + nbytes != len(data):
        raise CorruptObjectError(f"object {sha} ({label}) size does not match its header", sha=sha)
    return np.frombuffer(data, dtype=np.uint8, count=nbytes, offset=8 + n)


def check_chunk(store: RunStore, entry: Mapping, chunk: Mapping, label: str = "") -> None:
    """Read one chunk and check its size, hash and header against its index entry."""
    dtype, code = _BY_NAME[entry["dtype"]]
    shape = entry["shape"]
    a, b = chunk["rows"]
    chunk_shape = ([b - a] + shape[1:]) if shape else []
    nbytes = dtype.itemsize
    for x in chunk_shape:
        nbytes *= x
    data = store.get_bytes(chunk["sha"], verify=True, what=label)
    if len(data) != chunk["size"]:
        raise CorruptObjectError(f"object {chunk['sha']} ({label}) has {len(data)} bytes, the "
                                 f"manifest says {chunk['size']}", sha=chunk["sha"])
    _decode_chunk(data, chunk["sha"], code, chunk_shape, nbytes, label)


RowSlice = Union[None, tuple[int, int], Mapping[str, tuple[int, int]]]


def load_tensors(store: RunStore, index: Mapping[str, dict], names: Optional[Sequence[str]] = None,
                 row_slice: RowSlice = None, *, out: Optional[Mapping[str, torch.Tensor]] = None,
                 what: str = "") -> dict[str, torch.Tensor]:
    """Rebuild tensors from ``index``, verifying every chunk read.

    Args:
        names: tensors to load (default all); unknown names raise KeyError listing known ones.
        row_slice: ``(start, stop)`` rows for every selected tensor, or ``{name: (start, stop)}``;
            only chunks overlapping the slice are read (resharding). 0-dim tensors ignore it.
        out: optional preallocated destinations (``{name: tensor}``, e.g. a model's own parameters
            or an FSDP rank's local shard) written in place; shapes must match the slice.
        what: label for error messages (e.g. ``"checkpoint 0000…-ab12 group policy"``).
    Returns ``{name: tensor}`` (the ``out`` tensors where given).
    """
    validate_index(index, what or "index")
    names = list(index) if names is None else list(names)
    for n in names:
        if n not in index:
            raise KeyError(f"tensor {n!r} is not in {what or 'the index'}; known: "
                           f"{', '.join(sorted(index)[:20])}{' …' if len(index) > 20 else ''}")
    result: dict[str, torch.Tensor] = {}
    jobs = []
    copy_back = []
    for name in names:
        e = index[name]
        dtype, code = _BY_NAME[e["dtype"]]
        shape = e["shape"]
        rows = shape[0] if shape else 1
        rs = row_slice.get(name) if isinstance(row_slice, Mapping) else row_slice
        s, t = (0, rows) if (rs is None or not shape) else (int(rs[0]), int(rs[1]))
        if not 0 <= s <= t <= rows:
            raise ValueError(f"row slice {(s, t)} of tensor {name!r} is outside [0, {rows}]")
        want = tuple(([t - s] + shape[1:]) if shape else [])
        dest = None if out is None else out.get(name)
        if dest is not None:
            dest = dest.detach()  # same storage; parameters may require grad
            if tuple(dest.shape) != want or dest.dtype != dtype:
                raise ValueError(f"out[{name!r}] has {dest.dtype}{tuple(dest.shape)}, the "
                                 f"checkpoint slice is {dtype}{want}")
            result[name] = out[name]
            if not dest.is_contiguous() or dest.device.type != "cpu":
                tmp = torch.empty(want, dtype=dtype)
                copy_back.append((dest, tmp))
                dest = tmp
        else:
            dest = torch.empty(want, dtype=dtype)
            result[name] = dest
        for c in e["chunks"]:
            a, b = c["rows"]
            if shape and (b <= s or a >= t):
                continue
            jobs.append((name, code, shape, c, s, t, dest))

    def read(job):
        name, code, shape, c, s, t, dest = job
        a, b = c["rows"] if shape else (0, 1)
        label = f"{what + ' ' if what else ''}tensor {name!r} rows {a}:{b}"
        chunk_shape = ([b - a] + shape[1:]) if shape else []
        row_elems = 1
        for x in shape[1:]:
            row_elems *= x
        elem = dest.element_size()
        nbytes = (b - a) * row_elems * elem if shape else elem
        path = store.local_object_path(c["sha"])
        full = not shape or (s <= a and b <= t)
        if path is not None and full:
            region = dest[a - s:b - s] if shape else dest
            _read_chunk_local(path, c["sha"], c["size"], code, chunk_shape, _raw_bytes(region),
                              label)
            store._count(objects_read=1, bytes_read=c["size"])
            return
        data = store.get_bytes(c["sha"], verify=True, what=label)
        if len(data) != c["size"]:  # hash matched, so the manifest itself is inconsistent
            raise CorruptObjectError(f"object {c['sha']} ({label}) has {len(data)} bytes, the "
                                     f"manifest says {c['size']}", sha=c["sha"])
        raw = _decode_chunk(data, c["sha"], code, chunk_shape, nbytes, label)
        if full:
            region = dest[a - s:b - s] if shape else dest
            _raw_bytes(region)[...] = raw
        else:
            lo, hi = max(a, s), min(b, t)
            rb = row_elems * elem
            _raw_bytes(dest[lo - s:hi - s])[...] = raw[(lo - a) * rb:(hi - a) * rb]

    store.map(read, jobs)
    for dest, tmp in copy_back:
        with torch.no_grad():
            dest.copy_(tmp)
    return result
