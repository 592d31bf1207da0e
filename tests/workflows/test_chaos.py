"""Chaos drill through `pyflyte run` (issue 12): 12 steps with at least one fault of every kind
that VERL_FAULTS offers, at different phases. Real processes, real signals, real store.

1. Faults that change no data (errors, SIGKILLs, a phase slowed past its deadline, a store
   outage, a corrupted checkpoint object, a second writer): the same command is run again after
   each failure, as a user (or Flyte's recover) would, and the run ends with final weights
   bit-identical to a fault-free run with the same seed; every committed checkpoint is there and
   verifies, the corrupted one repaired.
2. NaN faults (gradients, rewards): each is caught before it reaches the weights, the step is
   skipped, and the event log, the metrics table and the console line say so.
"""
import json

import pytest

from conftest import flyte_env, ppo_cmd, run
from test_resume import _final_weights_sha, _summary

pytestmark = pytest.mark.slow

STEPS = 12
OVER = {"guard.phase_timeout_s": 20.0, "checkpoint.keep_last": 3}

DATA_SAFE = [
    {"kind": "transient", "phase": "rollout", "step": 1},
    {"kind": "permanent", "phase": "advantage", "step": 2, "times": 1},
    {"kind": "kill", "phase": "update", "step": 3},
    {"kind": "slow", "phase": "reward", "step": 5, "seconds": 25},
    {"kind": "store_outage", "phase": "update", "step": 6, "seconds": 1.5},
    {"kind": "corrupt_object", "phase": "checkpoint", "step": 8},
    {"kind": "second_writer", "phase": "rollout", "step": 8},
    {"kind": "kill", "phase": "update", "step": 9},  # the resume meets the corrupted checkpoint
]
NAN = [
    {"kind": "nan_grad", "phase": "update", "step": 3},
    {"kind": "nan_reward", "phase": "reward", "step": 7},
]


def _until_done(cmd, env, logs, attempts=5):
    """Run ``cmd`` until it succeeds (each failure is an injected one), like re-running by hand.
    Every run's output is kept in ``logs/run-<i>.txt``."""
    outs = []
    logs.mkdir(parents=True, exist_ok=True)
    for i in range(attempts):
        res = run(cmd, env, timeout=900, check=False)
        outs.append(res.stdout + res.stderr)
        (logs / f"run-{i}.txt").write_text(outs[-1])
        if res.returncode == 0:
            return res, outs
    pytest.fail("still failing after %d runs (outputs in %s):\n%s" % (attempts, logs,
                                                                     outs[-1][-6000:]))


def _checkpoints(run_store):
    from verl_core.checkpoint import CheckpointManager
    from verl_core.store import RunStore

    mgr = CheckpointManager(RunStore(str(run_store)))
    infos = [i for i in mgr.list_checkpoints() if i.error is None]
    return {i.step: mgr.verify(i.name) for i in infos}


def test_chaos_run_ends_identical_and_nan_is_caught(tmp_path):
    ref = run(ppo_cmd(tmp_path / "ref", steps=STEPS, overrides=OVER), flyte_env(tmp_path / "a"),
              timeout=900)
    ref_sha = _final_weights_sha(_summary(ref.stdout))
    ref_ckpts = _checkpoints(tmp_path / "ref" / "t")

    # 1. every data-preserving fault kind
    env = flyte_env(tmp_path / "b", VERL_FAULTS=json.dumps(DATA_SAFE))
    res, outs = _until_done(ppo_cmd(tmp_path / "s", steps=STEPS, overrides=OVER), env,
                            tmp_path / "logs")
    text = "\n".join(outs)
    assert len(outs) == 4, "permanent, kill, kill: three failed runs, then success"
    assert "injected transient fault in rollout of step 1" in text
    assert "injected permanent fault in advantage of step 2" in text
    assert "passed its deadline" in text  # the slow reward phase was cut and retried
    assert "injected store_outage" in text
    assert "second_writer: refused" in text
    assert _final_weights_sha(_summary(res.stdout)) == ref_sha
    ckpts = _checkpoints(tmp_path / "s" / "t")
    assert set(ckpts) == set(ref_ckpts)  # none lost
    assert all(problems == [] for problems in ckpts.values()), ckpts  # none left corrupted

    # 2. NaN gradients and NaN rewards
    env = flyte_env(tmp_path / "c", VERL_FAULTS=json.dumps(NAN))
    res = run(ppo_cmd(tmp_path / "n", steps=STEPS, overrides=OVER), env, timeout=900)
    from verl_core.store import RunStore
    from verl_core.guard.events import read_events
    import pandas as pd
    import torch
    from safetensors.torch import load_file

    st = RunStore(str(tmp_path / "n" / "t"))
    (config_hash,) = [n.rsplit("/", 1)[-1] for n in st.list_folders("events")]
    events = read_events(st, config_hash)
    assert {(e["step"], e["detector"], e["action"]) for e in events} == {
        (3, "nonfinite", "skip_batch"), (7, "nonfinite", "skip_batch")}
    assert "guard: nonfinite" in res.stdout  # the console line of the step
    summary = _summary(res.stdout)
    table = pd.read_parquet(summary.split("metrics_table='", 1)[1].split("'", 1)[0])
    skipped = table.loc[table["guard/skip_batch"].fillna(0) > 0, "step"].tolist()
    assert skipped == [4, 8]  # the rows of the states after updates 3 and 7
    final = summary.split("final_model='", 1)[1].split("'", 1)[0]
    weights = load_file(f"{final}/model.safetensors")
    assert all(torch.isfinite(t).all() for t in weights.values())
