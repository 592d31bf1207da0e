"""Sharded checkpoints through torch.distributed.checkpoint with the run store underneath.

Real FSDP2 jobs (gloo, one process per worker, dcp_worker.py): W = 2 saves, W = 3 and one plain
process load it bit for bit; workers that pick different manifests refuse to restore; a job killed
in the middle of an async save leaves the previous ``latest``. Single-process cases (DCP with
``no_dist``) run in this process.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed.checkpoint as tdcp
from torch.distributed.checkpoint.api import CheckpointException
from safetensors.torch import load_file
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from verl_core.checkpoint import (
    CheckpointManager,
    CheckpointSaveError,
    CorruptObjectError,
    RunStore,
    export_hf,
)
from verl_core.checkpoint.dcp import StoreWriter
from verl_core.store import canonical_json, sha256_hex
from verl_core.checkpoint.tensors import save_tensors

WORKER = os.path.join(os.path.dirname(__file__), "dcp_worker.py")


def _env():
    return {**os.environ, "OMP_NUM_THREADS": "1",
            "PYTHONPATH": os.getcwd() + os.pathsep + os.environ.get("PYTHONPATH", "")}


def _run_job(mode, world, root, work, timeout=120):
    procs = [subprocess.Popen([sys.executable, WORKER, mode, str(r), str(world), root, str(work)],
                              env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True) for r in range(world)]
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=timeout)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for r, (p, out) in enumerate(zip(procs, outs)):
        assert p.returncode == 0, f"{mode} rank {r}:\n{out[-4000:]}"


def _report(work, tag, world):
    return [json.load(open(work / f"{tag}-rank{r}.json")) for r in range(world)]


def _same_state(work, a, b):
    """Two dumps of dcp_worker.dump_full: every tensor and the param_groups, bit for bit."""
    x, y = load_file(str(work / f"{a}.safetensors")), load_file(str(work / f"{b}.safetensors"))
    assert sorted(x) == sorted(y)
    for k in x:
        assert torch.equal(x[k], y[k]), k
    assert json.load(open(work / f"{a}-param_groups.json")) == \
        json.load(open(work / f"{b}-param_groups.json"))


@pytest.mark.slow
def test_w2_checkpoint_resumes_on_w3_and_on_one_process(tmp_path):
    root, work = str(tmp_path / "store"), tmp_path / "work"
    work.mkdir()
    _run_job("save", 2, root, work)
    saved = _report(work, "save", 2)
    assert saved[0] == saved[1]  # every rank returned the same CheckpointInfo
    assert saved[0]["parent"] == saved[0]["one"]

    mgr = CheckpointManager(RunStore(root))
    info, m = mgr.read_manifest("latest")
    assert info.name == saved[0]["two"] and m["world_size"] == 2
    assert m["hash"] == mgr.hash_algo and all(g["hash"] == m["hash"] for g in m["groups"].values())
    assert mgr.verify(info.name) == [] and mgr.verify(saved[0]["one"]) == []
    assert mgr.load(saved[0]["one"], groups=[])[1] == {"step": 1, "rank": 0}  # rank 0's meta
    # the non-tensor leaves are JSON in the manifest, not pickles in objects
    assert m["groups"]["optimizer"]["tree"]["param_groups"][0]["lr"] == 1e-2
    # the frozen reference model's shards were written once: step 2 names step 1's objects
    _, m1 = mgr.read_manifest(saved[0]["one"])
    assert m["groups"]["reference"] == m1["groups"]["reference"]

    # W = 3: three workers with other weights read their rows and end up with the same state
    _run_job("load", 3, root, work)
    loaded = _report(work, "load-w3", 3)
    assert {r["name"] for r in loaded} == {info.name} and loaded[0]["meta"] == {"step": 2}
    _same_state(work, "saved", "loaded-w3")
    total = sum(m["objects"].values())
    assert all(r["bytes_read"] < 0.6 * total for r in loaded), (loaded, total)

    # W = 1: one plain process (no process group, no FSDP)
    sys.path.insert(0, os.path.dirname(WORKER))
    try:
        from dcp_worker import Net
    finally:
        sys.path.pop(0)
    torch.manual_seed(3)
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    state = {"policy": get_model_state_dict(model),
             "optimizer": get_optimizer_state_dict(model, opt)}
    meta, got = mgr.load_distributed("auto", state)
    assert got == info and meta == {"step": 2}
    set_model_state_dict(model, state["policy"])
    set_optimizer_state_dict(model, opt, state["optimizer"])
    expected = load_file(str(work / "saved.safetensors"))
    for k, v in model.state_dict().items():
        assert torch.equal(v, expected[f"policy/{k}"]), k
    osd = get_optimizer_state_dict(model, opt)
    for fqn, st in osd["state"].items():
        for k, v in st.items():
            assert torch.equal(v, expected[f"optimizer/{fqn}/{k}"]), (fqn, k)
    # and the single-process reader of the manifest agrees (whole tensors, no DCP)
    groups, _, _ = mgr.load(info.name, groups=["policy"])
    assert all(torch.equal(groups["policy"][k], expected[f"policy/{k}"]) for k in groups["policy"])


@pytest.mark.slow
def test_workers_that_disagree_on_the_manifest_refuse_to_restore(tmp_path):
    root, work = str(tmp_path / "store"), tmp_path / "work"
    work.mkdir()
    _run_job("disagree", 2, root, work)
    reports = _report(work, "disagree", 2)
    one, two = reports[0]["infos"]
    for r in reports:
        assert r["unchanged"]  # nothing was loaded
        assert r["agreed"] == one  # agreeing ranks get the name back
        for kind in ("load", "agree_on"):
            msg = r["errors"][kind]
            assert f"rank 0: step 1 manifest sha256 {one.split('-')[1]}" in msg, msg
            assert f"rank 1: step 2 manifest sha256 {two.split('-')[1]}" in msg, msg


def _objects(root):
    base = os.path.join(root, "objects")
    return sum(len([n for n in os.listdir(os.path.join(base, d)) if not n.startswith(".")])
               for d in os.listdir(base)) if os.path.isdir(base) else 0


@pytest.mark.slow
def test_job_killed_mid_async_save_keeps_previous_latest(tmp_path):
    root, work = str(tmp_path / "store"), tmp_path / "work"
    work.mkdir()
    procs = [subprocess.Popen([sys.executable, WORKER, "crash", str(r), "2", root, str(work)],
                              env=_env(), stdout=subprocess.PIPE, text=True) for r in range(2)]
    try:
        assert procs[0].stdout.readline().split() == ["committed", "1"]
        mgr = CheckpointManager(RunStore(root), gc_grace_s=0.0, inflight_timeout_s=0.0)
        first, m1 = mgr.read_manifest("latest")
        after_first = len(m1["objects"])
        assert _objects(root) == after_first
        deadline = time.monotonic() + 60
        while _objects(root) <= after_first:  # the first object of step 2 is on disk
            assert time.monotonic() < deadline and all(p.poll() is None for p in procs)
            time.sleep(0.001)
        for p in procs:
            os.kill(p.pid, signal.SIGKILL)
        for p in procs:
            p.wait(timeout=10)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()

    assert mgr.resolve("latest") == first.name
    assert [i.step for i in mgr.list_checkpoints()] == [1]
    assert mgr.verify(first.name) == []
    groups, meta, info = mgr.load("auto")
    assert info == first and meta == {"step": 1}
    assert _objects(root) > after_first  # the killed save left unreferenced objects behind
    mgr.gc()  # the dead save's marker is stale (timeout 0): its leftovers go
    assert _objects(root) == after_first and mgr.store.list_json("inflight") == []


# ------------------------------------------------------------------ single process (no_dist)
def _trained(seed=0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Linear(5, 3))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(4, 6)).sum().backward()
    opt.step()
    return model, opt


def test_load_distributed_into_one_process_rebuilds_non_tensor_leaves(manager):
    model, opt = _trained(0)
    info = manager.save(3, {"policy": get_model_state_dict(model),
                            "optimizer": get_optimizer_state_dict(model, opt),
                            "counters": {"seen": 12, "loss": float("nan")}}, {"m": 1})
    other, oopt = _trained(1)
    for group in oopt.param_groups:
        group["lr"] = 0.5  # the checkpoint's param_groups must win
    state = {"policy": get_model_state_dict(other),
             "optimizer": get_optimizer_state_dict(other, oopt),
             "counters": {"seen": 0, "loss": 0.0}}
    policy_before = state["policy"]
    meta, got = manager.load_distributed(info.name, state)
    assert got == info and meta == {"m": 1}
    assert state["policy"] is policy_before  # the same dict, filled in place
    loss = state["counters"]["loss"]
    assert state["counters"]["seen"] == 12 and loss != loss  # NaN survives
    set_model_state_dict(other, state["policy"])
    set_optimizer_state_dict(other, oopt, state["optimizer"])
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(),
                                                 other.state_dict().values()))
    assert oopt.param_groups[0]["lr"] == 1e-2
    a, b = opt.state_dict(), oopt.state_dict()
    for pid in a["state"]:
        for k in a["state"][pid]:
            assert torch.equal(a["state"][pid][k], b["state"][pid][k]), (pid, k)
    # a target tensor the checkpoint lacks, or one of another shape, is refused before reading
    with pytest.raises(KeyError, match="lacks"):
        manager.load_distributed(info.name, {"policy": {"nope": torch.zeros(1)}})
    with pytest.raises(ValueError, match="0.weight"):
        manager.load_distributed(info.name, {"policy": {"0.weight": torch.zeros(5, 5)}})


def test_objects_never_mix_groups(manager):
    # DCP sees one flat dict of every group's tensors; packing stays per group, so a shared
    # group's (or a frozen model's) objects hold only its own tensors
    model, opt = _trained()
    info = manager.save(1, {"policy": model.state_dict(), "optimizer": opt.state_dict(),
                            "reference": model.state_dict()})
    _, m = manager.read_manifest(info.name)
    owners = {}
    for g, doc in m["groups"].items():
        for e in doc["tensors"].values():
            for c in e["chunks"]:
                owners.setdefault(c["sha"], set()).add(g)
    assert all(len(gs) == 1 or gs == {"policy", "reference"} for gs in owners.values())
    assert {c["sha"] for e in m["groups"]["policy"]["tensors"].values() for c in e["chunks"]} \
        == {c["sha"] for e in m["groups"]["reference"]["tensors"].values() for c in e["chunks"]}


def test_agree_on_alone_returns_the_name(manager):
    model, _ = _trained()
    info = manager.save(1, {"policy": model.state_dict()})
    assert manager.agree_on(info.name) == info.name


def test_writer_refuses_non_tensor_values_it_would_have_to_pickle(store):
    writer = StoreWriter(store)
    with pytest.raises(CheckpointException) as e:  # DCP's wrapper of the writer's error
        tdcp.save({"w": torch.zeros(2), "opaque": {"a": object()}}, storage_writer=writer,
                  no_dist=True)
    assert "never pickles" in str(e.value)
    assert not os.path.isdir(os.path.join(store.root, "objects"))  # refused before any write


def test_save_refuses_unsupported_values_naming_them(manager):
    with pytest.raises(CheckpointSaveError, match="group .optimizer.: state/0/it"):
        manager.save_distributed(1, {"optimizer": {"state": {0: {"it": iter([1])}}}})
    assert manager.store.list_json("inflight") == []


@pytest.mark.parametrize("algo", ["sha256", "blake3"])
def test_hash_algorithm_is_recorded_verified_and_quarantined_by_it(store, algo):
    mgr = CheckpointManager(store, hash_algo=algo, chunk_bytes=1024, gc_grace_s=0.0)
    model, opt = _trained()
    info = mgr.save(1, {"policy": model.state_dict(), "optimizer": opt.state_dict()}, {"a": 1})
    _, m = mgr.read_manifest(info.name)
    assert m["hash"] == algo and {g["hash"] for g in m["groups"].values()} == {algo}
    assert mgr.verify(info.name) == []
    # intact objects are never judged by the wrong algorithm: repair moves nothing
    assert mgr.verify(info.name, repair=True) == []
    assert not os.path.isdir(os.path.join(store.root, "quarantine"))
    sha = m["groups"]["policy"]["tensors"]["0.weight"]["chunks"][0]["sha"]
    path = store.object_path(sha)
    data = bytearray(open(path, "rb").read())
    data[-1] ^= 1
    open(path, "wb").write(bytes(data))
    with pytest.raises(CorruptObjectError, match=sha):
        mgr.load(info.name)
    assert not store.has_object(sha) and os.listdir(os.path.join(store.root, "quarantine"))
    again = mgr.save(2, {"policy": model.state_dict(), "optimizer": opt.state_dict()}, {"a": 1})
    assert store.has_object(sha) and mgr.verify(again.name) == []


def test_store_mixing_both_algorithms_loads_each_checkpoint_by_its_own(store):
    model, opt = _trained()
    a = CheckpointManager(store, hash_algo="sha256").save(1, {"reference": model.state_dict()})
    b = CheckpointManager(store, hash_algo="blake3").save(2, {"policy": model.state_dict()})
    mgr = CheckpointManager(store)
    _, mb = mgr.read_manifest(b.name)
    # the reference group was linked from a's sha256 objects into b, a blake3 checkpoint
    assert mb["hash"] == "blake3" and mb["groups"]["reference"]["hash"] == "sha256"
    assert mgr.verify(a.name) == [] and mgr.verify(b.name) == []
    groups, _, _ = mgr.load(b.name)
    for k, v in model.state_dict().items():
        assert torch.equal(groups["reference"][k], v) and torch.equal(groups["policy"][k], v)


def _write_v1(store, step, tensors, meta, parent=None):
    """A ``verl-checkpoint/1`` checkpoint as the code before DCP wrote it: sha256 objects,
    ``shards``, no ``hash``, group docs without ``hash``."""
    index = save_tensors(store, tensors, chunk_bytes=512, algo="sha256")
    meta_bytes = canonical_json(meta)
    meta_sha = store.put_bytes(meta_bytes)
    objects = {meta_sha: len(meta_bytes)}
    objects.update({c["sha"]: c["size"] for e in index.values() for c in e["chunks"]})
    manifest = {"format": "verl-checkpoint/1", "step": step, "created": 1.0,
                "created_iso": "1970-01-01T00:00:01+00:00", "config_hash": "old",
                "package_version": "0.0", "incarnation_id": store.incarnation_id,
                "parent": parent, "meta": {"sha": meta_sha, "size": len(meta_bytes)},
                "groups": {"policy": {"shared": False, "tensors": index,
                                      "tree": {k: {"$t": k} for k in tensors}}},
                "shards": [{"shard_id": 0, "num_shards": 1, "record_sha": None}],
                "objects": objects}
    raw = canonical_json(manifest)
    name = f"{step:012d}-{sha256_hex([raw])}"
    store.put_json_raw(f"checkpoints/{name}", raw)
    store.put_json("latest", {"name": name, "step": step, "sha": name.split("-")[1]})
    return name


def test_v1_manifests_still_load_verify_export_and_continue(store, tmp_path, tiny_llama):
    llama = tiny_llama(seed=4)
    name = _write_v1(store, 7, llama.state_dict(), {"hf_config": llama.config.to_dict()})
    mgr = CheckpointManager(store, hash_algo="blake3")
    assert mgr.verify(name) == [] and mgr.list_checkpoints()[0].error is None
    groups, meta, info = mgr.load("auto")
    assert info.name == name
    assert all(torch.equal(groups["policy"][k], v) for k, v in llama.state_dict().items())
    other = tiny_llama(seed=5)
    state = {"policy": get_model_state_dict(other)}
    mgr.load_distributed("latest", state)
    set_model_state_dict(other, state["policy"])
    assert all(torch.equal(a, b) for a, b in zip(llama.state_dict().values(),
                                                 other.state_dict().values()))
    export_hf(mgr, name, str(tmp_path / "hf"))
    assert (tmp_path / "hf" / "model.safetensors").exists()
    nxt = mgr.save(8, {"policy": other.state_dict()})  # the run continues in the new format
    assert nxt.parent == name and mgr.read_manifest(nxt.name)[1]["format"] == "verl-checkpoint/2"


def test_async_save_distributed_snapshots_and_reraises(manager, store, monkeypatch):
    w = torch.randn(64, 64)
    handle = manager.async_save_distributed(1, {"policy": {"w": w}}, {"s": 1})
    expected = w.clone()
    w.add_(1.0)  # training goes on right away
    good = handle.wait()
    assert torch.equal(manager.load(good.name)[0]["policy"]["w"], expected)

    real = store.put_parts
    monkeypatch.setattr(store, "put_parts", lambda *a, **k: (_ for _ in ()).throw(
        CheckpointSaveError("injected: store refused the write")))
    bad = manager.async_save_distributed(2, {"policy": {"w": w}})
    with pytest.raises(CheckpointSaveError, match="injected"):
        bad.wait()
    assert manager.resolve("latest") == good.name
    monkeypatch.setattr(store, "put_parts", real)
    manager.async_save_distributed(3, {"policy": {"w": w}})
    manager.close()
    assert manager.load("latest")[2].step == 3


def test_unwaited_background_error_is_raised_by_the_next_async_save(manager, store, monkeypatch):
    monkeypatch.setattr(store, "put_parts", lambda *a, **k: (_ for _ in ()).throw(
        CheckpointSaveError("injected")))
    manager.async_save_distributed(1, {"policy": {"w": torch.zeros(4)}})
    with pytest.raises(CheckpointSaveError, match="injected"):
        manager.async_save_distributed(2, {"policy": {"w": torch.zeros(4)}})
    manager.close()  # the failed save was raised once; nothing is pending
    assert store.get_json("latest", default=None) is None

