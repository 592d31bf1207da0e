"""The single-writer run lease: a run store admits one writer (one launch of the run) at a time.

What belongs here: the lease doc, who holds it, taking it over, renewing it in the background and
the error that names the holder. What does not: the atomic compare-and-swap itself
(:meth:`RunStore.put_if`: generation files created with link(2) locally and on NFS, conditional
PUTs on S3) and when a run takes the lease (``verl_core.writer.hold_lease``).

The lease is the doc ``lease`` of the run store (``lease.json`` on S3, ``lease.cas/`` locally):

    {"format", "owner", "host", "pid", "process", "since", "renewed", "expires", "ttl_s",
     "released", "token", "generation"}

``owner`` names the writer: the Flyte execution (``flyte:<project>/<domain>/<execution id>``)
when running on a Flyte cluster, so every pod of one execution is the same writer; else
``<host>:<pid>`` of the process. A writer may take the lease when nobody holds it, when it holds
it already (a renewal), when the holder released it or let it expire (``expires`` passed: no
renewal for ``ttl_s`` seconds), or, on the same host only, when the holder's process is gone
(so "kill -9, then run the same command again" resumes at once). Every change is one
compare-and-swap against the version read, so of two contenders exactly one wins; the loser
reads again and decides again. Expiry compares the holder's ``expires`` with the reader's clock:
hosts sharing a store must keep their clocks in step (NTP) to well within ``ttl_s``.

Fencing (DESIGN "Writers are fenced"). The lease alone does not stop a process that outlived its
launcher (a Ray worker in its own process group after ``kill -9`` of ``pyflyte``) from committing
into a store a new launch took over. So ``generation`` counts the times the lease changed hands
(+1 on every take-over, release or break; renewals keep it), the launcher hands its
:class:`Fence` (owner + generation) to its workers, and every commit point (a checkpoint's start,
its manifest, ``latest``, an export) calls :meth:`Fence.check` first: it re-reads the lease doc
and refuses (:class:`FencedError`) unless the same owner still holds the same generation, not
released, not expired, and its process is alive where that can be judged (same host). What is
left is the window between that read and the commit write itself (one store round trip); a new
launch needs seconds (prepare, warm start) before it writes anything of its own.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
import uuid
from dataclasses import asdict, dataclass, replace
from datetime import datetime, timezone
from typing import Optional

from verl_core.store import RunStore, canonical_json
from verl_core.errors import PermanentError, StoreUnavailableError, VerlError
from verl_core.layout import LEASE_DOC

log = logging.getLogger(__name__)

__all__ = ["RunLease", "Holder", "Fence", "LeaseHeldError", "LeaseLostError", "FencedError",
           "read_lease", "break_lease", "default_owner", "LEASE_DOC"]

FORMAT = "verl-run-lease/1"
_ATTEMPTS = 20
"""Compare-and-swap rounds lost in a row before giving up (as transient): contenders resolve in
one round each, so only a storm of writers gets here."""


def _iso(t: float) -> str:
    return datetime.fromtimestamp(t, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def break_command(store: RunStore) -> str:
    return f"python -m verl_core.checkpoint lease --break {store.uri}"


class LeaseHeldError(PermanentError):
    """Another writer holds the run store's lease. ``holder`` is its :class:`Holder`."""

    def __init__(self, message: str, holder: "Holder"):
        super().__init__(message)
        self.holder = holder


class LeaseLostError(LeaseHeldError):
    """This process held the lease and another writer has taken it over (or it was broken)."""


class FencedError(LeaseLostError):
    """A commit refused by :meth:`Fence.check`: the launch it was made for no longer holds the
    lease (taken over, released, broken, expired, or its launcher process is gone). Permanent:
    the writer must stop; ``holder`` is the lease doc as read (None if there is none)."""


@dataclass(frozen=True)
class Holder:
    """One state of the lease doc."""

    owner: str
    """The writer: ``flyte:<project>/<domain>/<execution>`` or ``<host>:<pid>``."""
    host: str
    """Host name of the process that last wrote the lease."""
    pid: int
    """Its process id."""
    process: str
    """``<boot id>/<pid namespace>/<start ticks>`` of that process ("" where unknown): tells a
    dead or reused pid from a live holder on the same host."""
    since: float
    """When ``owner`` took the lease (epoch seconds)."""
    renewed: float
    """Last renewal (epoch seconds)."""
    expires: float
    """Free for others after this (epoch seconds) unless renewed."""
    ttl_s: float
    """The holder's ``guard.lease_ttl_s``."""
    token: str
    """Random id of this write (a writer recognises its own write after a lost response)."""
    released: bool = False
    """Given up by its owner (end of run) or broken with the CLI: free for anyone."""
    generation: int = 0
    """Fencing token: +1 every time the lease changes hands (taken over, released, broken),
    kept by renewals; 0 in docs written before fencing. Commits check it (:class:`Fence`)."""
    format: str = FORMAT

    def to_json(self) -> bytes:
        return canonical_json(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, raw: bytes, store_uri: str) -> "Holder":
        try:
            d = json.loads(raw)
            if d.get("format") != FORMAT:
                raise ValueError(f"format {d.get('format')!r}, expected {FORMAT!r}")
            return cls(**d)
        except (ValueError, TypeError, AttributeError) as e:
            raise PermanentError(f"the run lease of {store_uri} is unreadable ({e}); if no run "
                                 "is writing this store, break it: python -m "
                                 f"verl_core.checkpoint lease --break {store_uri}") from e

    def describe(self) -> str:
        return (f"{self.owner} (host {self.host}, pid {self.pid}) since {_iso(self.since)}, "
                f"last renewed {_iso(self.renewed)}")


# ---------------------------------------------------------------------- identity
def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return ""


def _pid_ns() -> str:
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return ""


def _start_ticks(pid: int) -> Optional[str]:
    """Start time of live process ``pid`` (clock ticks after boot, from /proc); None if there is
    no such process or it is a zombie; "" where /proc cannot tell.

    Hand-written (not psutil) because it is two reads of /proc and psutil is not otherwise a
    dependency; elsewhere ``os.kill(pid, 0)`` answers existence only."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except FileNotFoundError:
        return None
    except OSError:
        return ""
    # fields after the command name, which is in parentheses and may itself contain ') '
    rest = stat[stat.rindex(b")") + 2:].split()
    if rest[0] in (b"Z", b"X"):  # field 3, state: zombie or dead
        return None
    return rest[19].decode()  # field 22, starttime


def _process_id(pid: int) -> str:
    boot, ns = _read("/proc/sys/kernel/random/boot_id"), _pid_ns()
    start = _start_ticks(pid)
    return f"{boot}/{ns}/{start}" if boot and ns and start else ""


def _holder_gone(h: Holder) -> bool:
    """True only when ``h``'s process certainly no longer runs: same host, same boot and pid
    namespace (so its pid means the same process here), and that pid is gone, a zombie, or a
    different (later) process. Anything else (another host or container) cannot be judged from
    here: the lease then frees only by expiry."""
    if h.host != socket.gethostname():
        return False
    if not h.process:  # no /proc where it ran: existence is all we can check
        if os.path.exists("/proc/self/stat"):
            return False
        try:
            os.kill(h.pid, 0)
        except ProcessLookupError:
            return True
        except OSError:
            return False
        return False
    boot, ns, start = h.process.split("/", 2)
    if boot != _read("/proc/sys/kernel/random/boot_id") or ns != _pid_ns():
        return False
    now = _start_ticks(h.pid)
    return now is None or (now != "" and now != start)


def default_owner() -> str:
    """The Flyte execution when running on a Flyte cluster (all its pods are one writer), else
    ``<host>:<pid>``. flytekit's entrypoint reads the same variables (or their short forms)."""
    def env(*names: str) -> str:
        return next((os.environ[n] for n in names if os.environ.get(n)), "")

    execution = env("FLYTE_INTERNAL_EXECUTION_ID", "_F_NM")
    if execution:
        parts = [env("FLYTE_INTERNAL_EXECUTION_PROJECT", "_F_PRJ"),
                 env("FLYTE_INTERNAL_EXECUTION_DOMAIN", "_F_DM"), execution]
        return "flyte:" + "/".join(p for p in parts if p)
    return f"{socket.gethostname()}:{os.getpid()}"


# ---------------------------------------------------------------------- reading
def _get(store: RunStore) -> tuple[Optional[Holder], Optional[str]]:
    got = store.get_versioned(LEASE_DOC)
    if got is None:
        return None, None
    raw, version = got
    return Holder.from_json(raw, store.uri), version


def read_lease(store: RunStore) -> Optional[Holder]:
    """The lease doc as it is now (None if the store never had a lease)."""
    return _get(store)[0]


# ---------------------------------------------------------------------- fencing
@dataclass(frozen=True)
class Fence:
    """The lease a writer commits under: what the launcher hands to its workers (a Ray actor,
    every rank of a worker group) so that they commit only while that launch holds the run.
    Renewals do not change it; a take-over does (``generation``)."""

    store: str
    """URI of the run store the lease is of."""
    owner: str
    """The launch: :attr:`Holder.owner`."""
    generation: int
    """:attr:`Holder.generation` when the launch took the lease."""

    def check(self, store: RunStore, what: str) -> None:
        """Raise :class:`FencedError` unless this launch still holds the lease of ``store``:
        call it right before ``what`` is committed. One read of the lease doc."""
        cur = read_lease(store)
        now = time.time()
        why = None
        if cur is None:
            why = "the store has no lease doc (it was deleted)"
        elif cur.owner != self.owner or cur.generation != self.generation:
            why = f"{cur.describe()} holds it now (generation {cur.generation})"
        elif cur.released:
            why = "the launch released it (the run ended) or it was broken"
        elif _holder_gone(cur):
            why = f"the launcher process {cur.pid} on {cur.host} is gone"
        elif cur.expires <= now:
            why = (f"it expired at {_iso(cur.expires)}: the launcher stopped renewing it "
                   f"(every {cur.ttl_s / 3:.3g} s while it runs)")
        if why is None:
            return
        raise FencedError(
            f"{what} refused: this process writes for the launch {self.owner} (lease generation "
            f"{self.generation}) of {store.uri}, which no longer holds the run's writer lease: "
            f"{why}. Nothing was committed; this writer stops. Launch the run again to continue "
            "(it resumes from the last committed checkpoint)", cur)


def break_lease(store: RunStore) -> Optional[Holder]:
    """Mark the lease released whoever holds it (the CLI's ``--break``), so the next launch takes
    it at once; returns the holder it replaced (None if there was none). A holder that is in fact
    alive finds out at its next renewal or phase and stops with :class:`LeaseLostError`."""
    for _ in range(_ATTEMPTS):
        got = store.get_versioned(LEASE_DOC)
        if got is None:
            return None
        raw, version = got
        try:
            old: Optional[Holder] = Holder.from_json(raw, store.uri)
        except PermanentError:
            old = None  # an unreadable doc is exactly what --break is for
        now = time.time()
        me = f"{socket.gethostname()}:{os.getpid()}"
        new = Holder(owner=f"broken-by:{me}", host=socket.gethostname(), pid=os.getpid(),
                     process="", since=now, renewed=now, expires=now, ttl_s=0.0,
                     token=uuid.uuid4().hex, released=True,
                     generation=(old.generation if old else 0) + 1)
        if store.put_if(LEASE_DOC, new.to_json(), version) is not None:
            return old
    raise StoreUnavailableError(f"breaking the lease of {store.uri}: other writers kept changing "
                                f"it ({_ATTEMPTS} attempts); try again")


# ---------------------------------------------------------------------- the lease
class RunLease:
    """This process's claim on ``store``: :meth:`acquire` (also renews), :meth:`release`, and a
    daemon thread that renews every ``ttl_s / 3`` while held.

    Args:
        store: the run store.
        ttl_s: the lease frees for others this long after the last renewal (``guard.lease_ttl_s``).
        owner: the writer's name; default :func:`default_owner`.
    """

    def __init__(self, store: RunStore, ttl_s: float, owner: Optional[str] = None):
        if not ttl_s > 0:
            raise PermanentError(f"RunLease ttl_s={ttl_s!r} must be > 0 (guard.lease_ttl_s=0 "
                                 "means: take no lease at all)")
        self.store = store
        self.ttl_s = float(ttl_s)
        self.owner = owner or default_owner()
        self._lock = threading.RLock()
        self._held: Optional[Holder] = None  # our last successful write
        self._ever_held = False
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self.lost: Optional[LeaseLostError] = None
        """Set by the renewal thread when another writer took the lease over."""

    def __repr__(self) -> str:
        return f"RunLease({self.store.uri!r}, owner={self.owner!r}, held={self.held})"

    @property
    def held(self) -> bool:
        return self._held is not None and self.lost is None

    def fence(self) -> Fence:
        """The :class:`Fence` of our hold, for the workers that commit on our behalf. Raises
        :class:`LeaseLostError` (or :class:`LeaseHeldError`) when we do not hold the lease."""
        with self._lock:
            held = self._held
            if held is None or self.lost is not None:
                raise self.lost or LeaseHeldError(
                    f"this process does not hold the writer lease of {self.store.uri}", held)
            return Fence(self.store.uri, held.owner, held.generation)

    # ------------------------------------------------------------------ decisions
    def _why_free(self, cur: Holder, now: float) -> Optional[str]:
        """Why ``cur`` may be replaced by us (None: it may not)."""
        if cur.owner == self.owner:
            return "ours"
        if cur.released:
            return "released"
        if cur.expires <= now:
            return f"expired at {_iso(cur.expires)}"
        if _holder_gone(cur):
            return f"its process {cur.pid} on {cur.host} is gone"
        return None

    def _refusal(self, cur: Holder) -> LeaseHeldError:
        uri = self.store.uri
        if self._ever_held:
            return LeaseLostError(
                f"this run lost the writer lease of {uri}: {cur.describe()} holds it now (another "
                "launch of the same run took it over, or it was broken); this process stops "
                "writing to the store. Let one of the two runs finish; to continue with this one, "
                "stop the other and launch this run again", cur)
        return LeaseHeldError(
            f"another writer holds the run store {uri}: {cur.describe()}; its lease expires at "
            f"{_iso(cur.expires)} unless renewed (every {cur.ttl_s / 3:.3g} s while it runs). "
            "Only one launch may write a run store at a time. Stop the other run (or wait for it "
            f"to finish); if it is dead, wait until {_iso(cur.expires)} and launch again, or "
            f"break the lease now: {break_command(self.store)}", cur)

    def _new_state(self, cur: Optional[Holder], now: float) -> Holder:
        keep = cur is not None and cur.owner == self.owner and not cur.released  # a renewal
        pid = os.getpid()
        return Holder(owner=self.owner, host=socket.gethostname(), pid=pid,
                      process=_process_id(pid), since=cur.since if keep else now,
                      renewed=now, expires=now + self.ttl_s, ttl_s=self.ttl_s,
                      token=uuid.uuid4().hex,
                      generation=cur.generation if keep else (cur.generation if cur else 0) + 1)

    def _swap(self, new: Holder, version: Optional[str]) -> bool:
        if self.store.put_if(LEASE_DOC, new.to_json(), version) is not None:
            return True
        # Lost, or won with the answer lost (a retried PUT that met its own first attempt)?
        cur, _ = _get(self.store)
        return cur is not None and cur.token == new.token

    # ------------------------------------------------------------------ API
    def acquire(self) -> Holder:
        """Take the lease, or renew it if ours. Raises :class:`LeaseHeldError` naming the holder
        when another live writer has it (:class:`LeaseLostError` if that writer took it from
        us)."""
        with self._lock:
            for _ in range(_ATTEMPTS):
                cur, version = _get(self.store)
                now = time.time()
                why = "new" if cur is None else self._why_free(cur, now)
                if why is None:
                    err = self._refusal(cur)
                    if isinstance(err, LeaseLostError):
                        self._lose(err)
                    raise err
                new = self._new_state(cur, now)
                if self._swap(new, version):
                    if cur is not None and why not in ("ours", "released"):
                        log.warning("took over the run lease of %s from %s: %s", self.store.uri,
                                    cur.describe(), why)
                    self._held, self._ever_held, self.lost = new, True, None
                    self._start()
                    return new
            raise StoreUnavailableError(
                f"taking the lease of {self.store.uri}: {_ATTEMPTS} compare-and-swap rounds in a "
                "row lost to other writers")

    def hold(self) -> Holder:
        """What a phase calls before it writes: :meth:`acquire`, except that a lease this process
        renewed less than ``ttl_s / 3`` ago (the renewal thread's period) is only read, not
        rewritten, when the doc is still exactly our last write (same random ``token``): then
        nobody has taken, broken or released it since, and it stays ours for at least another
        ``2/3 ttl_s`` while the thread keeps renewing it. Skips a compare-and-swap write (an
        fsync locally, a conditional PUT on S3) per phase; any change to the doc, or an older
        renewal, takes the full :meth:`acquire` path with its errors."""
        with self._lock:
            held = self._held
            if (held is not None and self.lost is None
                    and time.time() - held.renewed < self.ttl_s / 3):
                cur, _ = _get(self.store)
                if cur is not None and cur.token == held.token:
                    return held
            return self.acquire()

    def renew(self) -> Holder:
        """Extend our lease by ``ttl_s``. Raises :class:`LeaseLostError` when it is no longer
        ours (never takes a lease we do not hold: that is :meth:`acquire`)."""
        with self._lock:
            for _ in range(_ATTEMPTS):
                cur, version = _get(self.store)
                if cur is None or cur.owner != self.owner or cur.released:
                    gone = cur or Holder(owner="(nobody: the lease doc was deleted)", host="?",
                                         pid=0, process="", since=0.0, renewed=0.0, expires=0.0,
                                         ttl_s=0.0, token="")
                    self._ever_held = True
                    err = self._refusal(gone)
                    self._lose(err)
                    raise err
                new = self._new_state(cur, time.time())
                if self._swap(new, version):
                    self._held = new
                    return new
            raise StoreUnavailableError(f"renewing the lease of {self.store.uri}: "
                                        f"{_ATTEMPTS} compare-and-swap rounds lost in a row")

    def release(self) -> None:
        """Stop renewing and mark the lease released if it is still ours (end of a run)."""
        self._stop.set()  # outside the lock: a renewal in flight needs it to finish
        t = self._thread
        if t is not None and t is not threading.current_thread():
            t.join(timeout=max(5.0, self.ttl_s))
        with self._lock:
            self._thread = None
            if self._held is None:
                return
            self._held, self._ever_held = None, False
            for _ in range(_ATTEMPTS):
                cur, version = _get(self.store)
                if cur is None or cur.owner != self.owner or cur.released:
                    return
                now = time.time()
                new = replace(cur, renewed=now, expires=now, released=True,
                              token=uuid.uuid4().hex)
                if self._swap(new, version):
                    return
            log.warning("could not mark the lease of %s released (contention); it expires by "
                        "itself", self.store.uri)

    def __enter__(self) -> "RunLease":
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    # ------------------------------------------------------------------ renewal thread
    def _lose(self, err: LeaseLostError) -> None:
        self._held, self.lost = None, err
        self._stop.set()

    def _start(self) -> None:
        if self._thread is not None and self._thread.is_alive():
            return
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._renew_loop, args=(self._stop,),
                                        name=f"verl-lease-{self.store.uri[-40:]}", daemon=True)
        self._thread.start()

    def _renew_loop(self, stop: threading.Event) -> None:
        while not stop.wait(self.ttl_s / 3):
            try:
                self.renew()
            except LeaseLostError as e:
                log.error("%s", e)
                return
            except (VerlError, OSError) as e:  # the store is flaky: keep trying until expiry
                log.warning("renewing the lease of %s failed (%s); retrying in %.1fs",
                            self.store.uri, e, self.ttl_s / 3)
