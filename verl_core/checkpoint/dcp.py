"""torch.distributed.checkpoint (DCP) over the run store: a StorageWriter and a StorageReader.

What belongs here: the two classes DCP calls, the translation between DCP's plans/metadata and
the run store's tensor index (``tensors.py``), and the CPU snapshot ("staging") a background save
writes from (``snapshot_state``). What does not: manifests, the commit protocol,
``latest``, fallback and retention (``manager.py``, which drives :func:`save` here and hands the
writer its commit step as ``finish``; ``loading.py``, which drives :func:`load`; ``retention.py``).

Division of labour (as torchtitan and torchtune use DCP, with our storage underneath):

* DCP plans. Every rank lists the chunks it holds (an FSDP2 DTensor: its rows; a plain tensor:
  all of it); the coordinator deduplicates replicated items, so a tensor every rank holds is
  written by one rank only, and on load computes, for each rank, which stored chunks overlap the
  rows its target tensors (of any sharding) own: that is the resharding.
* The store stores. :class:`StoreWriter` packs a rank's write items into ~16 MiB content-addressed
  safetensors objects (``tensors.save_tensors``: an unchanged frozen layer or reference model is
  never written twice, by any rank, in any checkpoint) and returns each item's chunk list as its
  ``WriteResult``; on the coordinator, ``finish`` joins every rank's chunks into one tensor index,
  which is exactly the index a single-process save writes, and passes it to the manager's commit.
  :class:`StoreReader` turns a manifest's index back into DCP ``Metadata`` (one DCP chunk per
  stored chunk) and serves DCP's read items with ``tensors.read_chunks``: each object read once,
  size- and hash-verified, rows copied straight into the target tensors.

Nothing is pickled into the store. DCP's defaults would ``torch.save`` every non-tensor value
and its ``Metadata``; here the state reaching DCP holds tensors only (non-tensor leaves travel in
the manifest's JSON state tree, see ``state.py``), the writer refuses any non-tensor item, the
Metadata is rebuilt from the JSON manifest on load, and the reader refuses non-tensor items. (DCP's
own coordination pickles plans and results between the live ranks of one job over the process
group, as ``DataParallel.gather_objects`` does; nothing read from storage is ever unpickled.)

Layout limits: stored chunks are row ranges (dim 0), which is how FSDP2/DDP shard and replicate.
A write item cut along another dim (tensor parallel) is refused with a message; loading into any
target sharding works (a target region that is not whole rows is read as rows, then narrowed).
"""

from __future__ import annotations

import warnings
from collections import defaultdict
from typing import Any, Callable, Collection, Mapping, Optional

import numpy as np
import torch
from torch.distributed.checkpoint import load as _dcp_load
from torch.distributed.checkpoint import save as _dcp_save
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadItemType, WriteItemType
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult
from torch.futures import Future

from verl_core.errors import CheckpointSaveError, CorruptObjectError
from verl_core.store import RunStore
from verl_core.checkpoint.tensors import (
    DEFAULT_CHUNK_BYTES,
    ChunkRead,
    dtype_name,
    read_chunks,
    save_tensors,
    torch_dtype,
)

__all__ = ["StoreWriter", "StoreReader", "save", "load", "snapshot_state", "sync_device", "SEP"]

SEP = "/"
"""DCP keys are ``<group>/<tensor name>``; group names cannot contain it
(``manifest._GROUP_RE``)."""

# ``no_dist=True`` is how a single process uses DCP here, on purpose, on every save and load.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or "
                        "uninitialized", category=UserWarning)


def _done(value: Any) -> Future:
    fut: Future = Future()
    fut.set_result(value)
    return fut


class StoreWriter(StorageWriter):
    """DCP ``StorageWriter`` that stores each rank's tensor chunks as content-addressed objects.

    Args:
        store: the run store (every rank opens the same one).
        chunk_bytes: target object size (small tensors are packed, big ones cut along dim 0).
        algo: hash algorithm that names new objects (``sha256`` or ``blake3``).
        finish: run on the coordinator once every rank's objects are written, with the joined
            tensor index ``{dcp key: index entry}``; it commits the checkpoint and returns what
            every rank's :func:`save` returns (a ``CheckpointInfo``).
    """

    def __init__(self, store: RunStore, *, chunk_bytes: int = DEFAULT_CHUNK_BYTES,
                 algo: str = "sha256", finish: Optional[Callable[[dict], Any]] = None):
        super().__init__()
        self.store, self.chunk_bytes, self.algo = store, chunk_bytes, algo
        self._finish = finish
        self.is_coordinator = False

    def reset(self, checkpoint_id: Any = None) -> None:
        pass

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.is_coordinator = is_coordinator

    def prepare_local_plan(self, plan):
        for item in plan.items:
            fqn = item.index.fqn
            if item.type == WriteItemType.BYTE_IO:
                raise CheckpointSaveError(
                    f"{fqn!r} is not a tensor: non-tensor values belong in the JSON state tree "
                    "(CheckpointManager.save_distributed puts them there); this storage never "
                    "pickles")
            td = item.tensor_data
            size, off, sizes = list(td.size), list(td.chunk.offsets), list(td.chunk.sizes)
            if off[1:] != [0] * (len(size) - 1) or sizes[1:] != size[1:]:
                raise CheckpointSaveError(
                    f"{fqn!r}: a chunk at offsets {off} of size {sizes} of a {size} tensor is not "
                    "a range of whole rows; only dim-0 sharding (FSDP2, DDP, one process) is "
                    "stored (gather tensor-parallel dims first)")
            dtype_name(td.properties.dtype)  # refuses dtypes the index cannot name
        return plan

    def prepare_global_plan(self, plans):
        return plans

    def write_data(self, plan, planner) -> Future:
        tensors: dict[str, torch.Tensor] = {}
        layout: dict[str, tuple[list, int]] = {}
        for item in plan.items:
            fqn = item.index.fqn
            if fqn in tensors:
                raise CheckpointSaveError(f"{fqn!r}: this rank holds more than one chunk of it; "
                                          "only dim-0 sharding (one range of rows) is stored")
            t = planner.resolve_data(item)
            if not isinstance(t, torch.Tensor):
                raise CheckpointSaveError(f"{fqn!r} resolved to {type(t).__name__}, not a tensor")
            td = item.tensor_data
            sizes = list(td.chunk.sizes)
            if list(t.shape) != sizes:
                # a local shard may carry padding rows past its chunk (FSDP2 pads uneven shards)
                if not (t.dim() and list(t.shape[1:]) == sizes[1:] and t.shape[0] >= sizes[0]):
                    raise CheckpointSaveError(f"{fqn!r}: local data {list(t.shape)} does not "
                                              f"match its planned chunk {sizes}")
                t = t[: sizes[0]]
            tensors[fqn] = t.detach()
            layout[fqn] = (list(td.size), int(td.chunk.offsets[0]) if len(td.size) else 0)
        # one packing per group, as a single-process save packs them: an object never mixes
        # groups, so a group's objects are its own (shared groups, dedupe of a frozen model)
        by_group: dict[str, list[str]] = defaultdict(list)
        for fqn in tensors:
            by_group[fqn.split(SEP, 1)[0]].append(fqn)
        index: dict[str, dict] = {}
        for keys in by_group.values():
            index.update(save_tensors(self.store, {k: tensors[k] for k in keys},
                                      chunk_bytes=self.chunk_bytes, algo=self.algo,
                                      layout={k: layout[k] for k in keys}))
        return _done([WriteResult(index=item.index,
                                  size_in_bytes=sum(c["size"] for c in index[item.index.fqn]
                                                    ["chunks"]),
                                  storage_data=index[item.index.fqn]["chunks"])
                      for item in plan.items])

    def finish(self, metadata: Metadata, results: list) -> None:
        index: dict[str, dict] = {}
        for fqn, md in metadata.state_dict_metadata.items():
            if not isinstance(md, TensorStorageMetadata):
                raise CheckpointSaveError(f"{fqn!r} is not a tensor; this storage never pickles")
            index[fqn] = {"dtype": dtype_name(md.properties.dtype), "shape": list(md.size),
                          "chunks": []}
        for rank_results in results:
            for r in rank_results:
                index[r.index.fqn]["chunks"].extend(r.storage_data)
        for e in index.values():
            e["chunks"].sort(key=lambda c: c["rows"])
        result = self._finish(index) if self._finish is not None else index
        # DCP broadcasts this Metadata object from the coordinator to every rank after finish():
        # that is how every rank learns what was committed
        metadata.storage_data = {"result": result}

    def storage_meta(self):
        return None

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return False


class StoreReader(StorageReader):
    """DCP ``StorageReader`` over one manifest's groups (already read and validated).

    Args:
        store: the run store.
        groups: ``{group: group doc}`` of the manifest (``tensors`` index, ``hash``).
        keys: the DCP keys (``<group>/<tensor>``) to expose (default: every tensor of ``groups``);
            DCP plans reads for the keys of the target state dict, which must be among them.
        what: names the checkpoint in error messages.
        default_algo: hash algorithm of groups that do not name one (``verl-checkpoint/1``).
        on_corrupt: ``(sha, algo) -> None``, called before a damaged object's error propagates
            (the manager quarantines it).
    """

    def __init__(self, store: RunStore, groups: Mapping[str, Mapping], *,
                 keys: Optional[Collection[str]] = None, what: str = "checkpoint",
                 default_algo: str = "sha256",
                 on_corrupt: Optional[Callable[[str, str], None]] = None):
        super().__init__()
        self.store = store
        self._on_corrupt = on_corrupt
        self._chunks: dict[tuple, tuple] = {}  # (key, offsets) -> (entry, chunk, algo, label)
        md: dict[str, TensorStorageMetadata] = {}
        for g, doc in groups.items():
            algo = doc.get("hash", default_algo)
            for name, e in doc["tensors"].items():
                key = f"{g}{SEP}{name}"
                if keys is not None and key not in keys:
                    continue
                shape = e["shape"]
                chunks = []
                for c in e["chunks"]:
                    a, b = c["rows"]
                    off = (a,) + (0,) * (len(shape) - 1) if shape else ()
                    sizes = [b - a] + shape[1:] if shape else []
                    chunks.append(ChunkStorageMetadata(offsets=torch.Size(off),
                                                       sizes=torch.Size(sizes)))
                    self._chunks[(key, off)] = (e, c, algo, f"{what} group {g!r} tensor {name!r}")
                md[key] = TensorStorageMetadata(
                    properties=TensorProperties(dtype=torch_dtype(e["dtype"])),
                    size=torch.Size(shape), chunks=chunks)
        self.metadata = Metadata(state_dict_metadata=md)

    def reset(self, checkpoint_id: Any = None) -> None:
        pass

    def read_metadata(self) -> Metadata:
        return self.metadata

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any,
                              **kwargs: Any) -> None:
        pass

    def prepare_local_plan(self, plan):
        return plan

    def prepare_global_plan(self, plans):
        return plans

    def read_data(self, plan, planner) -> Future:
        reads: dict[str, list[ChunkRead]] = defaultdict(list)  # by hash algorithm
        narrowed = []  # (dest, rows buffer, offsets, lengths): regions that are not whole rows
        dests = []
        for item in plan.items:
            if item.type == LoadItemType.BYTE_IO:
                raise CorruptObjectError(f"{item.storage_index.fqn!r} is stored as bytes; this "
                                         "storage holds tensors only and never unpickles")
            key = (item.storage_index.fqn, tuple(item.storage_index.offset or ()))
            if key not in self._chunks:
                raise CorruptObjectError(f"DCP asked for chunk {key} that the manifest does not "
                                         "list")
            e, c, algo, label = self._chunks[key]
            dest = planner.resolve_tensor(item)
            dests.append((item, dest))
            shape = e["shape"]
            so, ln = list(item.storage_offsets), list(item.lengths)
            if not shape:
                reads[algo].append(ChunkRead(e, c, 0, 1, dest, label))
            elif so[1:] == [0] * (len(shape) - 1) and ln[1:] == shape[1:]:
                reads[algo].append(ChunkRead(e, c, so[0], so[0] + ln[0], dest, label))
            else:
                buf = torch.empty([ln[0]] + shape[1:], dtype=torch_dtype(e["dtype"]))
                reads[algo].append(ChunkRead(e, c, so[0], so[0] + ln[0], buf, label))
                narrowed.append((dest, buf, so, ln))
        for algo, rs in reads.items():
            try:
                read_chunks(self.store, rs, algo=algo)
            except CorruptObjectError as err:
                if err.sha and self._on_corrupt is not None:
                    self._on_corrupt(err.sha, algo)
                raise
        with torch.no_grad():
            for dest, buf, so, ln in narrowed:
                region = buf
                for d in range(1, buf.dim()):
                    region = region.narrow(d, so[d], ln[d])
                dest.detach().copy_(region)
        for item, dest in dests:
            planner.commit_tensor(item, dest)
        return _done(None)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return False


# ------------------------------------------------------------------------------ staging
def _copy_into(dst: torch.Tensor, src: torch.Tensor) -> None:
    """CPU -> CPU: one single-threaded memcpy through numpy. torch's intra-op-parallel ``copy_`` of
    many medium tensors is up to 20x slower on a busy machine (threads wait on each other)."""
    if src.device.type == "cpu" and src.is_contiguous():
        np.copyto(dst.reshape(-1).view(torch.uint8).numpy(),
                  src.reshape(-1).view(torch.uint8).numpy())
    else:
        dst.copy_(src, non_blocking=src.device.type == "cuda")


def _copy_tensor(t: torch.Tensor, key: Any = None, pool: Optional[dict] = None) -> torch.Tensor:
    t = t.detach()
    buf = pool.get(key) if pool is not None else None
    if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
        buf = torch.empty(t.shape, dtype=t.dtype, device="cpu",
                          pin_memory=t.device.type == "cuda" and torch.cuda.is_available())
        if pool is not None:
            pool[key] = buf
    _copy_into(buf, t)
    return buf


def _dtensor_type():
    try:
        from torch.distributed.tensor import DTensor
    except Exception:  # noqa: BLE001 - torch without distributed
        return None
    return DTensor


def snapshot_state(obj: Any, pool: Optional[dict] = None, _path: tuple = ()) -> Any:
    """Deep copy of nested state with every tensor copied to CPU, so training may modify the
    originals right away. A DTensor stays a DTensor (same mesh, placements and global shape) whose
    local shard is the CPU copy, as torch.distributed.checkpoint's own staging makes it, so the
    save still plans and writes it as this rank's shard.

    ``pool`` (``{path: tensor}``) lets repeated snapshots reuse the same CPU buffers: after the
    first save a snapshot is a plain memcpy (no allocation, no page faults). The caller must not
    reuse a pool while a save that reads its buffers is still running."""
    if isinstance(obj, torch.Tensor):
        DTensor = _dtensor_type()
        if DTensor is not None and isinstance(obj, DTensor):
            local = _copy_tensor(obj.to_local(), _path, pool)
            return DTensor(local, obj._spec, requires_grad=False)
        return _copy_tensor(obj, _path, pool)
    if isinstance(obj, np.ndarray):
        return obj.copy()
    if isinstance(obj, Mapping):
        return {k: snapshot_state(v, pool, _path + (k,)) for k, v in obj.items()}
    if isinstance(obj, list):
        return [snapshot_state(v, pool, _path + (i,)) for i, v in enumerate(obj)]
    if isinstance(obj, tuple):
        return tuple(snapshot_state(v, pool, _path + (i,)) for i, v in enumerate(obj))
    return obj  # immutable scalars; anything else is refused by flatten_state in the writer


def sync_device() -> None:
    """Wait for non-blocking device->host copies of a snapshot."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def _unwrap(e: CheckpointException, rank: int) -> BaseException:
    """The error to raise for a DCP failure: this rank's own, else the lowest failing rank's (the
    same type on every rank, so every rank takes the same fallback), noting the others."""
    failures = e.failures
    r = rank if rank in failures else min(failures)
    err = failures[r][0]
    if (len(failures) > 1 or r != rank) and hasattr(err, "add_note"):  # Python >= 3.11
        err.add_note("checkpoint failed on " + "; ".join(
            f"rank {k}: {type(x).__name__}: {x}" for k, (x, _) in sorted(failures.items())))
    return err


def save(state_dict: Mapping[str, torch.Tensor], writer: StoreWriter, *, process_group: Any = None,
         no_dist: bool = True, rank: int = 0) -> Any:
    """``torch.distributed.checkpoint.save`` of a flat ``{key: tensor or DTensor}`` through
    ``writer``; a collective over ``process_group`` unless ``no_dist``. Returns what the writer's
    ``finish`` returned (on every rank); a failure on any rank raises on every rank."""
    try:
        md = _dcp_save(dict(state_dict), storage_writer=writer,
                       planner=DefaultSavePlanner(flatten_state_dict=False),
                       process_group=process_group, no_dist=no_dist)
    except CheckpointException as e:
        raise _unwrap(e, rank) from None
    return (md.storage_data or {}).get("result")


def load(state_dict: Mapping[str, torch.Tensor], reader: StoreReader, *,
         process_group: Any = None, no_dist: bool = True, rank: int = 0) -> None:
    """``torch.distributed.checkpoint.load`` into the tensors of ``state_dict`` (in place, any
    sharding: DCP computes which stored rows each rank reads). A failure on any rank raises on
    every rank."""
    try:
        _dcp_load(dict(state_dict), storage_reader=reader,
                  planner=DefaultLoadPlanner(flatten_state_dict=False),
                  process_group=process_group, no_dist=no_dist)
    except CheckpointException as e:
        raise _unwrap(e, rank) from None
