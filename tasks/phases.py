"""The heavy phases' tasks for the run's ``cluster.mode`` (docs/cluster.md).

``per_task``: Flyte Ray tasks (each its own Ray cluster on a Flyte cluster; locally they share one).
``attached``: plain tasks that join the long-lived Ray cluster where the run's workers stay warm.
Both sets run the same phase bodies and end with the same weights.
"""

from dataclasses import dataclass

from flytekit.core.base_task import PythonTask

from tasks.checkpoint import checkpoint, checkpoint_attached
from tasks.evaluate import evaluate, evaluate_attached
from tasks.finalize import finalize, finalize_attached
from tasks.rollout import rollout, rollout_attached
from tasks.update import update, update_attached
from verl_core.types import RunSpec


@dataclass(frozen=True)
class HeavyPhases:
    rollout: PythonTask
    update: PythonTask
    checkpoint: PythonTask
    evaluate: PythonTask
    finalize: PythonTask


PER_TASK = HeavyPhases(rollout, update, checkpoint, evaluate, finalize)
ATTACHED = HeavyPhases(rollout_attached, update_attached, checkpoint_attached, evaluate_attached,
                       finalize_attached)


def heavy_phases(spec: RunSpec) -> HeavyPhases:
    """The tasks of the heavy phases for ``spec.config.cluster.mode``."""
    return ATTACHED if spec.config.cluster.mode == "attached" else PER_TASK
