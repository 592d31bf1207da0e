"""Chunked, content-addressed tensor serialisation (safetensors objects, no pickle).

What belongs here: turning a flat ``dict[str, Tensor]`` into store objects and an *index*, and back.
Nested state (optimizer, RNG, counters) is flattened first by ``state.py``; manifests are
``manifest.py``'s and ``manager.py``'s business.

Every object is a valid safetensors file whose tensors are named by position (``"0"``, ``"1"``, …)
with a canonical header, so identical content always gives identical bytes and the same hash:
an unchanged layer (or the reference model, or a frozen half of the network) is written once per
store, ever. A tensor larger than ``chunk_bytes`` (default 16 MiB) is cut along dim 0 into objects
of its own; smaller tensors are packed, in order, into shared objects of up to ``chunk_bytes``
that close early at block boundaries (``model.layers.7`` -> ``model.layers.8``, see
:class:`_Packer`). Packing matters: a 7B model with AdamW has thousands of small tensors, and each
file costs a create, a rename and, with fsync, a journal commit (measured: ~250 one-tensor files
took twice as long to write as the same bytes in ~20 packed ones). Cutting along dim 0 lets a
reader with a different data-parallel layout fetch only the objects holding the rows it owns
(:func:`read_chunks`, which ``dcp.py`` drives with torch.distributed.checkpoint's read plan).
Objects are named by the sha256 or the BLAKE3 of their bytes (``algo``, recorded by the manifest).

The index of one tensor (JSON, embedded in manifests)::

    {"dtype": "float32", "shape": [rows, ...],
     "chunks": [{"sha": <64-hex hash>, "size": <object bytes>, "rows": [start, stop],
                 "key": "3"}, ...]}

``key`` names the tensor inside the object; indexes written before packing have no key and one
tensor named ``"data"`` per object, and still load. A 0-dim tensor has one chunk with rows [0, 1].
A tensor saved by several workers (FSDP2 shards along dim 0) has the same index: each worker
writes the objects of its rows (``save_tensors(..., layout=...)``) and the chunk lists are joined.

Reading verifies every object once, however many tensors it holds: size, hash of the whole
object, and a header whose tensors tile the data exactly and describe the dtype/shape the index
promises. Anything else is a :class:`CorruptObjectError` naming the object; the bytes are never
interpreted any other way (no pickle, no ``torch.load``). Nothing is allocated before the index
has proven self-consistent (:func:`validate_index`) and the store has confirmed the size of every
object to be read, so a manifest cannot make a reader allocate more than the store holds.
"""

from __future__ import annotations

import json
import os
import re
import struct
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Sequence

import numpy as np
import torch

from verl_core.errors import CheckpointSaveError, CorruptObjectError, UnsafeManifestError
from verl_core.store import RunStore, check_sha256, new_hasher

__all__ = ["DEFAULT_CHUNK_BYTES", "save_tensors", "load_tensors", "read_chunks", "ChunkRead",
           "validate_index", "index_objects", "check_object", "index_nbytes", "index_dtypes",
           "encode_pack", "dtype_name", "torch_dtype", "DTYPE_NAMES"]

DEFAULT_CHUNK_BYTES = 16 << 20
_MAX_HEADER = 1 << 20  # a pack of thousands of tiny tensors; anything bigger is not ours
_KEY_RE = re.compile(r"^(data|0|[1-9][0-9]{0,8})$")

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


def dtype_name(dtype: torch.dtype) -> str:
    """The manifest name of a supported torch dtype; others raise :class:`CheckpointSaveError`."""
    if dtype not in _BY_DTYPE:
        raise CheckpointSaveError(f"dtype {dtype} is not supported; known: "
                                  f"{', '.join(DTYPE_NAMES)}")
    return _BY_DTYPE[dtype][0]


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a manifest dtype name (a whitelist lookup, never ``getattr``)."""
    return _BY_NAME[name][0]


def _is_dtensor(t: Any) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except Exception:  # noqa: BLE001 - torch without distributed
        return False
    return isinstance(t, DTensor)


def _raw_bytes(t: torch.Tensor):
    """Zero-copy uint8 numpy view of a contiguous CPU tensor (any dtype, incl. bf16, 0-dim)."""
    return t.reshape(-1).view(torch.uint8).numpy()


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _pack_header(entries: Sequence[tuple[str, str, Sequence[int], int, int]]) -> bytes:
    """safetensors header of ``(key, code, shape, start, end)`` entries, padded to 8 bytes."""
    h = json.dumps({k: {"dtype": c, "shape": list(s), "data_offsets": [a, b]}
                    for k, c, s, a, b in entries}, separators=(",", ":")).encode()
    h += b" " * (-len(h) % 8)  # safetensors aligns the data to 8 bytes
    return struct.pack("<Q", len(h)) + h


def encode_pack(pieces: Sequence[torch.Tensor]) -> tuple[bytes, list]:
    """(header bytes, raw data views in file order) of one object: a safetensors file whose
    tensors are named ``"0"``, ``"1"`` … after their position in ``pieces``.

    The data is laid out by descending element size (as safetensors' own writer does), so every
    tensor starts at a multiple of its element size; identical pieces give identical bytes."""
    views = []
    for i, t in enumerate(pieces):
        if t.dtype not in _BY_DTYPE:
            raise CheckpointSaveError(f"dtype {t.dtype} is not supported; known: "
                                      f"{', '.join(DTYPE_NAMES)}")
        t = t.detach()
        if t.device.type != "cpu":
            t = t.cpu()
        views.append((str(i), t.contiguous()))
    order = sorted(range(len(views)), key=lambda i: -views[i][1].element_size())  # stable
    entries, data, pos = [], [], 0
    for i in order:
        key, t = views[i]
        n = _nbytes(t)
        entries.append((key, _BY_DTYPE[t.dtype][1], t.shape, pos, pos + n))
        data.append(_raw_bytes(t))
        pos += n
    return _pack_header(sorted(entries, key=lambda e: int(e[0]))), data


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


_BLOCK_SPLIT = re.compile(r"[./]")


def _block_key(name: str) -> str:
    """The prefix of ``name`` up to its first numeric segment (``model.layers.3``, ``state/7``),
    or "" without one: a natural unit that is frozen or changed as a whole."""
    segs = _BLOCK_SPLIT.split(name)
    for i, seg in enumerate(segs):
        if seg.isdigit():
            return ".".join(segs[: i + 1])
    return ""


class _Packer:
    """Groups consecutive small pieces into objects of at most ``chunk_bytes``.

    A pack is closed early at a block boundary (a new layer, a new optimizer slot) once it is a
    quarter full, so a frozen layer's tensors rarely share an object with a trained layer's: what
    a frozen/trained boundary costs in rewritten bytes is bounded by a quarter chunk. Boundaries
    depend only on names and sizes, so the same state always packs the same way (dedupe)."""

    def __init__(self, chunk_bytes: int):
        self.chunk_bytes = chunk_bytes
        self.packs: list[list[tuple]] = []
        self._cur: list[tuple] = []
        self._bytes = 0
        self._key: Optional[str] = None

    def add(self, piece: tuple, nbytes: int, block: str) -> None:
        if self._cur and (self._bytes + nbytes > self.chunk_bytes or
                          (block != self._key and self._bytes >= self.chunk_bytes // 4)):
            self.flush()
        self._cur.append(piece)
        self._bytes += nbytes
        self._key = block

    def flush(self) -> None:
        if self._cur:
            self.packs.append(self._cur)
        self._cur, self._bytes, self._key = [], 0, None


def save_tensors(store: RunStore, tensors: Mapping[str, torch.Tensor], *,
                 chunk_bytes: int = DEFAULT_CHUNK_BYTES, algo: str = "sha256",
                 layout: Optional[Mapping[str, tuple[Sequence[int], int]]] = None) -> dict:
    """Write every tensor as content-addressed objects; return the index ``{name: entry}``.

    A tensor larger than ``chunk_bytes`` is cut along dim 0 into objects of its own; smaller ones
    are packed, in order, into shared objects of up to ``chunk_bytes`` (fewer files: each file
    costs a create, a rename and, with fsync, a journal commit). Tensors may be on any device
    (copied to CPU piece by piece). Objects are named by their ``algo`` hash; existing ones are
    not rewritten (see ``store.stats`` for bytes written vs skipped).

    ``layout`` (``{name: (global_shape, row_offset)}``) says that a tensor holds only rows
    ``[row_offset, row_offset + rows)`` of a bigger one (one worker's FSDP shard): its entry
    describes the whole tensor but lists only the chunks of those rows, for the caller to join
    with the other workers' chunks. Row pieces and whole tensors are packed apart, so workers that
    pass the same whole tensors write identical objects.
    """
    if not isinstance(chunk_bytes, int) or chunk_bytes < 1:
        raise ValueError(f"chunk_bytes={chunk_bytes!r}: must be a positive int")
    singles: list[list[tuple]] = []  # pieces: (name, row_start, row_stop, tensor_rows)
    packers = {True: _Packer(chunk_bytes), False: _Packer(chunk_bytes)}  # by "is a row piece"
    index: dict[str, dict] = {}
    for name, t in tensors.items():
        if not isinstance(name, str):
            raise CheckpointSaveError(f"tensor names must be str, got {name!r}")
        if not isinstance(t, torch.Tensor) or _is_dtensor(t):
            raise CheckpointSaveError(
                f"tensor {name!r}: expected a plain torch.Tensor, got {type(t).__name__} (sharded "
                "DTensors are saved with CheckpointManager.save_distributed)")
        if t.dtype not in _BY_DTYPE:
            raise CheckpointSaveError(f"tensor {name!r}: dtype {t.dtype} is not supported; "
                                      f"known: {', '.join(DTYPE_NAMES)}")
        shape, off = (list(t.shape), 0) if layout is None or name not in layout else \
            (list(layout[name][0]), int(layout[name][1]))
        rows = t.shape[0] if shape else 1
        if list(t.shape[1:]) != shape[1:] or (shape == [] and t.dim() != 0) or \
                (shape and not 0 <= off <= off + rows <= shape[0]):
            raise CheckpointSaveError(f"tensor {name!r}: local rows {off}:{off + rows} of shape "
                                      f"{tuple(t.shape)} do not fit global shape {tuple(shape)}")
        entry = {"dtype": _BY_DTYPE[t.dtype][0], "shape": shape, "chunks": []}
        index[name] = entry
        if shape and rows == 0 and shape[0] != 0:
            continue  # this worker owns no rows of it
        if _nbytes(t) <= chunk_bytes:
            is_piece = bool(shape) and (off != 0 or rows != shape[0])
            packers[is_piece].add((name, off, off + rows, t), _nbytes(t), _block_key(name))
            continue
        for a, b in _row_ranges(list(t.shape), t.element_size(), chunk_bytes, t.shape[0]):
            singles.append([(name, off + a, off + b, t[a:b])])
    for p in packers.values():
        p.flush()

    def write(pack):
        header, data = encode_pack([piece[3] for piece in pack])
        sha, size, _ = store.put_parts([header, *data], algo=algo, verify_existing=False)
        return [(name, {"sha": sha, "size": size, "rows": [a, b], "key": str(i)})
                for i, (name, a, b, _) in enumerate(pack)]

    jobs = singles + packers[True].packs + packers[False].packs
    jobs.sort(key=lambda pack: -sum(_nbytes(piece[3]) for piece in pack))  # largest first
    for refs in store.map(write, jobs):
        for name, chunk in refs:
            index[name]["chunks"].append(chunk)
    for entry in index.values():
        entry["chunks"].sort(key=lambda c: c["rows"][0])
    return index


# ---------------------------------------------------------------------------- index checks
def _fail(what: str, why: str) -> None:
    raise UnsafeManifestError(f"{what}: {why}")


def validate_index(index: Any, what: str = "index") -> dict:
    """Check an index read from a manifest before anything in it is used as a path or a size.

    Nothing a reader allocates may rest on a claim the index does not back up, so it must agree
    with itself: every chunk's rows lie inside its tensor's shape and the chunks of each tensor
    tile its rows exactly once, so the tensor's numel x element size is the sum of its chunks'
    payloads; an object is listed with one size; a key inside an object holds one dtype and
    shape; and the payloads of an object's tensors, its 8-byte header length and a header of at
    most ``_MAX_HEADER`` bytes add up to its size. What is left to trust is that the objects have
    the sizes listed, which :func:`read_chunks` asks the store before anything is read (and
    :func:`load_tensors` before it allocates)."""
    if not isinstance(index, dict):
        _fail(what, "must be an object of tensor entries")
    objects: dict[str, tuple[int, dict, str]] = {}  # sha -> (size, {key: target}, first label)
    for name, e in index.items():
        w = f"{what} tensor {name!r}"
        if not isinstance(e, dict) or set(e) != {"dtype", "shape", "chunks"}:
            _fail(w, "entry must have exactly dtype, shape, chunks")
        if not isinstance(e["dtype"], str) or e["dtype"] not in _BY_NAME:
            _fail(w, f"unknown dtype {e['dtype']!r}")
        shape = e["shape"]
        if not isinstance(shape, list) or not all(type(s) is int and 0 <= s < 1 << 48
                                                  for s in shape):
            _fail(w, f"bad shape {shape!r}")
        rows = shape[0] if shape else 1
        chunks = e["chunks"]
        if not isinstance(chunks, list):
            _fail(w, "chunks must be a list")
        for c in chunks:
            if not isinstance(c, dict) or set(c) - {"key"} != {"sha", "size", "rows"}:
                _fail(w, f"chunk {c!r} must have exactly sha, size, rows (and key)")
            check_sha256(c["sha"], f"{w} chunk")
            key = c.get("key", "data")
            if not isinstance(key, str) or not _KEY_RE.match(key):
                _fail(w, f"chunk key {key!r} must be 'data' or a decimal position")
            r = c["rows"]
            if (not isinstance(r, list) or len(r) != 2 or not all(type(x) is int for x in r)
                    or not 0 <= r[0] <= r[1] <= rows):
                _fail(w, f"chunk rows {r!r} outside [0, {rows}]")
            if type(c["size"]) is not int or c["size"] < 8:
                _fail(w, f"chunk size {c['size']!r} invalid")
            t = _target(e, c, f"{w} rows {r[0]}:{r[1]}")
            size, keys, _ = objects.setdefault(c["sha"], (c["size"], {}, t.label))
            if size != c["size"]:
                _fail(w, f"object {c['sha']} is listed with sizes {size} and {c['size']}")
            held = keys.setdefault(key, t)  # two names may share a key (identical tensors)
            if (held.code, held.shape) != (t.code, t.shape):
                _fail(w, f"object {c['sha']} key {key!r} is claimed as {held.code}{held.shape} "
                         f"and as {t.code}{t.shape}")
        pos = 0
        for a, b in sorted(c["rows"] for c in chunks):
            if a != pos:
                _fail(w, f"chunks do not tile the rows: gap or overlap at row {pos}")
            pos = b
        if rows > 0 and pos != rows:
            _fail(w, f"chunks cover rows [0, {pos}) of {rows}")
    for sha, (size, keys, label) in objects.items():
        payload = sum(t.nbytes for t in keys.values())
        if not 0 <= size - 8 - payload <= _MAX_HEADER:
            _fail(label, f"object {sha} is listed with {size} bytes, which does not fit the "
                         f"{payload} bytes of tensor data the index puts in it (plus an 8-byte "
                         f"length and a header of at most {_MAX_HEADER} bytes)")
    return index


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


def index_dtypes(index: Mapping[str, dict]) -> dict[str, torch.dtype]:
    """``{name: torch dtype}`` of a validated index: what a state tree may reference by name
    (``state.check_state_tree``), known without reading any tensor data."""
    return {name: _BY_NAME[e["dtype"]][0] for name, e in index.items()}


# ---------------------------------------------------------------------------- loading
_BY_CODE = {c: d.itemsize for d, _, c in _DTYPES}
_READ_BLOCK = 1 << 20


@dataclass
class _Target:
    """What a reader wants from one tensor ``key`` of an object: the piece must have ``code`` and
    ``shape``; bytes ``[lo, hi)`` of it go to ``dest`` (a uint8 numpy view), or nowhere (verify)."""

    key: str
    code: str
    shape: list
    label: str
    nbytes: int
    dest: Any = None
    lo: int = 0
    hi: int = 0

    @property
    def full(self) -> bool:
        return self.dest is not None and self.lo == 0 and self.hi == self.nbytes


def _target(entry: Mapping, chunk: Mapping, label: str) -> _Target:
    dtype, code = _BY_NAME[entry["dtype"]]
    shape = entry["shape"]
    a, b = chunk["rows"]
    chunk_shape = ([b - a] + shape[1:]) if shape else []
    nbytes = dtype.itemsize
    for x in chunk_shape:
        nbytes *= x
    return _Target(chunk.get("key", "data"), code, chunk_shape, label, nbytes)


def _object_label(sha: str, targets: Sequence[_Target]) -> str:
    more = f" and {len(targets) - 1} more" if len(targets) > 1 else ""
    return f"object {sha} ({targets[0].label}{more})" if targets else f"object {sha}"


def _parse_header(raw: bytes, data_len: int, what: str, sha: str) -> dict[str, tuple]:
    """``{key: (code, shape, start, stop)}`` in file order, of a safetensors header whose tensors
    must tile exactly ``data_len`` bytes; anything else is a :class:`CorruptObjectError`."""
    def bad(why: str):
        raise CorruptObjectError(f"{what} is not a valid safetensors object ({why}); refusing to "
                                 "interpret it", sha=sha)

    try:
        h = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        bad("unparseable header")
    if not isinstance(h, dict):
        bad("header is not an object")
    entries = {}
    for k, v in h.items():
        if k == "__metadata__":
            continue
        if not _KEY_RE.match(k) or not isinstance(v, dict) or \
                set(v) != {"dtype", "shape", "data_offsets"}:
            bad(f"unexpected entry {k!r}")
        code, shape, offs = v["dtype"], v["shape"], v["data_offsets"]
        if code not in _BY_CODE or not isinstance(shape, list) or not all(
                type(x) is int and 0 <= x < 1 << 48 for x in shape):
            bad(f"entry {k!r} has dtype {code!r} shape {shape!r}")
        if not (isinstance(offs, list) and len(offs) == 2 and all(type(x) is int for x in offs)
                and 0 <= offs[0] <= offs[1]):
            bad(f"entry {k!r} has offsets {offs!r}")
        n = _BY_CODE[code]
        for x in shape:
            n *= x
        if offs[1] - offs[0] != n:
            bad(f"entry {k!r} offsets do not match its shape")
        entries[k] = (code, shape, offs[0], offs[1])
    entries = dict(sorted(entries.items(), key=lambda kv: (kv[1][2], kv[1][3])))  # file order
    pos = 0
    for _, _, a, b in entries.values():
        if a != pos:
            bad(f"data has a gap or overlap at byte {pos}")
        pos = b
    if pos != data_len:
        raise CorruptObjectError(f"{what} size does not match its header", sha=sha)
    return entries


def _match(entries: Mapping[str, tuple], targets: Sequence[_Target], sha: str) -> None:
    for t in targets:
        e = entries.get(t.key)
        if e is None or e[0] != t.code or e[1] != t.shape:
            raise CorruptObjectError(f"object {sha} ({t.label}) is not the expected safetensors "
                                     f"chunk ({t.code}{t.shape} as {t.key!r}); refusing to "
                                     "interpret it", sha=sha)


def _header_len(head: bytes, size: int, what: str, sha: str) -> int:
    n = struct.unpack("<Q", head)[0] if len(head) == 8 else -1
    if not 0 < n <= min(_MAX_HEADER, size - 8):
        raise CorruptObjectError(f"{what} has no valid safetensors header; refusing to "
                                 "interpret it", sha=sha)
    return n


def _deliver(entries: Mapping[str, tuple], targets: Sequence[_Target], fill) -> None:
    """Walk the object's tensors in file order; ``fill(buf)`` reads the next ``len(buf)`` bytes.
    A wanted whole piece is read straight into its destination (zero copy), the rest into scratch."""
    wants: dict[str, list[_Target]] = {}
    for t in targets:
        wants.setdefault(t.key, []).append(t)
    scratch = None
    for key, (_, _, a, b) in entries.items():  # file order (see _parse_header)
        if a == b:
            continue
        ts = wants.get(key, ())
        first = next((t for t in ts if t.full), None)
        if first is not None:
            buf = first.dest
        else:
            if scratch is None or scratch.nbytes < b - a:
                scratch = np.empty(b - a, dtype=np.uint8)
            buf = scratch[: b - a]
        fill(buf)
        for t in ts:
            if t is not first and t.dest is not None:
                t.dest[...] = buf[t.lo:t.hi]


def _read_object(store: RunStore, sha: str, size: int, targets: Sequence[_Target],
                 algo: str = "sha256") -> None:
    """Read object ``sha`` once, deliver every target, verify size, header and ``algo`` hash."""
    what = _object_label(sha, targets)
    path = store.local_object_path(sha)
    if path is None:
        data = store.get_bytes(sha, verify=True, what=targets[0].label if targets else "",
                               algo=algo)
        if len(data) != size:  # hash matched, so the manifest itself is inconsistent
            raise CorruptObjectError(f"{what} has {len(data)} bytes, the manifest says {size}",
                                     sha=sha)
        n = _header_len(data[:8], size, what, sha)
        entries = _parse_header(data[8:8 + n], size - 8 - n, what, sha)
        _match(entries, targets, sha)
        mv = memoryview(data)
        pos = [8 + n]

        def fill_from_bytes(buf):
            k = buf.nbytes
            buf[...] = np.frombuffer(mv[pos[0]:pos[0] + k], dtype=np.uint8)
            pos[0] += k

        _deliver(entries, targets, fill_from_bytes)
        return
    h = new_hasher(algo)
    try:
        with open(path, "rb", buffering=0) as f:
            actual = os.fstat(f.fileno()).st_size
            if actual != size:
                raise CorruptObjectError(f"{what} at {path} has {actual} bytes, the manifest says "
                                         f"{size} (truncated or replaced)", sha=sha, path=path)
            head = f.read(8)
            n = _header_len(head, size, f"{what} at {path}", sha)
            header = f.read(n)
            entries = _parse_header(header, size - 8 - n, what, sha)
            _match(entries, targets, sha)
            h.update(head)
            h.update(header)

            def fill_from_file(buf):
                # read and hash block by block: each block is hashed while it is still in the CPU
                # cache (about a third faster than reading everything, then hashing it)
                mv = memoryview(buf).cast("B")
                got = 0
                while got < mv.nbytes:
                    k = f.readinto(mv[got:got + _READ_BLOCK])
                    if not k:
                        raise CorruptObjectError(f"{what} at {path} is truncated", sha=sha,
                                                 path=path)
                    h.update(mv[got:got + k])
                    got += k

            _deliver(entries, targets, fill_from_file)
    except FileNotFoundError as e:
        raise CorruptObjectError(f"{what} is missing (expected at {path})", sha=sha,
                                 path=path) from e
    store._count(objects_read=1, bytes_read=size)
    digest = h.hexdigest()
    if digest != sha:
        raise CorruptObjectError(f"{what} at {path} is corrupted: its bytes hash to {digest}",
                                 sha=sha, path=path)


def check_object(store: RunStore, sha: str, size: int,
                 refs: Sequence[tuple[Mapping, Mapping, str]], algo: str = "sha256") -> None:
    """Read object ``sha`` and check its size, ``algo`` hash and header against every ``(index
    entry, chunk, label)`` that references it (a packed object holds several tensors)."""
    _read_object(store, sha, size, [_target(e, c, label) for e, c, label in refs], algo)


def _check_sizes(store: RunStore, objects: Mapping[str, tuple[int, Sequence[_Target]]]) -> None:
    """Ask the store for the size of every object about to be read. The index only promises them
    (consistently: see :func:`validate_index`), and a reader allocates what the index promises, so
    a lie is caught here, before the allocation, rather than when the object is read."""
    def check(item):
        sha, (size, targets) = item
        actual = store.object_size(sha)
        if actual is None:
            raise CorruptObjectError(f"{_object_label(sha, targets)} is missing from {store.uri}",
                                     sha=sha)
        if actual != size:
            raise CorruptObjectError(f"{_object_label(sha, targets)} has {actual} bytes, the "
                                     f"manifest says {size} (truncated or replaced)", sha=sha)

    store.map(check, list(objects.items()))


@dataclass
class ChunkRead:
    """Rows ``[lo, hi)`` of one stored chunk (counted from the chunk's first row), for ``dest``.

    ``dest`` has the shape of those rows (``[hi - lo, *shape[1:]]``; ``[]`` for a 0-dim tensor)
    and the tensor's dtype, on any device; it may be a view into a model's parameter or an FSDP
    shard. None: read and verify only."""

    entry: Mapping
    """The tensor's index entry (``dtype``, ``shape``, ``chunks``)."""
    chunk: Mapping
    """One of ``entry["chunks"]``."""
    lo: int
    hi: int
    dest: Optional[torch.Tensor]
    label: str
    """Names the tensor in error messages (checkpoint, group, tensor)."""


def read_chunks(store: RunStore, reads: Sequence[ChunkRead], *, algo: str = "sha256",
                check_sizes: bool = True) -> None:
    """Fill every ``read.dest`` from the store, reading each object once (however many reads and
    tensors it serves) and verifying its size, its ``algo`` hash and its header. The store is asked
    for the size of every object before anything is read. A destination that is not a contiguous
    CPU tensor is filled through a CPU buffer of its size, then copied (e.g. to the GPU).
    ``check_sizes=False``: the caller already asked the store (before allocating the dests)."""
    objects: dict[str, tuple[int, list[_Target]]] = {}
    copy_back = []
    for r in reads:
        e, c = r.entry, r.chunk
        a, b = c["rows"] if e["shape"] else (0, 1)
        if not 0 <= r.lo <= r.hi <= b - a:
            raise ValueError(f"{r.label}: rows {r.lo}:{r.hi} are outside chunk rows {a}:{b}")
        tgt = _target(e, c, f"{r.label} rows {a}:{b}")
        objects.setdefault(c["sha"], (c["size"], []))[1].append(tgt)
        if r.dest is None:
            continue
        dtype = _BY_NAME[e["dtype"]][0]
        want = ([r.hi - r.lo] + e["shape"][1:]) if e["shape"] else []
        dest = r.dest.detach()  # same storage; parameters may require grad
        if list(dest.shape) != want or dest.dtype != dtype:
            raise ValueError(f"{r.label}: destination {dest.dtype}{list(dest.shape)} does not fit "
                             f"rows {a + r.lo}:{a + r.hi} ({dtype}{want})")
        if not dest.is_contiguous() or dest.device.type != "cpu":
            tmp = torch.empty(want, dtype=dtype)
            copy_back.append((dest, tmp))
            dest = tmp
        row_bytes = tgt.nbytes // (b - a) if e["shape"] and b > a else tgt.nbytes
        tgt.dest = _raw_bytes(dest)
        tgt.lo, tgt.hi = (r.lo * row_bytes, r.hi * row_bytes) if e["shape"] else (0, tgt.nbytes)

    if check_sizes:  # the index agrees with itself; now the store must agree too
        _check_sizes(store, objects)
    # largest first: the pool's threads finish together instead of waiting on one big object
    store.map(lambda item: _read_object(store, item[0], item[1][0], item[1][1], algo),
              sorted(objects.items(), key=lambda item: -item[1][0]))
    with torch.no_grad():
        for dest, tmp in copy_back:
            dest.copy_(tmp)


def load_tensors(store: RunStore, index: Mapping[str, dict], names: Optional[Sequence[str]] = None,
                 *, out: Optional[Mapping[str, torch.Tensor]] = None, what: str = "",
                 algo: str = "sha256") -> dict[str, torch.Tensor]:
    """Rebuild whole tensors from ``index``, verifying every object read (each is read once, even
    when it packs several of the tensors).

    Args:
        names: tensors to load (default all); unknown names raise KeyError listing known ones.
        out: optional preallocated destinations (``{name: tensor}``, e.g. a model's own
            parameters) written in place; their shapes and dtypes must match.
        what: label for error messages (e.g. ``"checkpoint 0000…-ab12 group policy"``).
        algo: the hash algorithm the objects are named by (the manifest's ``hash``).
    Returns ``{name: tensor}`` (the ``out`` tensors where given). Nothing is allocated before the
    index has validated and the store has confirmed every object's size.
    """
    validate_index(index, what or "index")
    names = list(index) if names is None else list(names)
    for n in names:
        if n not in index:
            raise KeyError(f"tensor {n!r} is not in {what or 'the index'}; known: "
                           f"{', '.join(sorted(index)[:20])}{' …' if len(index) > 20 else ''}")
    label = f"{what} " if what else ""
    for name in names:  # destinations are checked before anything is read or allocated
        e = index[name]
        dest = None if out is None else out.get(name)
        if dest is not None and (list(dest.shape) != e["shape"] or
                                 dest.dtype != _BY_NAME[e["dtype"]][0]):
            raise ValueError(f"out[{name!r}] has {dest.dtype}{list(dest.shape)}, the checkpoint "
                             f"has {e['dtype']}{e['shape']}")
    # sizes first, then allocation: read_chunks would check them too, but after the allocation
    _check_sizes(store, {c["sha"]: (c["size"], [_target(index[n], c, f"{label}tensor {n!r}")])
                         for n in names for c in index[n]["chunks"]})
    result: dict[str, torch.Tensor] = {}
    reads = []
    for name in names:
        e = index[name]
        dest = None if out is None else out.get(name)
        if dest is None:
            dest = torch.empty(e["shape"], dtype=_BY_NAME[e["dtype"]][0])
            result[name] = dest
        else:
            result[name] = out[name]
        for c in e["chunks"]:
            a, b = c["rows"] if e["shape"] else (0, 1)
            reads.append(ChunkRead(e, c, 0, b - a, dest[a:b] if e["shape"] else dest,
                                   f"{label}tensor {name!r}"))
    read_chunks(store, reads, algo=algo, check_sizes=False)
    return result
