"""The run store itself (:class:`RunStore`): objects and docs under one fsspec root, atomic
writes, quarantine, compare-and-swap docs and logs. The package docstring has the layout."""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import re
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Iterator, Optional, Sequence

import fsspec
from fsspec.asyn import AsyncFileSystem
from fsspec.implementations.local import LocalFileSystem

from verl_core.errors import (CorruptObjectError, PermanentError, StoreUnavailableError,
                              UnsafeManifestError)
from verl_core.store.hashing import (_SEGMENT_RE, canonical_json, check_doc_name, check_sha256,
                                     hash_hex, is_sha256, new_hasher)
from verl_core.store.io import NotFoundError, _io, resolve_storage_options

log = logging.getLogger(__name__)

STORE_FORMAT = "verl-run-store/1"
_MISSING = object()


@dataclass
class StoreStats:
    """Counters since the store object was created (or :meth:`RunStore.reset_stats`)."""

    objects_written: int = 0
    bytes_written: int = 0
    objects_skipped: int = 0
    bytes_skipped: int = 0
    objects_read: int = 0
    bytes_read: int = 0



class RunStore:
    """Content-addressed immutable objects + small named JSON docs under one fsspec root.

    Args:
        root: a local path, ``file://``, ``s3://bucket/prefix`` or any fsspec URL.
        storage_options: passed to fsspec (for S3: ``key``, ``secret``, ``client_kwargs`` …). The
            S3 endpoint defaults to ``$VERL_S3_ENDPOINT`` or ``$AWS_ENDPOINT_URL``.
        io_threads: parallel object reads/writes (hashing and file I/O release the GIL).
        fsync: locally, fsync each file before its atomic rename (survives power loss, not just a
            killed process). Object stores ignore it.
        create: create the root and its ``store.json`` (incarnation id) if missing.
        op_timeout_s: deadline of one call on an object store (default ``$VERL_STORE_TIMEOUT_S``
            or 300 s). Client timeouts do not cover every way a request can stall (seen here: a
            PUT to a frozen server waited forever); past the deadline the call is cancelled and
            raises :class:`StoreUnavailableError`, so the phase is retried instead of hanging.
    """

    def __init__(self, root: str, storage_options: Optional[dict] = None, *,
                 io_threads: Optional[int] = None, fsync: bool = True, create: bool = True,
                 op_timeout_s: Optional[float] = None):
        if not isinstance(root, str) or not root:
            raise PermanentError(f"store root {root!r} must be a non-empty path or URL")
        opts = resolve_storage_options(root, storage_options)
        with _io(f"opening store {root}"):
            self.fs, path = fsspec.core.url_to_fs(root, **opts)
        self.is_local = isinstance(self.fs, LocalFileSystem)
        self._async = isinstance(self.fs, AsyncFileSystem)
        self.op_timeout_s = float(op_timeout_s or os.environ.get("VERL_STORE_TIMEOUT_S") or 300)
        self.root = (os.path.abspath(path) if self.is_local else path.rstrip("/"))
        self.uri = self.root if self.is_local else root.rstrip("/")
        # the resolved options (endpoint and timeouts included): every fsspec call of the run
        # that does not go through this store (finalize's export, a worker's own store, the
        # probe) builds its filesystem from these, never from the caller's raw options
        self.storage_options = opts
        self.fsync = fsync
        self.io_threads = io_threads or (4 if self.is_local else 16)
        self.stats = StoreStats()
        self._stats_lock = threading.Lock()
        self._made_dirs: set[str] = set()
        self._pool: Optional[ThreadPoolExecutor] = None
        self._pool_lock = threading.Lock()
        self._incarnation: Optional[str] = None
        self._create = create
        if create:
            self._ensure_root()

    def __repr__(self) -> str:
        return f"RunStore({self.uri!r})"

    # ------------------------------------------------------------------ paths
    def _p(self, rel: str) -> str:
        return f"{self.root}/{rel}"

    def _call(self, method: str, *args, **kwargs):
        """``self.fs.<method>(...)``, with the store's deadline on async filesystems (s3fs …),
        whose sync wrappers cancel the request when it passes."""
        if self._async:
            kwargs["timeout"] = self.op_timeout_s
        return getattr(self.fs, method)(*args, **kwargs)

    def object_path(self, sha: str) -> str:
        """Full path of object ``sha`` (validated: hex only, so it cannot escape the store)."""
        check_sha256(sha)
        return self._p(f"objects/{sha[:2]}/{sha}")

    def doc_path(self, name: str) -> str:
        return self._p(check_doc_name(name) + ".json")

    def map(self, fn, items: Sequence) -> list:
        """Run ``fn`` over ``items`` on the store's I/O thread pool; re-raise the first error."""
        items = list(items)
        if len(items) <= 1 or self.io_threads <= 1:
            return [fn(x) for x in items]
        with self._pool_lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.io_threads, thread_name_prefix="runstore-io")
        futures = [self._pool.submit(fn, x) for x in items]
        out, first_err = [], None
        for f in futures:  # wait for all, so no write is still running when we raise
            try:
                out.append(f.result())
            except BaseException as e:  # noqa: BLE001 - re-raised below
                if first_err is None:
                    first_err = e
                    for g in futures:  # fail fast: drop what has not started yet
                        g.cancel()
                out.append(None)
        if first_err is not None:
            raise first_err
        return out

    def _count(self, **kw: int) -> None:
        with self._stats_lock:
            for k, v in kw.items():
                setattr(self.stats, k, getattr(self.stats, k) + v)

    def reset_stats(self) -> StoreStats:
        """Return the current counters and start new ones."""
        with self._stats_lock:
            old, self.stats = self.stats, StoreStats()
        return old

    # ------------------------------------------------------------------ raw file ops
    def _makedirs(self, d: str) -> None:
        if d in self._made_dirs:
            return
        if self.is_local:
            os.makedirs(d, exist_ok=True)
        self._made_dirs.add(d)

    def _write_file(self, path: str, parts: Sequence[Any], *, create_only: bool = False) -> bool:
        """Write ``parts`` to ``path`` atomically; False if ``create_only`` and it existed."""
        if self.is_local:
            d = os.path.dirname(path)
            self._makedirs(d)
            tmp = f"{d}/.tmp-{uuid.uuid4().hex}"
            try:
                with open(tmp, "wb") as f:
                    for p in parts:
                        f.write(p)
                    if self.fsync:
                        f.flush()
                        os.fsync(f.fileno())
                if create_only:
                    try:
                        os.link(tmp, path)  # atomic create-if-absent
                    except FileExistsError:
                        return False
                    except OSError:  # no hard links here (some FUSE/SMB mounts): check + rename
                        if os.path.exists(path):
                            return False
                        os.replace(tmp, path)
                    finally:
                        with contextlib.suppress(FileNotFoundError):
                            os.unlink(tmp)
                else:
                    os.replace(tmp, path)
            except BaseException:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
                raise
            return True
        if len(parts) == 1 and isinstance(parts[0], bytes):
            data = parts[0]
        else:  # object stores need one buffer per PUT
            data = b"".join(bytes(p) for p in parts)
        if create_only:
            try:
                self._call("pipe_file", path, data, mode="create")
                return True
            except FileExistsError:
                return False
            except (TypeError, NotImplementedError):
                if self._call("exists", path):
                    return False
        self._call("pipe_file", path, data)
        return True

    def _read_file(self, path: str) -> bytes:
        if self.is_local:
            with open(path, "rb") as f:
                return f.read()
        return self._call("cat_file", path)

    def _size(self, path: str) -> Optional[int]:
        try:
            if self.is_local:
                return os.stat(path).st_size
            if hasattr(self.fs, "call_s3") and hasattr(self.fs, "split_path"):
                # one HEAD; fs.info() would follow a 404 with a LIST (directory check)
                bucket, key, _ = self.fs.split_path(path)
                return int(self._call("call_s3", "head_object", Bucket=bucket,
                                      Key=key)["ContentLength"])
            return int(self._call("info", path)["size"])
        except FileNotFoundError:
            return None

    def _ls(self, rel: str, detail: bool = False) -> list:
        path = self._p(rel)
        try:
            if self.is_local:
                names = sorted(os.listdir(path))
                if not detail:
                    return [f"{path}/{n}" for n in names]
                out = []
                for n in names:
                    with contextlib.suppress(FileNotFoundError):
                        st = os.stat(f"{path}/{n}")
                        out.append({"name": f"{path}/{n}", "size": st.st_size,
                                    "mtime": st.st_mtime, "type": "file" if os.path.isfile(
                                        f"{path}/{n}") else "directory"})
                return out
            self.fs.invalidate_cache(path)
            entries = self._call("ls", path, detail=True)
        except FileNotFoundError:
            return []
        entries = sorted(entries, key=lambda e: e["name"])
        if detail:
            return entries
        return [e["name"] for e in entries]

    def _rm(self, path: str) -> None:
        try:
            if self.is_local:
                os.unlink(path)
            else:
                self._call("rm_file", path)
        except FileNotFoundError:
            pass

    # ------------------------------------------------------------------ incarnation
    def _ensure_root(self) -> None:
        meta_path = self._p("store.json")
        with _io(f"initialising store {self.uri}"):
            if self.is_local and self._create:
                os.makedirs(self.root, exist_ok=True)
            try:
                raw = self._read_file(meta_path)
            except FileNotFoundError:
                if not self._create:
                    raise NotFoundError(f"{self.uri} is not a run store (no store.json); check the "
                                        "path: a run store is a run's folder, e.g. "
                                        "runs/<run-name> or s3://bucket/prefix/<run-name>")
                doc = {"format": STORE_FORMAT, "incarnation_id": uuid.uuid4().hex,
                       "created": time.time()}
                self._write_file(meta_path, [canonical_json(doc)], create_only=True)
                raw = self._read_file(meta_path)  # whoever won the race, everyone reads it back
        try:
            doc = json.loads(raw)
            inc = doc["incarnation_id"]
            if not isinstance(inc, str) or not re.match(r"^[0-9a-f]{32}$", inc):
                raise ValueError(f"bad incarnation_id {inc!r}")
        except (ValueError, KeyError, TypeError) as e:
            raise CorruptObjectError(f"store metadata {meta_path} is unreadable ({e}); the store "
                                     "root is damaged or is not a verl run store",
                                     path=meta_path) from e
        self._incarnation = inc

    @property
    def incarnation_id(self) -> str:
        """Random id written once when the store root was created
        (docs/design.md#rule-5-a-cache-hit-never-uses-missing-data): scope cache keys with it so a
        deleted-and-recreated store misses the cache instead of hitting dead refs."""
        if self._incarnation is None:
            self._ensure_root()
        return self._incarnation  # type: ignore[return-value]

    # ------------------------------------------------------------------ objects
    def object_size(self, sha: str) -> Optional[int]:
        """Size in bytes of object ``sha`` or None if it does not exist."""
        path = self.object_path(sha)
        with _io(f"stat of object {sha}"):
            return self._size(path)

    def has_object(self, sha: str) -> bool:
        return self.object_size(sha) is not None

    def put_parts(self, parts: Sequence[Any], *, sha: Optional[str] = None,
                  algo: str = "sha256", verify_existing: bool = True) -> tuple[str, int, bool]:
        """Store the concatenation of ``parts`` (bytes-like, written without joining locally),
        named by its ``algo`` hash.

        Returns ``(sha, size, written)``; ``written`` is False when an intact object of that hash
        already existed (the incremental case). ``sha`` may be passed if the caller already hashed.

        An existing object of the right size is re-hashed before the write is skipped, and a
        damaged one (flipped bytes keep the size) is moved to ``quarantine/`` and written again:
        otherwise re-running a phase (``--overwrite-cache``) could never repair what it wrote.
        ``verify_existing=False`` trusts the size alone; only checkpoint chunks use it, whose
        incremental saves would re-read every unchanged chunk (the reference model, frozen layers)
        and whose damaged objects loads and ``verify --repair`` quarantine instead.
        """
        views = [memoryview(p).cast("B") for p in parts]
        size = sum(v.nbytes for v in views)
        if sha is None:
            sha = hash_hex(views, algo)
        path = self.object_path(sha)
        with _io(f"writing object {sha} to {self.uri}"):
            existing = self._size(path)
            if existing == size and not verify_existing:
                self._count(objects_skipped=1, bytes_skipped=size)
                return sha, size, False
            if existing == size:
                got = self._file_hash(path, algo)  # None: moved aside (or collected) meanwhile
                if got == sha:
                    self._count(objects_skipped=1, bytes_skipped=size)
                    return sha, size, False
                if got is not None:
                    self._set_aside(sha, path)
            elif existing is not None:
                log.warning("object %s exists with size %d != %d; rewriting it", sha, existing,
                            size)
            self._write_file(path, views)
        self._count(objects_written=1, bytes_written=size)
        return sha, size, True

    def put_bytes(self, data: Any, *, algo: str = "sha256") -> str:
        """Store ``data`` as an immutable object and return its ``algo`` hex digest (skipped if
        present)."""
        return self.put_parts([data], algo=algo)[0]

    def get_bytes(self, sha: str, verify: bool = True, *, what: str = "",
                  algo: str = "sha256", quarantine: bool = False) -> bytes:
        """Read object ``sha``. Missing, or (with ``verify``) a mismatch of its ``algo`` hash,
        raises :class:`CorruptObjectError` naming the object and ``what`` it was for. With
        ``quarantine`` a damaged object is also moved to ``quarantine/`` (its bytes kept), so the
        next write of the same content stores it afresh and later reads find it missing rather
        than damaged; the error's ``quarantined`` names where it went."""
        path = self.object_path(sha)
        label = f"object {sha}" + (f" ({what})" if what else "")
        try:
            with _io(f"reading {label}"):
                data = self._read_file(path)
        except FileNotFoundError as e:
            raise CorruptObjectError(f"{label} is missing from {self.uri} (expected at {path})",
                                     sha=sha, path=path) from e
        self._count(objects_read=1, bytes_read=len(data))
        if verify:
            got = hash_hex([data], algo)
            if got != sha:
                moved = None
                if quarantine:
                    with _io(f"quarantining {label}"):
                        moved = self._set_aside(sha, path, data)
                raise CorruptObjectError(
                    f"{label} at {path} is corrupted: its {len(data)} bytes hash to {got}"
                    + (f"; moved to {moved}" if moved else ""), sha=sha, path=path,
                    quarantined=moved)
        return data

    def local_object_path(self, sha: str) -> Optional[str]:
        """The object's filesystem path for zero-copy reads, or None on non-local stores."""
        return self.object_path(sha) if self.is_local else None

    def iter_objects(self) -> Iterator[tuple[str, int, float]]:
        """Yield ``(sha, size, mtime)`` of every stored object (for garbage collection)."""
        with _io(f"listing objects of {self.uri}"):
            for d in self._ls("objects", detail=True):
                if d.get("type") != "directory":
                    continue
                prefix = d["name"].rstrip("/").rsplit("/", 1)[-1]
                if not re.match(r"^[0-9a-f]{2}$", prefix):
                    continue
                for e in self._ls(f"objects/{prefix}", detail=True):
                    name = e["name"].rstrip("/").rsplit("/", 1)[-1]
                    if is_sha256(name):
                        yield name, int(e.get("size") or 0), _mtime(e)

    def iter_temp_files(self) -> Iterator[tuple[str, float]]:
        """Local only: leftovers ``objects/xx/.tmp-*`` of writes killed mid-way (path, mtime)."""
        if not self.is_local:
            return
        base = self._p("objects")
        if not os.path.isdir(base):
            return
        for prefix in os.listdir(base):
            d = f"{base}/{prefix}"
            if not os.path.isdir(d):
                continue
            for n in os.listdir(d):
                if n.startswith(".tmp-"):
                    with contextlib.suppress(FileNotFoundError):
                        yield f"{d}/{n}", os.stat(f"{d}/{n}").st_mtime

    def delete_object(self, sha: str) -> None:
        path = self.object_path(sha)
        with _io(f"deleting object {sha}"):
            self._rm(path)

    def quarantine_object(self, sha: str, *, algo: str) -> bool:
        """Move a damaged object out of ``objects/`` into ``quarantine/<sha>-<ns>`` and return
        True; return False (and touch nothing) if it is missing or its bytes hash to ``sha`` under
        ``algo`` (the algorithm of the manifest that names it: judged by another one, every intact
        object would look damaged, which is why there is no default).

        Why: saves skip an object that already exists with the right size, so a damaged object
        shared by many checkpoints (the reference model, a frozen layer) would otherwise stay
        damaged in every later checkpoint too. Once it is moved aside, the next save that holds
        those tensors writes it afresh; the damaged bytes are kept for inspection, not deleted."""
        path = self.object_path(sha)
        with _io(f"quarantining object {sha}"):
            got = self._file_hash(path, algo)
            if got is None or got == sha:
                return False
            return self._set_aside(sha, path) is not None

    def _set_aside(self, sha: str, path: str, data: Optional[bytes] = None) -> Optional[str]:
        """Move damaged object ``sha`` (already judged; ``data``: its bytes, if the caller has
        them) from ``path`` to ``quarantine/<sha>-<ns>``; the destination, or None if it vanished
        meanwhile. Callers wrap it in :func:`_io`."""
        dest = self._move(path, self._p(f"quarantine/{sha}-{time.time_ns()}"), data)
        if dest:
            log.warning("object %s is damaged (its bytes hash to something else); moved it to %s "
                        "so the next save rewrites it", sha, dest)
        return dest

    def _move(self, path: str, dest: str, data: Optional[bytes] = None) -> Optional[str]:
        """Move the file at ``path`` (whose bytes are ``data``, read here if not given) to
        ``dest``: ``dest``, or None if it vanished first. On object stores a copy then a delete
        (S3 has no rename)."""
        if self.is_local:
            self._makedirs(os.path.dirname(dest))
            try:
                os.replace(path, dest)
            except FileNotFoundError:
                return None
        else:
            try:
                data = self._read_file(path) if data is None else data
            except FileNotFoundError:
                return None
            self._call("pipe_file", dest, data)
            self._rm(path)
        return dest

    def _file_hash(self, path: str, algo: str) -> Optional[str]:
        """``algo`` digest of the file at ``path``, or None if it does not exist. Local files are
        hashed in 8 MiB reads, so checking a multi-GB object (a model shard of the assets) does
        not hold a second copy of it in memory next to the one being written."""
        try:
            if not self.is_local:
                return hash_hex([self._read_file(path)], algo)
            h = new_hasher(algo)
            with open(path, "rb") as f:
                while chunk := f.read(8 << 20):
                    h.update(chunk)
            return h.hexdigest()
        except FileNotFoundError:
            return None

    def delete_path(self, path: str) -> None:
        """Delete a leftover temp file returned by :meth:`iter_temp_files`."""
        if not path.startswith(self._p("objects/")) or "/.tmp-" not in path:
            raise UnsafeManifestError(f"refusing to delete {path!r}: not a temp file of this store")
        with _io(f"deleting {path}"):
            self._rm(path)

    # ------------------------------------------------------------------ named JSON docs
    def put_json(self, name: str, doc: Any, *, create_only: bool = False) -> bool:
        """Write the small doc ``<name>.json`` atomically (canonical JSON). With ``create_only``
        an existing doc is left alone and False is returned."""
        path = self.doc_path(name)
        with _io(f"writing {name}.json to {self.uri}"):
            return self._write_file(path, [canonical_json(doc)], create_only=create_only)

    def put_json_raw(self, name: str, data: bytes) -> None:
        """Write already-encoded JSON bytes (e.g. a manifest whose name embeds their hash)."""
        path = self.doc_path(name)
        with _io(f"writing {name}.json to {self.uri}"):
            self._write_file(path, [data])

    def get_json_raw(self, name: str) -> bytes:
        path = self.doc_path(name)
        try:
            with _io(f"reading {name}.json from {self.uri}"):
                return self._read_file(path)
        except FileNotFoundError as e:
            raise NotFoundError(f"{name}.json does not exist in {self.uri}") from e

    def get_json(self, name: str, default: Any = _MISSING, *, quarantine: bool = False) -> Any:
        """Read doc ``<name>.json``; missing -> ``default`` if given, else :class:`NotFoundError`;
        unparseable -> :class:`CorruptObjectError` naming the doc. With ``quarantine`` the
        unparseable doc is also moved to ``quarantine/`` (see :meth:`quarantine_doc`), so a
        re-run finds it missing, which its reader knows how to recompute or explain."""
        try:
            raw = self.get_json_raw(name)
        except NotFoundError:
            if default is not _MISSING:
                return default
            raise
        try:
            return json.loads(raw)
        except (ValueError, UnicodeDecodeError) as e:
            moved = self.quarantine_doc(name, raw) if quarantine else None
            raise CorruptObjectError(f"{name}.json in {self.uri} is not valid JSON ({e})"
                                     + (f"; moved to {moved}" if moved else ""),
                                     path=self.doc_path(name), quarantined=moved) from e

    def quarantine_doc(self, name: str, raw: bytes) -> Optional[str]:
        """Move doc ``<name>.json``, whose bytes ``raw`` its reader found damaged, to
        ``quarantine/<name, '/' as '__'>-<ns>.json`` (kept for inspection, like damaged objects)
        and return where it went; None if it changed or vanished since it was read (a writer
        replaced it: the new doc is left alone)."""
        path = self.doc_path(name)
        dest = self._p(f"quarantine/{name.replace('/', '__')}-{time.time_ns()}.json")
        with _io(f"quarantining {name}.json"):
            try:
                if self._read_file(path) != raw:
                    return None
            except FileNotFoundError:
                return None
            if self._move(path, dest, raw) is None:
                return None
        log.warning("%s.json in %s is damaged; moved it to %s", name, self.uri, dest)
        return dest

    def has_json(self, name: str) -> bool:
        with _io(f"stat of {name}.json"):
            return self._size(self.doc_path(name)) is not None

    def list_json(self, folder: str) -> list[str]:
        """Names (without ``.json``) of the docs directly inside ``folder``."""
        check_doc_name(folder)
        with _io(f"listing {folder} in {self.uri}"):
            out = []
            for p in self._ls(folder):
                base = p.rstrip("/").rsplit("/", 1)[-1]
                if base.endswith(".json") and _SEGMENT_RE.match(base):
                    out.append(f"{folder}/{base[:-5]}")
            return out

    def list_folders(self, folder: str) -> list[str]:
        check_doc_name(folder)
        with _io(f"listing {folder} in {self.uri}"):
            out = []
            for e in self._ls(folder, detail=True):
                base = e["name"].rstrip("/").rsplit("/", 1)[-1]
                if e.get("type") == "directory" and _SEGMENT_RE.match(base):
                    out.append(f"{folder}/{base}")
            return out

    def delete_json(self, name: str) -> None:
        path = self.doc_path(name)
        with _io(f"deleting {name}.json"):
            self._rm(path)

    def json_mtime(self, name: str) -> Optional[float]:
        path = self.doc_path(name)
        with _io(f"stat of {name}.json"):
            try:
                if self.is_local:
                    return os.stat(path).st_mtime
                return _mtime(self._call("info", path))
            except FileNotFoundError:
                return None

    # ------------------------------------------------------------------ compare-and-swap docs
    # Docs that several processes may replace (the run lease): every write is a compare-and-swap
    # against the version the writer read, so two writers that read the same version can never
    # both succeed. On S3 the version is the object's ETag and the swap a conditional PUT
    # (``If-None-Match: *`` to create, ``If-Match: <etag>`` to replace), atomic on the server.
    #
    # Locally (and on NFS) there is no conditional rename, so a doc is a folder of numbered
    # generations ``<name>.cas/<n>.json``; the newest is current, and replacing generation n means
    # creating n+1 with link(2), which fails if it exists: an atomic create-if-absent on local
    # filesystems and on NFS (the server does the LOOKUP+LINK; NFSv3+ honour exclusive create).
    # Chosen over a lock file (O_CREAT|O_EXCL held around read-modify-write) because a writer
    # killed while holding such a lock leaves it behind, and breaking a stale lock safely needs
    # another lock; a generation file is complete the moment it appears (written, fsynced, then
    # linked), so a crash at any point leaves the doc consistent. Old generations are pruned,
    # keeping the newest _CAS_KEEP: a writer whose read is older than that (paused for
    # _CAS_KEEP renewals) could re-create a pruned number, so after linking it checks that no
    # newer generation exists and otherwise withdraws.
    _CAS_KEEP = 64

    def _cas_dir(self, name: str) -> str:
        return self._p(check_doc_name(name) + ".cas")

    @staticmethod
    def _cas_gens(d: str) -> list[int]:
        try:
            names = os.listdir(d)
        except FileNotFoundError:
            return []
        return sorted(int(n[:-5]) for n in names if n.endswith(".json") and n[:-5].isdigit())

    def _cas_unsupported(self) -> PermanentError:
        return PermanentError(
            f"{self.uri}: compare-and-swap writes (the single-writer run lease) need a local or "
            "NFS folder or S3; this filesystem offers none. Set guard.lease_ttl_s=0 to run "
            "without a lease (then make sure only one launch writes this run store)")

    def get_versioned(self, name: str) -> Optional[tuple[bytes, str]]:
        """``(bytes, version)`` of the compare-and-swap doc ``name`` (written only with
        :meth:`put_if`), or None if it does not exist."""
        what = f"reading {name} from {self.uri}"
        if self.is_local:
            d = self._cas_dir(name)
            with _io(what):
                for _ in range(100):  # a listed generation pruned before we read it: list again
                    gens = self._cas_gens(d)
                    if not gens:
                        return None
                    try:
                        return self._read_file(f"{d}/{gens[-1]:012d}.json"), str(gens[-1])
                    except FileNotFoundError:
                        continue
            raise StoreUnavailableError(f"{what}: its generations kept changing while listed")
        if not hasattr(self.fs, "_call_s3"):
            raise self._cas_unsupported()
        from fsspec.asyn import sync

        bucket, key, _ = self.fs.split_path(self.doc_path(name))

        async def get():
            resp = await self.fs._call_s3("get_object", Bucket=bucket, Key=key)
            try:
                data = await resp["Body"].read()
            finally:
                resp["Body"].close()
            return data, resp["ETag"]

        with _io(what):
            try:
                return sync(self.fs.loop, get, timeout=self.op_timeout_s)
            except FileNotFoundError:
                return None

    def put_if(self, name: str, data: bytes, expected: Optional[str]) -> Optional[str]:
        """Compare-and-swap: write ``data`` as doc ``name`` only if its current version is
        ``expected`` (None: only if it does not exist yet). Returns the new version, or None when
        another writer changed it first (re-read with :meth:`get_versioned` and decide again).
        A doc that vanished is never re-created by a replace (a deleted store stays deleted)."""
        what = f"writing {name} to {self.uri}"
        if self.is_local:
            d = self._cas_dir(name)
            gen = 1 if expected is None else int(expected) + 1
            with _io(what):
                if expected is None:
                    os.makedirs(d, exist_ok=True)  # not cached: the folder may have been removed
                elif not os.path.isdir(d):
                    return None
                path = f"{d}/{gen:012d}.json"
                tmp = f"{d}/.tmp-{uuid.uuid4().hex}"
                try:
                    with open(tmp, "wb") as f:
                        f.write(data)
                        if self.fsync:
                            f.flush()
                            os.fsync(f.fileno())
                    try:
                        os.link(tmp, path)  # the swap: fails if generation `gen` exists
                    except FileExistsError:
                        return None
                    except OSError as e:
                        if e.errno in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.ENOSYS):
                            raise self._cas_unsupported() from e  # no hard links (FAT, FUSE …)
                        raise
                finally:
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(tmp)
                gens = self._cas_gens(d)
                if gens and gens[-1] > gen:  # we re-created a pruned number: never current
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(path)
                    return None
                for old in gens[:-self._CAS_KEEP]:
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(f"{d}/{old:012d}.json")
                return str(gen)
        if not hasattr(self.fs, "_call_s3"):
            raise self._cas_unsupported()
        bucket, key, _ = self.fs.split_path(self.doc_path(name))
        cond = {"IfNoneMatch": "*"} if expected is None else {"IfMatch": expected}
        with _io(what):
            try:
                resp = self._call("call_s3", "put_object", Bucket=bucket, Key=key, Body=data,
                                  **cond)
            except (FileExistsError, FileNotFoundError):  # 412 on create; replace of a gone key
                return None
            except OSError as e:
                err = getattr(e.__cause__, "response", None) or {}
                if (err.get("Error", {}).get("Code") in ("PreconditionFailed",
                                                          "ConditionalRequestConflict")
                        or err.get("ResponseMetadata", {}).get("HTTPStatusCode") in (409, 412)):
                    return None  # 412: the ETag changed; 409: a concurrent conditional write
                raise
        return resp["ETag"]

    # ------------------------------------------------------------------ append-only logs
    def append_log(self, name: str, record: dict) -> None:
        """Append one JSON record to log ``name``. Locally: one ``O_APPEND`` write per record (a
        record is never interleaved with another writer's). Object stores: one small object per
        record under ``logs/<name>/``, since S3 cannot append.

        A writer killed mid-record leaves a torn last line with no newline; the next record would
        be glued to it and lost with it on read, so it then starts with a newline of its own
        (two writers both repairing leave one empty line, which :meth:`read_log` skips)."""
        check_doc_name(name)
        line = json.dumps(record, sort_keys=True, separators=(",", ":"), default=str) + "\n"
        with _io(f"appending to log {name}"):
            if self.is_local:
                path = self._p(f"logs/{name}.jsonl")
                self._makedirs(os.path.dirname(path))
                fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)
                try:
                    size = os.fstat(fd).st_size
                    if size and os.pread(fd, 1, size - 1) != b"\n":
                        line = "\n" + line  # a torn tail: end it before this record
                    os.write(fd, line.encode("utf-8"))
                finally:
                    os.close(fd)
            else:
                key = f"{time.time_ns():020d}-{uuid.uuid4().hex[:12]}"
                self._call("pipe_file", self._p(f"logs/{name}/{key}.json"), line.encode("utf-8"))

    def read_log(self, name: str) -> list[dict]:
        """All records of log ``name`` in append order (a torn last line of a killed writer is
        skipped)."""
        check_doc_name(name)
        with _io(f"reading log {name}"):
            if self.is_local:
                try:
                    raw = self._read_file(self._p(f"logs/{name}.jsonl"))
                except FileNotFoundError:
                    return []
                lines = raw.decode("utf-8", errors="replace").splitlines()
            else:
                paths = [p for p in self._ls(f"logs/{name}") if p.endswith(".json")]
                blobs = self._call("cat", paths) if paths else {}
                lines = [blobs[p].decode("utf-8", errors="replace") for p in paths]
        out = []
        for ln in lines:
            ln = ln.strip()
            if not ln:
                continue
            try:
                out.append(json.loads(ln))
            except ValueError:
                log.warning("log %s: skipping an unparseable (torn?) record %r", name, ln[:80])
        return out

    def close(self) -> None:
        with self._pool_lock:
            if self._pool is not None:
                self._pool.shutdown(wait=True)
                self._pool = None


def _mtime(entry: dict) -> float:
    for k in ("mtime", "LastModified", "last_modified", "created"):
        v = entry.get(k)
        if v is None:
            continue
        if isinstance(v, (int, float)):
            return float(v)
        if hasattr(v, "timestamp"):
            return float(v.timestamp())
    return time.time()  # unknown: treat as new, so GC never deletes it early
