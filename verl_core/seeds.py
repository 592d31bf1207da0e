"""Every random draw of a run comes from a seed derived from (run seed, step, phase), never from
global RNG (docs/design.md#rule-3-phases-are-deterministic)."""

from __future__ import annotations

import hashlib


def derive_seed(seed: int, step: int, phase: str) -> int:
    """A 63-bit seed for one phase of one step (docs/design.md#rule-3-phases-are-deterministic)."""
    digest = hashlib.blake2b(f"{seed}:{step}:{phase}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)
