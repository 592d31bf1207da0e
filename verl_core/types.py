"""The typed records that cross phase boundaries: :class:`RunSpec` (what identifies a prepared
run), :class:`PhaseOut` (a phase's batch and the step's metrics so far), :class:`StepState` (the
training state after some updates). Everything in them points only at content-addressed objects
in the run store, so a Flyte cache hit, a retry on another host or a re-run reads exactly what the
phase wrote. Also this process's open run stores (:data:`STORES`), which a spec opens.

What does not belong here: anything that runs a phase (``phases.py``) or talks to workers.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from dataclasses import dataclass, field

from verl_core.config import RunConfig
from verl_core.store import RunStore

Metrics = dict[str, float]


class Stores:
    """This process's open run stores, one per URI (opening one reads or writes its
    incarnation id, so it is done once)."""

    def __init__(self) -> None:
        self._open: dict[str, RunStore] = {}

    def open(self, uri: str) -> RunStore:
        if uri not in self._open:
            self._open[uri] = RunStore(uri)
        return self._open[uri]

    def reset(self) -> None:
        """Forget every open store (a new process would open them again)."""
        self._open.clear()


STORES = Stores()


@dataclass(frozen=True)
class RunSpec:
    """Everything that identifies a prepared run. Every phase takes it as an input, so Flyte's
    cache keys are scoped to the physical store (its incarnation id): a deleted and re-created
    store misses the cache instead of hitting entries that point at deleted data."""

    store: str
    """URI of this run's store (``<--store>/<--run-name>``)."""
    incarnation: str
    """Random id written when the store was created."""
    config: RunConfig
    """The validated config (a Flyte dataclass literal: typed, and part of every cache key)."""
    trajectory_hash: str
    """:meth:`RunConfig.trajectory_hash` (names checkpoints, lineage and metrics). It crosses
    tasks under its old name ``config_hash`` (:data:`_WIRE_NAMES`): the literal, hence every
    Flyte cache key, is the same as before the rename."""
    assets_json: str
    """Index of the model/dataset objects in the store."""
    start_step: int
    """Step the loop starts at (> 0 when resuming from a checkpoint)."""
    total_steps: int
    """Step the loop ends at."""

    @property
    def config_json(self) -> str:
        """The config as canonical JSON: what the workers are built from, and what names them."""
        return _config_json(self.config)

    @property
    def key(self) -> tuple:
        """What names the run's workers, trackers and light parts in a process: the physical
        store and the config."""
        return (self.store, self.incarnation, self.config_json)

    def to_json(self) -> str:
        """Canonical JSON of the whole spec (what crosses Flyte task boundaries), the config as
        the fields that differ from the defaults (:meth:`RunConfig.non_default`): what the user
        set is what the console shows, and the literal is ~3x shorter (flytekit formats every
        task input into two log lines in a local run: BENCHMARKS.md "Small costs"). The literal
        still changes whenever the config does; ``trajectory_hash`` covers every field of the
        trajectory, defaults included."""
        return self._json

    @functools.cached_property
    def _json(self) -> str:
        # computed once per spec (frozen, so it cannot go stale): every task input of a run
        # converts the same spec, and walking the ~180 config fields each time showed in the step
        return json.dumps({**{_WIRE_NAMES.get(f.name, f.name): getattr(self, f.name)
                              for f in dataclasses.fields(self)},
                           "config": self.config.non_default()},
                          sort_keys=True, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> "RunSpec":
        d = {_PYTHON_NAMES.get(k, k): v for k, v in json.loads(text).items()}
        return cls(**{**d, "config": RunConfig.from_dict(d["config"])})

    def open_store(self) -> RunStore:
        return STORES.open(self.store)


_WIRE_NAMES = {"trajectory_hash": "config_hash"}
"""RunSpec fields whose key in the task literal is their name before a rename (the literal is
part of every Flyte cache key, so a rename must not change it)."""
_PYTHON_NAMES = {v: k for k, v in _WIRE_NAMES.items()}


@functools.lru_cache(maxsize=32)
def _config_json(cfg: RunConfig) -> str:
    """Canonical JSON of a config, once per process (RunConfig is frozen and hashable)."""
    return json.dumps(cfg.to_dict(), sort_keys=True)


@dataclass(frozen=True)
class PhaseOut:
    """A phase's result: the batch it wrote and the step's metrics so far."""

    step: int
    """RL step this batch belongs to."""
    batch: str
    """Object name (sha256) of the batch parquet in the run store."""
    metrics: Metrics = field(default_factory=dict)
    """Metrics of this and the earlier phases of the step."""


@dataclass(frozen=True)
class StepState:
    """The training state after ``step`` updates (it lives in the workers; rebuilt from the
    store when they do not hold it)."""

    step: int
    """Number of updates applied."""
    metrics: Metrics = field(default_factory=dict)
    """Metrics of the step that produced this state."""
