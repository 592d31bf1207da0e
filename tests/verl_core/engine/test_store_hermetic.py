"""A run store stays hermetic through garbage collection, and the last checkpoint of a run is
always committed (issue 8, data loss): real workers, real stores, a real full disk."""

import json
import os
import subprocess

import pytest

from test_worker_resume import _cfg, _step, _weights_sha, _worker, assets  # noqa: F401 (fixture)
from verl_core.checkpoint import CheckpointManager, StoreFullError
from verl_core.checkpoint.__main__ import main as checkpoint_cli
from verl_core.store import RunStore
from verl_core.engine import assets as assets_mod
from verl_core.engine.assets import publish_assets
from verl_core.engine.worker import get_batch, put_batch
from verl_core.layout import pending_doc
from verl_core.training.advantage import compute_advantages
from verl_core.reward.scoring import score_batch


def _fresh_host(monkeypatch, tmp_path, name):
    """An empty asset cache and a process that has verified nothing yet."""
    monkeypatch.setenv("VERL_ASSET_CACHE", str(tmp_path / name))
    monkeypatch.setattr(assets_mod, "_VERIFIED", set())


def test_gc_of_an_interrupted_run_keeps_what_its_rerun_needs(tmp_path, assets, monkeypatch):
    """4 steps, checkpoint_interval=2, keep_last=1, stopped inside step 3 after its rollout and
    reward phases; `checkpoint gc --grace-s 0`; then a fresh host (empty asset cache) finishes
    the run: it needs the assets, the lineage batch of update 2 (checkpoint 2 + replay) and the
    reward batch of step 3 (the cached reward phase's output). It ends identical to a run that
    never stopped."""
    cfg = _cfg(total_steps=4, **{"checkpoint.keep_last": 1, "checkpoint.gc_grace_s": 0.0})
    _fresh_host(monkeypatch, tmp_path, "cache-ref")
    ref_uri = str(tmp_path / "ref")
    ref = _worker(ref_uri, cfg, publish_assets(RunStore(ref_uri), assets))
    for s in range(4):
        _step(ref, s)
    ref_sha = _weights_sha(ref)
    ref.close()

    uri = str(tmp_path / "run")
    index = publish_assets(RunStore(uri), assets)
    a = _worker(uri, cfg, index)
    for s in range(3):
        _step(a, s)  # checkpoint of step 2
    rollout_ref, _ = a.rollout(3)
    scored, _ = score_batch(get_batch(a.store, rollout_ref), a.trainer.scorer, a.trainer.tokenizer)
    reward_ref = put_batch(a.store, scored, pending=pending_doc(a.trajectory_hash, 3, "reward"))
    a.close()  # the process dies here
    # and the checkpoint is gone too (say it was found damaged): the rerun must replay every
    # update from the initial model, so every lineage batch must have survived
    mgr = CheckpointManager(RunStore(uri), gc_grace_s=0.0)
    for info in mgr.list_checkpoints():
        RunStore(uri).delete_json(f"checkpoints/{info.name}")
    assert checkpoint_cli(["gc", uri, "--grace-s", "0"]) == 0

    _fresh_host(monkeypatch, tmp_path, "cache-new")
    b = _worker(uri, cfg, index)  # materialises the assets from the store
    batch = get_batch(b.store, reward_ref)  # the cached reward phase's output survived
    batch, _ = compute_advantages(batch, b.cfg.algorithm)
    b.update(3, put_batch(b.store, batch, pending=pending_doc(b.trajectory_hash, 3, "advantage")))
    assert b.replayed == 3  # updates 0, 1, 2 from their lineage batches
    assert _weights_sha(b) == ref_sha
    # consumed phase outputs are no longer roots: the next gc may collect them
    assert not b.store.list_json(f"pending/{b.trajectory_hash[:16]}")
    b.close()


@pytest.fixture
def small_disk(tmp_path):
    """A real 48 MiB filesystem (tmpfs), so a save fails with ENOSPC as on a full volume."""
    mnt = tmp_path / "disk"
    mnt.mkdir()
    res = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=48m", "tmpfs", str(mnt)],
                         capture_output=True, text=True)
    if res.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({res.stderr.strip()}); needs root")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], check=False)


def _fill(path, keep_free: int) -> None:
    st = os.statvfs(os.path.dirname(path))
    with open(path, "wb") as f:
        f.write(b"\0" * max(0, st.f_bavail * st.f_frsize - keep_free))


def test_final_checkpoint_lost_in_the_background_is_saved_again(tmp_path, assets, small_disk):
    """The disk fills during the last step's background save: finalize fails; the re-run (its
    checkpoint phases are cache hits, its worker is new) must not finish without a committed
    final checkpoint."""
    cfg = _cfg(total_steps=3, **{"checkpoint.async_save": True})
    uri = str(small_disk / "store")
    index = publish_assets(RunStore(uri), assets)
    a = _worker(uri, cfg, index)
    for s in range(2):
        _step(a, s)
    ref, _ = a.rollout(2)
    batch = get_batch(a.store, ref)
    batch, _ = score_batch(batch, a.trainer.scorer, a.trainer.tokenizer)
    batch, _ = compute_advantages(batch, a.cfg.algorithm)
    a.update(2, put_batch(a.store, batch))
    final_sha = _weights_sha(a)
    filler = small_disk / "filler"
    _fill(str(filler), keep_free=64 << 10)
    assert a.checkpoint(3)["checkpoint/saved"] == 1.0  # the phase "succeeds": the write is async
    with pytest.raises(StoreFullError):  # finalize of the first run
        a.commit_final(3)
    a.close()
    assert not any(i.step == 3 for i in CheckpointManager(RunStore(uri)).list_checkpoints())

    filler.unlink()  # the operator frees space and re-runs the same command
    b = _worker(uri, cfg, index)  # a new process: it never heard of the failed write
    assert b.commit_final(3)["checkpoint/resaved"] == 1.0
    assert b.commit_final(3)["checkpoint/resaved"] == 0.0  # idempotent
    b.close()
    mgr = CheckpointManager(RunStore(uri))
    assert mgr.verify("latest") == [] and mgr.read_manifest("latest")[0].step == 3
    c = _worker(uri, cfg, index)
    c.ensure_state(3)
    assert c.replayed == 0 and _weights_sha(c) == final_sha  # loaded, not replayed
    c.close()
