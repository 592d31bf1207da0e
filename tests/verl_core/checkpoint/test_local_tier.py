"""The local-disk checkpoint tier at the worker level, on real stores: a checkpoint commits to local
disk first and is replicated to the run store behind; a store that refuses writes delays
replication without stopping training and never shows a partial checkpoint; a damaged or deleted
local copy falls back to the run store's copy bit for bit; a lost node loses (and reports) only
its unreplicated checkpoints, whose states lineage replay rebuilds."""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "engine"))
from test_worker_resume import _cfg, _step, _weights_sha, _worker, assets  # noqa: E402,F401

from verl_core.checkpoint import CheckpointManager  # noqa: E402
from verl_core.store import RunStore  # noqa: E402
from verl_core.config import ConfigError  # noqa: E402
from verl_core.engine.assets import publish_assets  # noqa: E402

STEPS = 4  # checkpoints at steps 2 and 4 (interval 2)


def _tier_cfg(local, **over):
    return _cfg(**{"total_steps": STEPS, "checkpoint.local_dir": str(local),
                   "checkpoint.async_save": True, **over})


def _run(tmp, assets, steps=STEPS, local=True):
    uri, local_dir = str(tmp / "store"), tmp / "local"
    cfg = _tier_cfg(local_dir) if local else _cfg(**{"total_steps": STEPS})
    index = publish_assets(RunStore(uri), assets)
    w = _worker(uri, cfg, index)
    return w, uri, cfg, index


def _store_steps(uri):
    return sorted(i.step for i in CheckpointManager(RunStore(uri)).list_checkpoints()
                  if i.error is None)


def _chattr(flag, path):
    if shutil.which("chattr") is None or os.geteuid() != 0:
        pytest.skip("needs root and chattr to make a folder refuse writes (root ignores chmod)")
    subprocess.run(["chattr", flag, str(path)], check=True)


@pytest.fixture(scope="module")
def reference(tmp_path_factory, assets):
    """Weight hashes of every step of a plain run (no local tier): the tier must not change them."""
    w, *_ = _run(tmp_path_factory.mktemp("ref"), assets, local=False)
    shas = {0: _weights_sha(w)}
    for s in range(STEPS):
        _step(w, s)
        shas[s + 1] = _weights_sha(w)
    w.close()
    return shas


def test_local_commit_then_replicated(tmp_path, assets, reference):
    w, uri, cfg, _ = _run(tmp_path, assets)
    for s in range(STEPS):
        _step(w, s)
        assert _weights_sha(w) == reference[s + 1]
    local = w.local_ckpt
    assert local.store.root == str(tmp_path / "local" / RunStore(uri).incarnation_id)
    out = w.commit_final(STEPS)
    assert out["checkpoint/resaved"] == 0.0 and out["checkpoint/unreplicated"] == 0.0
    assert out["checkpoint/lost"] == 0.0
    store = CheckpointManager(RunStore(uri))
    names = [i.name for i in store.list_checkpoints()]
    assert [i.name for i in local.list_checkpoints()] == names  # byte-identical manifests
    assert [int(n[:12]) for n in names] == [2, 4]
    for n in names:
        assert store.verify(n) == [], n  # every object re-hashed in the run store
    assert store.resolve("latest") == names[-1]
    events = [r["event"] for r in RunStore(uri).read_log("checkpoints")]
    assert events.count("replicated") == 2 and "commit" not in events  # only replicas here
    w.close()


def test_config_refuses_url_and_worker_groups():
    with pytest.raises(ConfigError, match=r"checkpoint.local_dir='s3://b/x': must be a local"):
        _cfg(**{"checkpoint.local_dir": "s3://b/x"})
    with pytest.raises(ConfigError, match=r"checkpoint.local_dir='/ssd'.*2 workers"):
        _cfg(**{"checkpoint.local_dir": "/ssd", "trainer.n_gpus_per_node": 2})


def test_store_refusing_writes_delays_replication_only(tmp_path, assets, reference):
    w, uri, *_ = _run(tmp_path, assets)
    for s in range(2):
        _step(w, s)
    assert w.replicator.flush(60) == [] and _store_steps(uri) == [2]
    manifests = Path(uri) / "checkpoints"
    _chattr("+i", manifests)  # the run store refuses new manifests (an outage, for replication)
    try:
        for s in range(2, STEPS):  # training goes on; the step-4 checkpoint commits locally
            _step(w, s)
        w.wait_checkpoints()
        assert w.replicator.flush(1.0) == [4]  # retried in the background, not yet through
        m = w.replicator.metrics()
        assert m["checkpoint/unreplicated"] == 1.0 and m["checkpoint/replication_lag_s"] > 0
        assert "Permission" in (w.replicator.last_error or "")
        assert _store_steps(uri) == [2]  # nothing partial: no manifest without its objects
        store = CheckpointManager(RunStore(uri))
        assert store.resolve("latest").startswith(f"{2:012d}") and store.verify("latest") == []
    finally:
        _chattr("-i", manifests)
    assert w.replicator.flush(60) == []  # caught up once the store is back
    assert _store_steps(uri) == [2, 4]
    store = CheckpointManager(RunStore(uri))
    assert store.resolve("latest").startswith(f"{4:012d}") and store.verify("latest") == []
    assert w.commit_final(STEPS)["checkpoint/resaved"] == 0.0
    w.close()


def test_damaged_or_deleted_local_copy_falls_back_to_the_store(tmp_path, assets, reference):
    w, uri, cfg, index = _run(tmp_path, assets)
    for s in range(STEPS):
        _step(w, s)
    w.commit_final(STEPS)
    local = w.local_ckpt.store
    w.close()
    names = {int(i.name[:12]): i.name for i in CheckpointManager(local).list_checkpoints()}
    # step 4: the local copy's largest object is corrupted; step 2: its local manifest deleted
    m = json.loads(local.get_json_raw(f"checkpoints/{names[4]}"))
    sha = max(m["objects"], key=m["objects"].get)
    Path(local.object_path(sha)).write_bytes(b"\0" * m["objects"][sha])
    local.delete_json(f"checkpoints/{names[2]}")

    c = _worker(uri, cfg, index)
    c.ensure_state(4)  # local copy rejected by its hash -> the run store's copy
    assert _weights_sha(c) == reference[4] and c.replayed == 0
    c.ensure_state(3)  # no local copy of step 2 -> the store's, + one update replayed
    assert _weights_sha(c) == reference[3] and c.replayed == 1
    assert c.lost_checkpoints == set()
    c.close()


def test_lost_node_resumes_from_replicated_and_reports(tmp_path, assets, reference):
    w, uri, cfg, index = _run(tmp_path, assets)
    for s in range(2):
        _step(w, s)
    assert w.replicator.flush(60) == []
    manifests = Path(uri) / "checkpoints"
    _chattr("+i", manifests)
    try:
        for s in range(2, STEPS):
            _step(w, s)
        w.wait_checkpoints()
        assert w.replicator.close() == [4]  # the node dies before step 4 reached the store
        shutil.rmtree(tmp_path / "local")   # ... and its local disk with it
    finally:
        _chattr("-i", manifests)
    w.close()
    assert _store_steps(uri) == [2]

    d = _worker(uri, cfg, index)  # a fresh node
    d.ensure_state(STEPS)  # step-2 checkpoint from the store + replay of updates 2 and 3
    assert _weights_sha(d) == reference[STEPS] and d.replayed == 2
    assert d.lost_checkpoints == {4}
    out = d.commit_final(STEPS)  # the final state must be in the run store: saved again
    assert out["checkpoint/resaved"] == 1.0 and out["checkpoint/lost"] == 1.0
    assert _store_steps(uri) == [2, 4]
    assert CheckpointManager(RunStore(uri)).verify("latest") == []
    d.close()
