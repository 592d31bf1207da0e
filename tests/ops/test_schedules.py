"""The scheduled launch plans (workflows/schedules.py): what registration sends to Flyte admin
(schedule, inputs, notification, concurrency), and the workflows they launch, run locally."""
import json
import os
import re
import subprocess
from datetime import timedelta

import pytest
from flytekit.configuration import ImageConfig, SerializationSettings
from flytekit.models.core.execution import WorkflowExecutionPhase
from flytekit.tools.translator import get_serializable

from tests.workflows.conftest import PYFLYTE, REPO, TINY, flyte_env
from verl_core.config import ConfigError, preset, with_overrides
from verl_core.engine import schedule
from workflows import schedules

SETTINGS = SerializationSettings(image_config=ImageConfig.from_images(
    "registry.example.com/verl-flyte:1", {"gpu": "registry.example.com/verl-flyte-gpu:1"}))


def _literal(lit):
    p = lit.scalar.primitive
    return {"string_value": p.string_value, "integer": p.integer}[p.WhichOneof("value")]


@pytest.fixture(scope="module")
def specs():
    return {lp.name: get_serializable({}, SETTINGS, lp).to_flyte_idl()
            for lp in (schedules.ppo_nightly, schedules.eval_newest)}


def test_nightly_launch_plan_schedule_and_inputs(specs):
    spec = specs["ppo_nightly"].spec
    sched = spec.entity_metadata.schedule
    assert sched.cron_schedule.schedule == "0 2 * * *"
    assert sched.kickoff_time_input_arg == "kickoff_time"
    assert specs["ppo_nightly"].id.name == "ppo_nightly"
    assert spec.workflow_id.name == "workflows.schedules.ppo_continue"
    fixed = {k: _literal(v) for k, v in spec.fixed_inputs.literals.items()}
    assert fixed == schedules.NIGHTLY and fixed["run_name"] == "nightly"
    params = spec.default_inputs.parameters
    assert params["kickoff_time"].required  # filled in by the schedule
    assert _literal(params["extra_steps"].default) == schedules.EXTRA_STEPS == 50
    assert set(params) == {"kickoff_time", "extra_steps"}  # everything else is fixed


def test_evaluation_launch_plan_evaluates_the_nightly_run(specs):
    spec = specs["eval_newest"].spec
    rate = spec.entity_metadata.schedule.rate
    assert timedelta(hours=rate.value) == schedules.EVAL_EVERY and rate.unit == 1  # HOUR
    assert spec.workflow_id.name == "workflows.schedules.evaluate_newest"
    fixed = {k: _literal(v) for k, v in spec.fixed_inputs.literals.items()}
    assert fixed == schedules.NIGHTLY  # the same run identity as the training launch plan


def test_both_launch_plans_skip_overlaps_and_report_failures(specs):
    for name, lp in specs.items():
        policy = lp.spec.concurrency_policy
        assert policy.max == 1 and policy.behavior == 1, name  # CONCURRENCY_LIMIT_BEHAVIOR_SKIP
        (note,) = lp.spec.entity_metadata.notifications
        assert set(note.phases) == {WorkflowExecutionPhase.FAILED, WorkflowExecutionPhase.TIMED_OUT}
        assert list(note.email.recipients_email) == schedules.ALERT_EMAILS


def test_alert_recipients_come_from_the_environment_when_registering():
    assert schedules.alert_emails("a@x.org, b@x.org,") == ["a@x.org", "b@x.org"]
    assert schedules.alert_emails(os.environ.get("VERL_ALERT_EMAILS")) == schedules.ALERT_EMAILS
    assert schedules.alert_emails(None) == schedules.alert_emails("") == ["rl-oncall@example.com"]


def test_continuation_counts_from_the_newest_checkpoint_and_refuses_what_cannot_continue(tmp_path):
    cfg = preset("grpo")
    assert schedule.continuation_total(cfg, str(tmp_path / "run"), 7) == (0, 7)
    assert schedule.newest_step(cfg, str(tmp_path / "run")) == 0
    for bad in (0, -1, 2.5, True):
        with pytest.raises(ConfigError, match="extra_steps=.*must be an integer >= 1"):
            schedule.continuation_total(cfg, str(tmp_path / "run"), bad)
    cosine = with_overrides(cfg, {"optim.lr_schedule": "cosine"})
    with pytest.raises(ConfigError, match="optim.lr_schedule='cosine': continued training needs"):
        schedule.continuation_total(cosine, str(tmp_path / "run"), 5)


def _pyflyte(args, env):
    out = subprocess.run([PYFLYTE, "run", "workflows/schedules.py", *args], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-6000:]
    return out.stdout


@pytest.mark.slow
def test_continued_training_then_evaluation_of_the_newest_checkpoint(tmp_path):
    """docs/cluster.md's local commands. A night trains 2 steps past the newest checkpoint (none
    yet); the evaluation finds that checkpoint (step 2) and scores exactly what the night's final
    evaluation scored; the next night would train from step 2 to 4."""
    import pandas as pd

    from tasks.prepare import build_config
    from verl_core.prepare import run_store_uri

    env = flyte_env(tmp_path)
    store, overrides = tmp_path / "store", json.dumps(TINY)
    run = ["--run-name", "n", "--store", str(store), "--batch-size", "8", "--rollout-n", "4",
           "--overrides", overrides]
    night = _pyflyte(["ppo_continue", "--extra-steps", "2", "--kickoff-time",
                      "2026-12-01T02:00:00", *run], env)
    assert "(scheduled 2026-12-01T02:00:00+00:00): step 0 -> 2" in night and "steps=2" in night
    table = pd.read_parquet(re.search(r"metrics_table='([^']+)'", night).group(1))
    end = table.set_index("step").loc[2]
    evaluated = _pyflyte(["evaluate_newest", *run], env)
    assert f"newest verified checkpoint of {store / 'n'}: step 2" in evaluated
    result = re.search(r"EvalResult\(step=(\d+), accuracy=([^,]+), response_length=([^,)]+)",
                       evaluated)
    assert result, evaluated[-3000:]
    assert int(result.group(1)) == 2
    assert float(result.group(2)) == end["val/accuracy"]
    assert float(result.group(3)) == end["val/response_length"]  # the same weights, greedily
    # the next night: from the checkpoint of step 2 to step 4 (what continuation_steps returns)
    cfg = build_config("grpo", "", "", "", 0, 8, 4, overrides)
    assert schedule.continuation_total(cfg, run_store_uri(str(store), "n"), 2) == (2, 4)
