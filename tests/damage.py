"""Bit rot for tests: damage a stored file in place, keeping its size (what a size check misses)."""
import os


def flip_bytes(path, n: int = 64, at: int | None = None) -> None:
    """Invert ``n`` bytes of the file at ``path`` from offset ``at`` (default: its middle)."""
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) // 2 if at is None else at)
        data = f.read(n)
        f.seek(-len(data), 1)
        f.write(bytes(b ^ 0xFF for b in data))
