"""A resumable, deterministic batch sampler over prompt indices.

Epoch ``e`` visits a permutation of ``range(num_items)`` drawn from a ``torch.Generator`` seeded
by ``(seed, e)``; batches are consecutive slices of it, and the last partial batch of each epoch
is dropped (so every step has exactly ``batch_size`` prompts). The whole state is five ints, so a
checkpoint stores it as plain JSON and a resumed run draws exactly the batches an uninterrupted
run would have drawn.

What belongs here: which prompt indices form the next batch. Not here: loading rows
(``dataset.py``), per-phase seeds for sampling responses (the caller derives those).
"""

from __future__ import annotations

import hashlib
from typing import Iterator

import torch

__all__ = ["ResumableSampler"]

_STATE_KEYS = ("epoch", "position", "seed", "num_items", "batch_size")  # + optional "shuffle"


def _epoch_seed(seed: int, epoch: int) -> int:
    """A 63-bit seed for (seed, epoch); hashing keeps nearby (seed, epoch) pairs unrelated."""
    digest = hashlib.blake2b(f"sampler:{seed}:{epoch}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


class ResumableSampler:
    """Yields batches of exactly ``batch_size`` distinct indices in ``range(num_items)``."""

    def __init__(self, num_items: int, batch_size: int, seed: int, shuffle: bool = True):
        for name, v in (("num_items", num_items), ("batch_size", batch_size)):
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ValueError(f"{name}={v!r}: must be an int > 0")
        if batch_size > num_items:
            raise ValueError(f"batch_size={batch_size} is larger than the dataset "
                             f"(num_items={num_items}): every batch would be dropped; use a "
                             "smaller data.train_batch_size or more prompts")
        self.num_items = num_items
        self.batch_size = batch_size
        self.seed = int(seed)
        self.shuffle = bool(shuffle)
        self.epoch = 0
        """Epoch of the next batch."""
        self.position = 0
        """Offset of the next batch in this epoch's permutation (a multiple of batch_size)."""
        self._perm: list[int] | None = None  # cached permutation of self.epoch

    @property
    def batches_per_epoch(self) -> int:
        return self.num_items // self.batch_size

    def _permutation(self) -> list[int]:
        if self._perm is None:
            if self.shuffle:
                g = torch.Generator().manual_seed(_epoch_seed(self.seed, self.epoch))
                self._perm = torch.randperm(self.num_items, generator=g).tolist()
            else:
                self._perm = list(range(self.num_items))
        return self._perm

    def next_batch(self) -> list[int]:
        """The next ``batch_size`` indices; rolls over to the next epoch when fewer remain."""
        if self.position + self.batch_size > self.num_items:  # drop the partial tail
            self.epoch += 1
            self.position = 0
            self._perm = None
        batch = self._permutation()[self.position:self.position + self.batch_size]
        self.position += self.batch_size
        return batch

    def __iter__(self) -> Iterator[list[int]]:
        while True:
            yield self.next_batch()

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed,
                "num_items": self.num_items, "batch_size": self.batch_size,
                "shuffle": int(self.shuffle)}

    def load_state_dict(self, state: dict) -> None:
        """Restore a :meth:`state_dict`. The saved seed and shuffle flag win (that is what makes
        the resumed batches identical); a different dataset size or batch size is an error."""
        missing = [k for k in _STATE_KEYS if k not in state]
        if missing:
            raise ValueError(f"sampler state is missing key(s) {missing}; expected {_STATE_KEYS}")
        for k in (*_STATE_KEYS, "shuffle"):
            if k == "shuffle" and k not in state:
                continue
            if isinstance(state[k], bool) and k != "shuffle" or not isinstance(state[k], int):
                raise ValueError(f"sampler state {k}={state[k]!r}: must be an int")
        for k in ("num_items", "batch_size"):
            if state[k] != getattr(self, k):
                raise ValueError(
                    f"sampler state has {k}={state[k]} but this sampler has {k}="
                    f"{getattr(self, k)}: the dataset or data.train_batch_size changed since the "
                    "checkpoint; restore them, or start a fresh run")
        epoch, position = state["epoch"], state["position"]
        if epoch < 0 or position < 0 or position % self.batch_size or position > self.num_items:
            raise ValueError(f"sampler state epoch={epoch}, position={position}: invalid for "
                             f"num_items={self.num_items}, batch_size={self.batch_size}")
        self.seed = state["seed"]
        self.shuffle = bool(state.get("shuffle", self.shuffle))
        self.epoch, self.position = epoch, position
        self._perm = None
