"""Data parallelism as the update and the rollout see it: which rows are this worker's, and the
few collectives that put the pieces back together.

What belongs here: the rank/size pair, row blocks, and gathers of row-aligned tensors and scalar
metrics. Process-group creation, FSDP2 wrapping and the Ray worker group live in
``verl_core.engine.group``; a single process uses :data:`SINGLE` and never touches
``torch.distributed``.

Every worker holds the whole batch (it is read from the run store), so splitting needs no
communication: worker ``r`` of ``W`` takes the ``r``-th contiguous block of every index list.
Equal blocks are a precondition (checked at config time): FSDP2 needs every worker to run the same
number of forward/backward passes, since each one is a collective.
"""

from __future__ import annotations

import dataclasses
import datetime
from dataclasses import dataclass
from typing import Any, Optional

import torch


@dataclass(frozen=True)
class DataParallel:
    """This worker's place among ``size`` data-parallel workers."""

    rank: int = 0
    """0-based index of this worker."""
    size: int = 1
    """Number of workers (W)."""
    group: Any = None
    """torch.distributed process group for tensor collectives (None: the default group)."""
    cpu_group: Any = None
    """gloo group for host-side collectives (object gathers); the default group on CPU."""
    sample_group: Any = None
    """gloo group of the off-policy rollout's gathers (:meth:`sampling`): its own, because the
    background rollout gathers in a thread of its own while the main thread runs the update's
    FSDP collectives on the default group (gloo serves two groups from two threads, not one
    group from two). None: ``cpu_group``."""

    @property
    def distributed(self) -> bool:
        return self.size > 1

    def block(self, idx: torch.Tensor) -> torch.Tensor:
        """This worker's contiguous block of ``idx`` (n,) -> (n / W,)."""
        if not self.distributed:
            return idx
        n = idx.numel()
        if n % self.size:
            raise ValueError(f"{n} rows cannot be split evenly over {self.size} workers")
        k = n // self.size
        return idx[self.rank * k:(self.rank + 1) * k]

    def gather_rows(self, local: torch.Tensor) -> torch.Tensor:
        """Concatenate every worker's ``local`` (n / W, ...) in rank order: (n, ...)."""
        if not self.distributed:
            return local
        import torch.distributed as dist

        # NCCL gathers GPU tensors only: a host tensor (a batch's rows, the results of a
        # forward, which come back to the host) goes through this worker's GPU and back
        where = local.device
        if dist.get_backend(self.group) == "nccl" and where.type != "cuda":
            local = local.to(torch.device("cuda", torch.cuda.current_device()))
        parts = [torch.empty_like(local) for _ in range(self.size)]
        dist.all_gather(parts, local.contiguous(), group=self.group)
        return torch.cat(parts, 0).to(where)

    def gather_objects(self, obj: Any) -> list:
        """``[obj of rank 0, obj of rank 1, ...]`` on every worker (pickled over gloo)."""
        if not self.distributed:
            return [obj]
        import torch.distributed as dist

        out: list = [None] * self.size
        dist.all_gather_object(out, obj, group=self.cpu_group)
        return out

    def sampling(self) -> "DataParallel":
        """This worker's place with :attr:`sample_group` as its ``cpu_group``: the view whose
        :meth:`gather_objects` the off-policy rollout uses (from any thread)."""
        if self.sample_group is None:
            return self
        return dataclasses.replace(self, cpu_group=self.sample_group)

    def mean_metrics(self, metrics: dict[str, float]) -> dict[str, float]:
        """Mean of each scalar over the workers (every worker must pass the same keys)."""
        if not self.distributed or not metrics:
            return metrics
        keys = sorted(metrics)
        per_rank = self.gather_objects([float(metrics[k]) for k in keys])
        return {k: sum(r[i] for r in per_rank) / self.size for i, k in enumerate(keys)}

    def barrier(self) -> None:
        if self.distributed:
            import torch.distributed as dist

            dist.barrier(group=self.cpu_group)


SINGLE = DataParallel()
"""One worker: no process group, no collectives."""


def init_process_group(backend: str, init_method: str, rank: int, world_size: int,
                       timeout_s: float) -> DataParallel:
    """Join the default process group (``backend``: gloo on CPU, nccl on CUDA), for NCCL a gloo
    group for host-side collectives, and the gloo group of the off-policy rollout's gathers
    (:attr:`DataParallel.sample_group`; every worker creates the groups here, in this order, as
    ``new_group`` requires). ``timeout_s`` bounds every collective: a worker that died makes
    the others fail after it instead of waiting forever."""
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=timeout_s)
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size,
                            timeout=timeout)
    cpu_group: Optional[Any] = None
    if backend != "gloo":
        cpu_group = dist.new_group(backend="gloo", timeout=timeout)
    sample_group = dist.new_group(backend="gloo", timeout=timeout)
    return DataParallel(rank=rank, size=world_size, group=None, cpu_group=cpu_group,
                        sample_group=sample_group)
