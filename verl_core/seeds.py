"""Seeds derived from ``(run seed, step, phase)``: every random draw of a run starts from one, never
from global RNG, so a phase recomputed after a crash or a lost batch gives the same bytes
(docs/design.md#rule-3-phases-are-deterministic).

A building block: imports nothing from ``verl_core``.
"""

from __future__ import annotations

import hashlib


def derive_seed(seed: int, step: int, phase: str) -> int:
    """A 63-bit seed for one phase of one step (docs/design.md#rule-3-phases-are-deterministic)."""
    digest = hashlib.blake2b(f"{seed}:{step}:{phase}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)
