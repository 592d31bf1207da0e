"""The run's single writer in this process: the lease a phase holds (:func:`hold_lease`), the
fence its commits are made under (:func:`run_fence`, :func:`commit_fence`), its release at the
end of the run or at exit. The lease itself (compare-and-swap doc, renewal thread, fencing
tokens) is :mod:`verl_core.store.lease`; this module is above the store because it reads the
run's config (:class:`RunSpec`) and its fault drills (:mod:`verl_core.guard.faults`).
"""

from __future__ import annotations

import atexit
import functools
import logging
import os
import socket
import threading
from typing import Callable

from verl_core.guard import faults
from verl_core.store import RunStore
from verl_core.store.lease import Fence, RunLease
from verl_core.types import RunSpec

log = logging.getLogger(__name__)


class Leases:
    """This process's leases, one :class:`RunLease` (and renewal thread) per store and ttl."""

    def __init__(self) -> None:
        self._held: dict[tuple, RunLease] = {}
        self._lock = threading.Lock()

    def hold(self, st: RunStore, ttl_s: float) -> RunLease | None:
        """Take or renew this process's writer lease on ``st`` (None when ``ttl_s`` is 0: no
        lease). A lease renewed within the last ``ttl_s / 3`` is only checked
        (:meth:`RunLease.hold`)."""
        if not ttl_s:
            return None
        with self._lock:
            lease = self._held.get((st.uri, ttl_s))
            if lease is None:
                lease = self._held[(st.uri, ttl_s)] = RunLease(st, ttl_s)
        lease.hold()
        faults.lease_held(st, ttl_s)  # what a second_writer drill tries to take too
        return lease

    def get(self, uri: str, ttl_s: float) -> RunLease | None:
        with self._lock:
            return self._held.get((uri, ttl_s))

    def pop(self, uri: str, ttl_s: float) -> RunLease | None:
        with self._lock:
            return self._held.pop((uri, ttl_s), None)

    def release_mine(self) -> None:
        """A process that is the writer (not one pod of a Flyte execution, whose next pod
        carries on) frees its leases when it exits, even after a failure: a relaunch on any host
        may start at once instead of waiting for the expiry. (SIGKILL skips this; the same-host
        check covers it.)"""
        me = f"{socket.gethostname()}:{os.getpid()}"
        for lease in list(self._held.values()):
            if lease.owner != me:  # a Flyte execution's lease, or one a forked child inherited
                continue
            try:
                lease.release()
            except Exception as e:  # noqa: BLE001 - exiting anyway; the lease expires by itself
                log.warning("releasing the lease of %s at exit failed: %s", lease.store.uri, e)

    def reset(self) -> None:
        """Forget every lease without releasing it (what a new process knows)."""
        with self._lock:
            self._held.clear()


LEASES = Leases()
atexit.register(LEASES.release_mine)


def hold_lease(spec: RunSpec) -> None:
    """At the start of every phase: renew this run's single-writer lease, or take it (a new pod
    of the same Flyte execution, the first phase after a relaunch). Raises
    :class:`~verl_core.store.lease.LeaseHeldError` (permanent) naming the holder when another
    launch of the run holds it; a no-op with ``guard.lease_ttl_s=0``."""
    LEASES.hold(spec.open_store(), spec.config.guard.lease_ttl_s)


def release_lease(spec: RunSpec) -> None:
    """Give the run's lease up (end of the run): the next launch takes it at once."""
    lease = LEASES.pop(spec.store, spec.config.guard.lease_ttl_s)
    if lease is not None:
        lease.release()
        faults.lease_released()  # no lease held: a second_writer drill reports that


def run_fence(spec: RunSpec) -> Fence | None:
    """The :class:`~verl_core.store.lease.Fence` of this process's hold on the run's lease: what
    the run's workers commit under (None without a lease: ``guard.lease_ttl_s=0``, or none taken
    in this process). Raises :class:`~verl_core.store.lease.LeaseLostError` if it was lost."""
    lease = LEASES.get(spec.store, spec.config.guard.lease_ttl_s)
    return lease.fence() if lease is not None else None


def commit_fence(spec: RunSpec) -> Callable[[str], None] | None:
    """The fence check for a commit this process makes itself (finalize's export): called with
    what is committed, it raises unless this launch still holds the run (None: no lease)."""
    fence = run_fence(spec)
    return None if fence is None else functools.partial(fence.check, spec.open_store())
