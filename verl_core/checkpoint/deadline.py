"""When a run must have saved: ``checkpoint.must_save_by`` (a wall-clock deadline, NeMo-RL's
``checkpoint_must_save_by``) and the capacity-block expiration verl reads (its ESI check,
``verl/utils/checkpoint/checkpoint_manager.py:should_save_ckpt_esi``), and the rule the plain loop
stops by: save and stop once the time left is less than the longest step so far, plus the longest
save so far (60 s before the first, verl's estimate), plus ``checkpoint.must_save_margin_s``
(verl's ``trainer.esi_redundant_time``)."""

from __future__ import annotations

import os

from verl_core.checkpoint.config import parse_must_save_by

__all__ = ["parse_must_save_by", "deadline", "must_stop", "FIRST_SAVE_ESTIMATE_S", "CAPACITY_ENV"]

FIRST_SAVE_ESTIMATE_S = 60.0
"""A save's duration before one was measured (verl's ``save_ckpt_duration`` default)."""

CAPACITY_ENV = ("MLP_CURRENT_CAPACITY_BLOCK_EXPIRATION_TIMESTAMP",
                "SAGEMAKER_CURRENT_CAPACITY_BLOCK_EXPIRATION_TIMESTAMP")
"""Environment variables holding a machine's capacity-block expiration (unix seconds), as verl
reads them (Volcano Engine ML platform, SageMaker)."""

def deadline(must_save_by: str, started: float) -> float | None:
    """The earliest of ``must_save_by`` and a capacity-block expiration in the environment."""
    times = [parse_must_save_by(must_save_by, started)]
    for name in CAPACITY_ENV:
        try:
            times.append(float(os.environ[name]))
        except (KeyError, ValueError):  # unset, or not a number: verl ignores it too
            pass
    times = [t for t in times if t is not None]
    return min(times) if times else None


def must_stop(now: float, until: float | None, step_s: list[float], save_s: list[float],
              margin_s: float) -> tuple[bool, float]:
    """``(stop, needed_s)``: whether a run must save and stop now, so that the save ends before
    ``until`` (None: never), and the seconds another step and a save are taken to need."""
    if until is None or not step_s:
        return False, 0.0
    needed = max(step_s) + (max(save_s) if save_s else FIRST_SAVE_ESTIMATE_S) + margin_s
    return until - now <= needed, needed
