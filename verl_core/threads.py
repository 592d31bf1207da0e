"""The intra-op thread count a run computes with: fixed for the run, whatever the host.

Why it is fixed: a CPU matmul's blocking, and so the order of its float sums, depends on how many
threads split it, so the same phase run with 1 and with 2 threads ends in weights that differ in
the last bits (issue 21: ``cluster.mode=attached``, whose Ray actor got Ray's default of one
thread, against ``per_task``, whose actor got the host's CPU count). A rebuild replays the lineage
with the thread count of the pod it lands on; a retry on a bigger pod would replay to other
weights. So ``run.num_threads = 0`` does not mean "the host's default": the first prepare of a run
store resolves it (this host's CPUs / the worker count) and records it in ``compute.json``; every
later prepare, on any host, reads it back, and the resolved count travels in the run spec to every
mode, worker and retry. The record is per run store, not part of the trajectory hash, and written
once, so the spec (and so every cache key) is the same on every host that resumes the run.

What belongs here: the resolution and the record. What does not: setting it (the workers call
``torch.set_num_threads(intra_op_threads(cfg))`` when they are built).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import socket

from verl_core.config import ConfigError, RunConfig
from verl_core.errors import CorruptObjectError
from verl_core.layout import COMPUTE_DOC

log = logging.getLogger(__name__)



def host_cpus() -> int:
    """CPUs this process may run on (its affinity mask: a container's cpuset, not the node's)."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except (AttributeError, OSError):  # no sched_getaffinity (macOS)
        return os.cpu_count() or 1


def default_num_threads(world_size: int) -> int:
    """This host's CPUs shared by the ``world_size`` workers of a run, at least 1 each."""
    return max(1, host_cpus() // max(1, world_size))


def intra_op_threads(cfg: RunConfig) -> int:
    """The count a worker built from ``cfg`` computes with: ``run.num_threads`` once a prepare
    resolved it (:func:`pin_num_threads`); for a config that never went through one (the plain
    loop, a test's worker) this host's :func:`default_num_threads`."""
    return cfg.num_threads or default_num_threads(cfg.trainer.world_size)


def pin_num_threads(st, cfg: RunConfig) -> RunConfig:
    """``cfg`` with ``num_threads`` set to the count run store ``st`` records, recording it at the
    run's first prepare (``cfg.num_threads``, or :func:`default_num_threads` when it is 0).

    A later prepare with ``num_threads`` 0 gets the recorded count, on any host and for any worker
    count (a run moved to W workers keeps its per-worker count); one that sets a different count
    is refused before any work: continuing the run with it would change its weights in the last
    bits at every rebuild (a replay of the lineage), so it is a new run."""
    doc = _read(st)
    if doc is None:
        n = intra_op_threads(cfg)
        st.put_json(COMPUTE_DOC, {"num_threads": n, "host": socket.gethostname(),
                             "host_cpus": host_cpus(), "world_size": cfg.trainer.world_size,
                             "explicit": bool(cfg.num_threads)}, create_only=True)
        # a concurrent first prepare may have won the create: its count holds
        doc = _read(st) or {"num_threads": n}
        if doc["num_threads"] == n:  # logged, not printed: a prepare prints nothing before work
            log.info("intra-op threads: %d per worker, recorded for this run in %s/%s.json "
                     "(every later rebuild, on any host, uses it)", n, st.uri, COMPUTE_DOC)
    n = doc["num_threads"]
    if cfg.num_threads and cfg.num_threads != n:
        raise ConfigError(
            f"run.num_threads={cfg.num_threads}: this run computes with {n} intra-op threads per "
            f"worker (recorded at its first prepare in {st.uri}/{COMPUTE_DOC}.json); a different "
            "count changes the float sums, so resumes and rebuilds would no longer reproduce its "
            f"weights bit for bit. Leave num_threads at 0 (or {n}) to continue it, or start a "
            "new --run-name")
    return dataclasses.replace(cfg, num_threads=n)


def _read(st) -> dict | None:
    doc = st.get_json(COMPUTE_DOC, default=None)
    if doc is None:
        return None
    n = doc.get("num_threads") if isinstance(doc, dict) else None
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise CorruptObjectError(
            f"{COMPUTE_DOC}.json in {st.uri} does not hold a positive num_threads ({doc!r}); "
            f"restore it, or delete it to record this host's count (a run's weights then differ in "
            "the last bits from what the old count computed)", path=st.doc_path(COMPUTE_DOC))
    return doc
