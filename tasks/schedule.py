"""Tasks of the scheduled launch plans (workflows/schedules.py): where a run stands.

Not cached: each execution must read the store as it is now.
"""

from datetime import datetime

from flytekit import task

from tasks.prepare import build_config
from verl_core.prepare import run_store_uri
from verl_core.engine import schedule
from verl_core.types import RunSpec, StepState


@task
def continuation_steps(algorithm: str, model: str, train_files: str, val_files: str,
                       batch_size: int, rollout_n: int, run_name: str, store: str, overrides: str,
                       extra_steps: int, kickoff_time: datetime) -> int:
    """Run length that trains ``extra_steps`` past the run's newest verified checkpoint."""
    cfg = build_config(algorithm, model, train_files, val_files, 0, batch_size, rollout_n,
                       overrides)
    uri = run_store_uri(store, run_name)
    start, total = schedule.continuation_total(cfg, uri, extra_steps)
    print(f"[verl] continuing {uri} (scheduled {kickoff_time.isoformat()}): step {start} -> "
          f"{total}", flush=True)
    return total


@task
def newest_state(spec: RunSpec) -> StepState:
    """The state of the run's newest verified checkpoint (0: the starting model)."""
    step = schedule.newest_step(spec.config, spec.store)
    print(f"[verl] newest verified checkpoint of {spec.store}: step {step}", flush=True)
    return StepState(step=step)
