"""A damaged phase output does not make a run unrecoverable (issue 21 item 2), through `pyflyte
run`: a run killed in step 2's update leaves the three pending batches of step 2 in the store and
their phases in Flyte's cache; 64 flipped bytes in each (same size, other hash), and the plain
re-run recomputes them from their inputs, bit-identical, and ends with the final weights of an
undisturbed run. Real processes, real signals, real store."""
import json
import os

import pytest

from conftest import flyte_env, ppo_cmd, run
from test_resume import _final_weights_sha, _summary
from tests.damage import flip_bytes

pytestmark = pytest.mark.slow

STEPS = 3


def _flip(path, n=64):
    flip_bytes(path, n)


def test_flipped_pending_batches_then_plain_rerun_ends_identical(tmp_path, reference_run):
    from verl_core.engine.worker import PENDING_PHASES
    from verl_core.layout import pending_doc
    from verl_core.store import RunStore

    ref_sha = _final_weights_sha(_summary(reference_run(STEPS).stdout))

    env = flyte_env(tmp_path / "b")
    kill = json.dumps([{"kind": "kill", "phase": "update", "step": 2}])
    killed = run(ppo_cmd(tmp_path / "s", steps=STEPS), {**env, "VERL_FAULTS": kill}, check=False)
    assert killed.returncode != 0

    st = RunStore(str(tmp_path / "s" / "t"))
    (folder,) = st.list_folders("pending")
    config_hash = folder.rsplit("/", 1)[-1]
    refs = [st.get_json(pending_doc(config_hash, 2, p))["batch"] for p in PENDING_PHASES]
    for sha in refs:
        _flip(st.object_path(sha))

    res = run(ppo_cmd(tmp_path / "s", steps=STEPS), env)  # the same command, nothing else
    text = res.stdout + res.stderr
    assert "recomputed bit-identical" in text
    assert _final_weights_sha(_summary(res.stdout)) == ref_sha
    assert all(st.get_bytes(sha) for sha in refs)  # intact again (hash-verified reads)
    assert len(os.listdir(os.path.join(st.root, "quarantine"))) == 3  # the damaged bytes kept
