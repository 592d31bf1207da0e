"""What scheduled launch plans ask of a run store: where a run stands.

Nightly continued training trains ``extra_steps`` past the run's newest checkpoint, and periodic
evaluation evaluates that checkpoint. Both read the store when they run (never from a cache: the
answer changes between executions), and use the checks a resume uses, so they name the same step
``prepare`` would resume from.
"""

from __future__ import annotations

from verl_core.config import ConfigError, RunConfig, with_overrides
from verl_core.prepare import resume_step
from verl_core.types import STORES


def newest_step(cfg: RunConfig, store_uri: str) -> int:
    """Step of the newest checkpoint of ``cfg``'s trajectory in ``store_uri`` that verifies (every
    object re-hashed); 0 when there is none. Ignores ``checkpoint.resume_from_checkpoint``."""
    auto = with_overrides(cfg, {"checkpoint.resume_from_checkpoint": "auto"})
    return resume_step(STORES.open(store_uri), auto)


def continuation_total(cfg: RunConfig, store_uri: str, extra_steps: int) -> tuple[int, int]:
    """``(newest, newest + extra_steps)``: the step a continued run resumes from and the run
    length that trains ``extra_steps`` more. Raises ConfigError when the run cannot continue."""
    if isinstance(extra_steps, bool) or not isinstance(extra_steps, int) or extra_steps < 1:
        raise ConfigError(f"extra_steps={extra_steps!r}: must be an integer >= 1 (RL steps to "
                          "train past the newest checkpoint)")
    if cfg.optim.lr_schedule != "constant":
        # the trajectory hash then includes the run length, so a longer run is a new trajectory
        raise ConfigError(f"optim.lr_schedule={cfg.optim.lr_schedule!r}: continued training "
                          "needs a constant LR schedule (a cosine schedule's LR depends on the "
                          "run length, so every continuation would start a new run); set "
                          '"optim.lr_schedule": "constant" in the overrides')
    start = resume_step(STORES.open(store_uri), cfg)
    return start, start + extra_steps
