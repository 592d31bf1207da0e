"""Scheduled launch plans: nightly continued training of a named run, and its periodic evaluation.

    ppo_continue   ->  continuation_steps -> configure -> prepare -> rl_run (as in ppo)
    evaluate_newest ->  configure -> prepare -> newest_state -> evaluate_state (dynamic) -> evaluate
                        (the plain-task twin with cluster.mode=attached)

    ppo_nightly    ppo_continue at 02:00 UTC every night: EXTRA_STEPS more steps of run NIGHTLY
    eval_newest    evaluate_newest every EVAL_EVERY: the newest verified checkpoint of that run
                   (a cache hit, so nearly free, while no new checkpoint has appeared)

Both launch plans run at most one execution at a time (a launch that would overlap is skipped by
Flyte admin) and notify ALERT_EMAILS when an execution fails or times out. Schedules fire only
on a Flyte cluster, once the launch plans are activated (``pyflyte register
--activate-launchplans``); locally, run the workflows with the same inputs (docs/cluster.md,
"Running on a Flyte cluster").
"""

import os
from datetime import datetime, timedelta

from flytekit import (CronSchedule, Email, FixedRate, LaunchPlan, WorkflowExecutionPhase, dynamic,
                      workflow)
from flytekit.models.concurrency import ConcurrencyLimitBehavior, ConcurrencyPolicy

from workflows._cli import add_dashed_aliases
from workflows.ppo import rl_run

from tasks.evaluate import EvalResult
from tasks.finalize import Summary
from tasks.phases import heavy_phases
from tasks.prepare import configure, prepare
from tasks.schedule import continuation_steps, newest_state
from verl_core.types import RunSpec, StepState

add_dashed_aliases()

NIGHTLY = {"algorithm": "grpo", "model": "", "train_files": "", "val_files": "",
           "batch_size": 0, "rollout_n": 0, "run_name": "nightly", "store": "", "overrides": ""}
"""The run both launch plans are fixed to (the same values give the same trajectory, so the same
checkpoints). ``store: ""`` is the pod's ``VERL_STORE`` (set in deploy/)."""
EXTRA_STEPS = 50
"""RL steps each night trains past the run's newest checkpoint (a launch may change it)."""
NIGHTLY_CRON = "0 2 * * *"
"""02:00 UTC every day."""
EVAL_EVERY = timedelta(hours=4)
"""Period of the evaluation launch plan."""


def alert_emails(text: str | None) -> list[str]:
    """Comma-separated addresses -> list; unset or empty -> the placeholder on-call address."""
    return [a.strip() for a in (text or "rl-oncall@example.com").split(",") if a.strip()]


ALERT_EMAILS = alert_emails(os.environ.get("VERL_ALERT_EMAILS"))
"""Who hears of a failed or timed-out execution; read from ``VERL_ALERT_EMAILS`` (comma-separated)
when registering. Flyte admin sends it through its configured notifications backend."""
ONE_AT_A_TIME = ConcurrencyPolicy(max_concurrency=1, behavior=ConcurrencyLimitBehavior.SKIP)


@workflow
def ppo_continue(kickoff_time: datetime, extra_steps: int = EXTRA_STEPS, algorithm: str = "grpo",
                 model: str = "", train_files: str = "", val_files: str = "",
                 batch_size: int = 0, rollout_n: int = 0, run_name: str = "nightly",
                 store: str = "", overrides: str = "") -> Summary:
    """Train ``extra_steps`` past the run's newest verified checkpoint (``ppo`` with a run length
    that grows each night). kickoff_time: the scheduled time (set by the schedule); the other
    inputs as in ``ppo``. The run needs a constant LR schedule (refused otherwise)."""
    steps = continuation_steps(algorithm=algorithm, model=model, train_files=train_files,
                               val_files=val_files, batch_size=batch_size, rollout_n=rollout_n,
                               run_name=run_name, store=store, overrides=overrides,
                               extra_steps=extra_steps, kickoff_time=kickoff_time)
    spec = configure(algorithm=algorithm, model=model, train_files=train_files,
                     val_files=val_files, steps=steps, batch_size=batch_size, rollout_n=rollout_n,
                     run_name=run_name, store=store, overrides=overrides)
    return rl_run(spec=prepare(spec=spec))


@workflow
def evaluate_newest(algorithm: str = "grpo", model: str = "", train_files: str = "",
                    val_files: str = "", steps: int = 0, batch_size: int = 0, rollout_n: int = 0,
                    run_name: str = "nightly", store: str = "", overrides: str = "") -> EvalResult:
    """Greedy held-out accuracy of the run's newest verified checkpoint (inputs as in ``ppo``;
    ``steps`` matters only with a cosine LR schedule, where it is part of the run's identity)."""
    spec = prepare(spec=configure(algorithm=algorithm, model=model, train_files=train_files,
                                  val_files=val_files, steps=steps, batch_size=batch_size,
                                  rollout_n=rollout_n, run_name=run_name, store=store,
                                  overrides=overrides))
    return evaluate_state(spec=spec, state=newest_state(spec=spec))


@dynamic
def evaluate_state(spec: RunSpec, state: StepState) -> EvalResult:
    """The evaluate task of the run's ``cluster.mode`` (known once the spec is: a dynamic node)."""
    return heavy_phases(spec).evaluate(spec=spec, state=state)


_ALERTS = [Email(phases=[WorkflowExecutionPhase.FAILED, WorkflowExecutionPhase.TIMED_OUT],
                 recipients_email=ALERT_EMAILS)]

ppo_nightly = LaunchPlan.get_or_create(
    workflow=ppo_continue, name="ppo_nightly",
    schedule=CronSchedule(schedule=NIGHTLY_CRON, kickoff_time_input_arg="kickoff_time"),
    fixed_inputs=NIGHTLY, default_inputs={"extra_steps": EXTRA_STEPS},
    notifications=_ALERTS, concurrency=ONE_AT_A_TIME,
)
"""Nightly continued training of the ``nightly`` run."""

eval_newest = LaunchPlan.get_or_create(
    workflow=evaluate_newest, name="eval_newest",
    schedule=FixedRate(duration=EVAL_EVERY),
    fixed_inputs=NIGHTLY,
    notifications=_ALERTS, concurrency=ONE_AT_A_TIME,
)
"""Evaluation of the ``nightly`` run's newest checkpoint every ``EVAL_EVERY``."""
