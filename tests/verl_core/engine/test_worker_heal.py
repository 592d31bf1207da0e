"""Self-healing phase outputs (issue 21 item 2), in process on copies of the shared tracked run's
store (tests/verl_core/conftest.py: 3 GRPO steps, checkpoints of steps 2 and 3, phases called as
the Flyte tasks call them).

A phase's output batch found damaged (64 flipped bytes: same size, other hash) is quarantined and
recomputed from that phase's own inputs, bit-identical, so the cache entries and lineage records
that name it are true again and the run ends where an undisturbed one does. A damaged lineage
record, whose batch only a cache entry still names, is quarantined and reported with what is lost
and the one command that recovers."""
import dataclasses
import hashlib
import os
import shutil

import pytest

from verl_core import phases
from verl_core.engine.workers import WORKERS
from verl_core.engine.worker import StateUnavailableError
from verl_core.errors import CorruptObjectError
from verl_core.layout import pending_doc
from verl_core.store import RunStore


@pytest.fixture
def copy_run(tracked_run, tmp_path, monkeypatch):
    """``copy_run(name)``: a spec of the tracked run on a copy of its store (same incarnation,
    same trajectory), its own in-process workers; all released at the end."""
    monkeypatch.setenv("VERL_ASSET_CACHE", str(tmp_path / "assets"))
    monkeypatch.delenv("VERL_FAULTS", raising=False)
    spec = dataclasses.replace(tracked_run.spec, config=dataclasses.replace(
        tracked_run.spec.config, tracking=dataclasses.replace(
            tracked_run.spec.config.tracking, tensorboard_dir="", mlflow_tracking_uri="")))

    def make(name):
        shutil.copytree(tracked_run.spec.store, tmp_path / name)
        return dataclasses.replace(spec, store=str(tmp_path / name))

    yield make
    WORKERS.release_all()


def _flip(store: RunStore, sha: str, n: int = 64) -> None:
    """Flip ``n`` bytes in the middle of object ``sha`` (bit rot: the size is unchanged)."""
    path = store.object_path(sha)
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) // 2)
        data = f.read(n)
        f.seek(-len(data), 1)
        f.write(bytes(b ^ 0xFF for b in data))


def _intact(store: RunStore, sha: str) -> bool:
    return hashlib.sha256(open(store.object_path(sha), "rb").read()).hexdigest() == sha


def _quarantined(store: RunStore) -> list[str]:
    d = os.path.join(store.root, "quarantine")
    return sorted(os.listdir(d)) if os.path.isdir(d) else []


def _weights(spec) -> str:
    w = WORKERS.handle(spec)
    h = hashlib.sha256()
    for k, v in sorted(w.trainer.actor.model.state_dict().items()):
        h.update(k.encode())
        h.update(v.detach().contiguous().numpy().tobytes())
    return h.hexdigest()


def test_damaged_pending_batches_are_recomputed_and_the_update_ends_identical(copy_run):
    """Step 3 of the tracked run (a 4th step on its store copies): rollout, reward, advantage,
    then a fresh process. In one copy the update runs at once; in the other the three pending
    batches get 64 flipped bytes each, then the cached outputs are used as a re-run would."""
    state = phases.StepState(step=3)
    ref_spec = copy_run("ref")
    adv = phases.advantage(ref_spec, phases.reward(ref_spec, phases.rollout(ref_spec, state)))
    WORKERS.release_all()
    phases.update(ref_spec, adv)
    expected = _weights(ref_spec)
    WORKERS.release_all()

    spec = copy_run("damaged")
    st = spec.open_store()
    sampled = phases.rollout(spec, state)
    scored = phases.reward(spec, sampled)
    advantaged = phases.advantage(spec, scored)
    assert advantaged.batch == adv.batch  # the two copies are the same trajectory
    WORKERS.release_all()  # what a killed run leaves: the store and the cache entries
    for out in (sampled, scored, advantaged):
        _flip(st, out.batch)
        assert not _intact(st, out.batch)

    # the advantage phase re-executes on its cached input (the damaged reward batch): the worker
    # recomputes it from the rollout batch, which it recomputes from the state of step 3
    again = phases.advantage(spec, scored)
    assert again.batch == advantaged.batch
    assert all(_intact(st, out.batch) for out in (sampled, scored, advantaged))
    assert len(_quarantined(st)) == 3  # the damaged bytes, kept for inspection

    # the update's own input damaged again, read by a fresh worker: recomputed from the reward
    # batch its pending doc names, and the update ends bit-identical to the undisturbed one
    WORKERS.release_all()
    _flip(st, advantaged.batch)
    phases.update(spec, advantaged)
    assert _intact(st, advantaged.batch) and len(_quarantined(st)) == 4
    assert _weights(spec) == expected


def test_damaged_lineage_batch_is_recomputed_from_the_replayed_state(copy_run):
    """The batch of update 2 (its pending docs are gone, only the lineage names it), damaged,
    while the state of step 3 must be rebuilt by replay (checkpoint 3 removed): recomputed
    from the state of step 2, and the rebuilt state is the one checkpoint 3 holds."""
    ref_spec = copy_run("ref")
    WORKERS.handle(ref_spec).ensure_state(3)  # loads checkpoint 3
    expected = _weights(ref_spec)
    spec = copy_run("damaged")
    st = spec.open_store()
    h = spec.trajectory_hash
    assert st.get_json(pending_doc(h, 2, "advantage"), default=None) is None
    ref = st.get_json(f"lineage/{h[:16]}/000000002")["batch"]
    for name in st.list_json("checkpoints"):
        if name.rsplit("/", 1)[-1].startswith("000000000003"):
            st.delete_json(name)
    _flip(st, ref)

    w = WORKERS.handle(spec)
    w.ensure_state(3)
    assert w.replayed == 1 and _intact(st, ref) and len(_quarantined(st)) == 1
    assert _weights(spec) == expected


def test_truncated_lineage_record_is_quarantined_and_named_with_the_fix(copy_run):
    spec = copy_run("torn")
    st = spec.open_store()
    name = f"lineage/{spec.trajectory_hash[:16]}/000000000"
    path = st.doc_path(name)
    raw = open(path, "rb").read()
    with open(path, "wb") as f:
        f.write(raw[:len(raw) // 2])

    w = WORKERS.handle(spec)
    with pytest.raises(StateUnavailableError) as e:
        w.ensure_state(1)  # no checkpoint at or before step 1: update 0 must be replayed
    msg = str(e.value)
    assert f"{name}.json" in msg and "moved to" in msg and "--overwrite-cache" in msg
    assert "the states of steps 1..1 cannot be rebuilt" in msg
    assert not st.has_json(name) and len(_quarantined(st)) == 1
    with pytest.raises(StateUnavailableError, match="--overwrite-cache"):
        w.ensure_state(1)  # the next attempt finds it missing and says the same fix


def test_batch_that_recomputes_to_other_bytes_is_not_written_and_names_the_fix(copy_run):
    """The damaged batch of update 2 is recomputed from an input that is not the one it was made
    from (a pending reward doc naming update 1's batch: a wrong recorded input stands for a phase
    that is not bit-reproducible here). The result hashes to something else: nothing is written
    under the old name, and the error says it is lost and how to recover."""
    spec = copy_run("other")
    st = spec.open_store()
    h = spec.trajectory_hash
    ref = st.get_json(f"lineage/{h[:16]}/000000002")["batch"]
    other = st.get_json(f"lineage/{h[:16]}/000000001")["batch"]
    st.put_json(pending_doc(h, 2, "reward"), {"batch": other})
    _flip(st, ref)

    w = WORKERS.handle(spec)
    w.ensure_state(2)
    with pytest.raises(CorruptObjectError) as e:
        w.batch(2, "advantage", ref)
    msg = str(e.value)
    assert "recomputing it from its inputs gave other bytes" in msg and "--overwrite-cache" in msg
    assert e.value.quarantined and os.path.exists(e.value.quarantined)
    assert not st.has_object(ref)  # never stored under a name its bytes do not hash to
