"""A save on its way: what one rank writes (:class:`_SaveJob`), the handle of a background save
(:class:`SaveHandle`), and the checks and encoding of what a save is given."""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional

from verl_core.checkpoint.manifest import CheckpointInfo, _check_group
from verl_core.checkpoint.state import flatten_state, to_json
from verl_core.errors import CheckpointSaveError


@dataclass
class _SaveJob:
    """A save prepared on one rank: what DCP writes and what the manifest records."""

    step: int
    tensors: dict
    """``{"<group>/<tensor>": tensor or DTensor}``: what DCP plans and writes."""
    trees: dict
    """``{group: JSON state tree}``, complete on rank 0 (every group any rank passed)."""
    meta_tree: Any
    """Rank 0's meta, encoded (``state.to_json``)."""
    fence: Optional[Callable[[str], None]] = None
    """The manager's :attr:`~CheckpointManager.fence` when the save was started."""


class SaveHandle:
    """A background save (:meth:`CheckpointManager.async_save_distributed`).

    ``wait()`` blocks until it committed and returns its :class:`CheckpointInfo` (the same on every
    rank), or re-raises its error. An error nobody waited for is raised by the next async save."""

    def __init__(self, future: Future, step: int):
        self._future = future
        self.step = step
        self._seen = False

    def done(self) -> bool:
        return self._future.done()

    def wait(self) -> "CheckpointInfo":
        self._seen = True
        return self._future.result()

    def outcome(self) -> tuple[Optional["CheckpointInfo"], Optional[BaseException]]:
        """Block until done; ``(info, None)`` or ``(None, error)``. Unlike :meth:`wait` it does
        not count as collecting the error, so the saver still raises it (the local-tier
        replicator watches handles this way)."""
        try:
            return self._future.result(), None
        except BaseException as e:  # noqa: BLE001 - returned, and still raised by wait()
            return None, e


def _encode_meta(meta: Optional[Mapping]) -> Any:
    try:
        return to_json(dict(meta or {}))
    except CheckpointSaveError as e:
        raise CheckpointSaveError(f"meta: {e}") from e


def _flatten_groups(groups: Mapping[str, Any]) -> dict[str, tuple[dict, Any]]:
    out = {}
    for g, v in groups.items():
        if v is None:
            continue
        _check_group(g)
        try:
            out[g] = flatten_state(v)
        except CheckpointSaveError as e:
            raise CheckpointSaveError(f"group {g!r}: {e}") from e
    return out


def _check(fence: Optional[Callable[[str], None]], what: str) -> None:
    if fence is not None:
        fence(what)
