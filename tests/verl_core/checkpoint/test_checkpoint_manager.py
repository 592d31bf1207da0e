"""CheckpointManager: manifests, verified load + fallback, incremental saves, retention, safety."""

from __future__ import annotations

import json
import logging
import os
import pickle
import time

import pytest
import torch

import verl_core
from verl_core.checkpoint import (
    CheckpointManager,
    CheckpointNotFoundError,
    CheckpointSaveError,
    CorruptObjectError,
    NoValidCheckpointError,
    UnsafeManifestError,
    capture_rng_state,
)
from verl_core.store import canonical_json, sha256_hex

LOGGER = "verl_core.checkpoint.manager"


def _model(seed=0, layers=4, width=64):
    torch.manual_seed(seed)
    return torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])


def _trained(seed=0):
    model = _model(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, 64)).sum().backward()
    opt.step()
    return model, opt


def _groups(model, opt):
    return {"policy": model.state_dict(), "optimizer": opt.state_dict(),
            "rng": capture_rng_state()}


def _bump(model, by=1.0):
    with torch.no_grad():
        for p in model.parameters():
            p.add_(by)


def test_roundtrip_is_bit_exact(manager):
    model, opt = _trained()
    meta = {"hf_config": {"a": 1}, "sampler": {"epoch": 2, "pos": 17}, "metrics": [{"r": 0.5}],
            "guard": {"nan_count": 0, "last_loss": float("nan")}}
    saved = _groups(model, opt)
    info = manager.save(5, saved, meta, config_hash="cfg123")
    groups, meta2, info2 = manager.load("latest")
    assert info2 == info and info.step == 5
    for k, v in model.state_dict().items():
        assert torch.equal(groups["policy"][k], v)
    sd, sd2 = opt.state_dict(), groups["optimizer"]
    assert sd2["param_groups"] == sd["param_groups"]
    for pid, st in sd["state"].items():
        for k, v in st.items():
            assert torch.equal(sd2["state"][pid][k], v), (pid, k)
    assert torch.equal(groups["rng"]["torch"], saved["rng"]["torch"])
    assert groups["rng"]["python"] == saved["rng"]["python"]
    assert meta2["sampler"] == {"epoch": 2, "pos": 17} and meta2["metrics"] == [{"r": 0.5}]
    assert meta2["guard"]["last_loss"] != meta2["guard"]["last_loss"]  # NaN survives


def test_manifest_fields_latest_and_log(manager, store):
    model, opt = _trained()
    first = manager.save(1, _groups(model, opt), {}, config_hash="h1")
    _bump(model)
    second = manager.save(2, _groups(model, opt), {}, config_hash="h1")
    info, m = manager.read_manifest("latest")
    assert info == second and m["parent"] == first.name
    assert m["step"] == 2 and m["config_hash"] == "h1"
    assert m["package_version"] == verl_core.__version__
    assert m["incarnation_id"] == store.incarnation_id and m["created"] > 0
    assert m["format"] == "verl-checkpoint/2" and m["world_size"] == 1
    assert m["hash"] == manager.hash_algo
    w = m["groups"]["policy"]["tensors"]["0.weight"]
    assert w["dtype"] == "float32" and w["shape"] == [64, 64]
    for c in w["chunks"]:
        assert m["objects"][c["sha"]] == c["size"] == os.path.getsize(store.object_path(c["sha"]))
    assert store.get_json("latest") == {"name": second.name, "step": 2, "sha": second.sha}
    assert [r["name"] for r in store.read_log("checkpoints")] == [first.name, second.name]
    assert sha256_hex([open(f"{store.root}/checkpoints/{second.name}.json", "rb").read()]) == \
        second.sha


def _unique_chunk(manager, older, newer, group="policy"):
    _, m_old = manager.read_manifest(older.name)
    _, m_new = manager.read_manifest(newer.name)
    for e in m_new["groups"][group]["tensors"].values():
        for c in e["chunks"]:
            if c["sha"] not in m_old["objects"]:
                return c["sha"]
    raise AssertionError("no unique chunk")


def _flip(path):
    data = bytearray(open(path, "rb").read())
    data[len(data) // 2] ^= 0x01
    open(path, "wb").write(bytes(data))


def _truncate(path):
    data = open(path, "rb").read()
    open(path, "wb").write(data[: len(data) - 7])


@pytest.mark.parametrize("damage", ["flip", "truncate", "delete"])
def test_damaged_object_is_named_and_auto_falls_back(manager, store, caplog, damage):
    model, opt = _trained()
    good = manager.save(1, _groups(model, opt), {"v": 1})
    _bump(model)
    bad = manager.save(2, _groups(model, opt), {"v": 2})
    sha = _unique_chunk(manager, good, bad)
    path = store.object_path(sha)
    {"flip": _flip, "truncate": _truncate, "delete": os.unlink}[damage](path)

    with pytest.raises(CorruptObjectError, match=sha):
        manager.load(bad.name)
    problems = manager.verify(bad.name)
    assert len(problems) == 1 and sha in problems[0] and "group 'policy'" in problems[0]
    assert manager.verify(good.name) == []

    with caplog.at_level(logging.WARNING, logger=LOGGER):
        groups, meta, info = CheckpointManager(store).load("auto")
    assert info == good and meta == {"v": 1}
    rejected = [r.getMessage() for r in caplog.records if "rejected" in r.getMessage()]
    assert rejected and bad.name in rejected[0] and sha in rejected[0]


@pytest.mark.parametrize("damage", ["missing", "flipped"])
def test_damaged_or_missing_manifest_falls_back(manager, store, caplog, damage):
    model, opt = _trained()
    good = manager.save(1, _groups(model, opt), {})
    bad = manager.save(2, _groups(model, opt), {})
    path = f"{store.root}/checkpoints/{bad.name}.json"
    os.unlink(path) if damage == "missing" else _flip(path)
    with pytest.raises((CorruptObjectError, CheckpointNotFoundError), match=bad.name):
        manager.load("latest")
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        _, _, info = CheckpointManager(store).load("auto")
    assert info == good
    assert any(bad.name in r.getMessage() for r in caplog.records)


def test_no_valid_checkpoint_and_empty_store(manager, store):
    with pytest.raises(CheckpointNotFoundError):
        manager.load("auto")
    assert manager.resume("auto") is None and manager.resume("none") is None
    model, opt = _trained()
    only = manager.save(1, _groups(model, opt), {})
    for sha in list(manager.read_manifest(only.name)[1]["objects"])[:3]:
        os.unlink(store.object_path(sha))
    with pytest.raises(NoValidCheckpointError, match=only.name):
        manager.load("auto")


def test_incremental_save_writes_only_changed_chunks(manager, store):
    model = _model(layers=4, width=128)  # 4 x 64 KiB weights = 4 chunks each at 64 KiB
    policy_bytes = sum(v.numel() * 4 for v in model.state_dict().values())
    store.reset_stats()
    manager.save(1, {"policy": model.state_dict()}, {})
    first = store.reset_stats()
    assert first.bytes_written >= policy_bytes

    manager.save(2, {"policy": model.state_dict()}, {})  # nothing changed
    unchanged = store.reset_stats()
    assert unchanged.bytes_written < 1000  # only the manifest-side meta object (if any)

    with torch.no_grad():  # train only the second half of the layers
        for layer in list(model)[2:]:
            layer.weight.mul_(1.01)
            layer.bias.add_(0.01)
    manager.save(3, {"policy": model.state_dict()}, {})
    half = store.reset_stats()
    changed = sum(p.numel() * 4 for layer in list(model)[2:] for p in layer.parameters())
    assert changed <= half.bytes_written <= changed * 1.05 + 4096
    assert half.bytes_skipped >= policy_bytes - changed


def test_retention_keep_last_keep_every_and_gc(store):
    manager = CheckpointManager(store, keep_last=2, keep_every=3, gc_grace_s=0.0)
    model, opt = _trained()
    infos = {}
    for step in range(1, 8):
        _bump(model, 0.5)
        infos[step] = manager.save(step, _groups(model, opt), {"step": step})
    kept = [i.step for i in manager.list_checkpoints()]
    assert kept == [3, 6, 7]
    live = set()
    for step in kept:
        live |= set(manager.read_manifest(infos[step].name)[1]["objects"])
        assert manager.verify(infos[step].name) == []
    on_disk = {sha for sha, _, _ in store.iter_objects()}
    assert on_disk == live  # every unreferenced object was collected, nothing needed was
    with pytest.raises(CheckpointNotFoundError):
        manager.load(infos[5].name)
    assert manager.load(3)[2].step == 3


def test_gc_never_touches_inflight_saves(store):
    manager = CheckpointManager(store, gc_grace_s=0.0)
    orphan = store.put_bytes(b"written by a save in another process")
    store.put_json("inflight/other", {"time": time.time(), "step": 9})
    assert manager.gc()["deleted"] == 0 and store.has_object(orphan)
    store.put_json("inflight/other", {"time": time.time() - 10 * 3600, "step": 9})  # dead writer
    assert manager.gc()["deleted"] == 1 and not store.has_object(orphan)
    assert store.list_json("inflight") == []


def _write_manifest(store, manifest) -> str:
    raw = canonical_json(manifest)
    name = f"{manifest['step']:012d}-{sha256_hex([raw])}"
    with open(f"{store.root}/checkpoints/{name}.json", "wb") as f:
        f.write(raw)
    return name


def test_manifest_with_path_traversal_is_refused(manager, store, tmp_path):
    model, opt = _trained()
    good = manager.save(1, _groups(model, opt), {})
    _, m = manager.read_manifest(good.name)
    secret = tmp_path / "secret"
    secret.write_bytes(b"outside the store")
    evil = json.loads(json.dumps(m))
    evil["step"] = 2
    entry = evil["groups"]["policy"]["tensors"]["0.weight"]
    traversal = "../../../" + str(secret).lstrip("/")
    entry["chunks"][0]["sha"] = traversal
    evil["objects"][traversal] = entry["chunks"][0]["size"]
    name = _write_manifest(store, evil)
    store.put_json("latest", {"name": name, "step": 2, "sha": name.split("-")[1]})

    with pytest.raises(UnsafeManifestError, match="not a 64-character"):
        manager.load(name)
    assert manager.verify(name) and "64-character" in manager.verify(name)[0]
    assert manager.load("auto")[2] == good  # skipped, falls back
    for ref in ("../../etc/passwd.json", "/etc/checkpoints/x.json", "checkpoints/../../x"):
        with pytest.raises((UnsafeManifestError, CheckpointNotFoundError)):
            manager.load(ref)
    store.put_json("latest", {"name": "../../etc/passwd", "step": 2, "sha": "x"})
    assert manager.load("auto")[2] == good


class _Payload:
    """Unpickling this creates a file: proof that code ran."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_pickle_payload_in_optimizer_is_refused_and_never_runs(manager, store, tmp_path,
                                                               monkeypatch):
    marker = tmp_path / "pwned"
    monkeypatch.setattr(pickle, "loads", lambda *a, **k: pytest.fail("pickle.loads called"))
    monkeypatch.setattr(torch, "load", lambda *a, **k: pytest.fail("torch.load called"))
    model, opt = _trained()
    good = manager.save(1, _groups(model, opt), {})
    _, m = manager.read_manifest(good.name)

    payload = pickle.dumps(_Payload(str(marker)))
    for blob in (payload, b"PK\x03\x04" + payload):  # raw pickle, zip-looking (torch.save-like)
        sha = store.put_bytes(blob, algo=m["hash"])  # a *valid* object: its hash matches
        evil = json.loads(json.dumps(m))
        evil["step"] = 2
        opt_tensors = evil["groups"]["optimizer"]["tensors"]
        tname = next(iter(opt_tensors))
        opt_tensors[tname]["chunks"] = [{"sha": sha, "size": len(blob),
                                         "rows": [0, opt_tensors[tname]["shape"][0]
                                                  if opt_tensors[tname]["shape"] else 1]}]
        evil["objects"][sha] = len(blob)
        name = _write_manifest(store, evil)
        with pytest.raises(CorruptObjectError, match=f"{sha}.*refusing to interpret"):
            manager.load(name)
        assert manager.verify(name)
        assert not marker.exists()
    assert manager.load("auto")[2].step in (1, 2)
    assert not marker.exists()


def test_shared_reference_group_is_stored_once(manager, store):
    ref_model = _model(seed=1)
    model, opt = _trained()
    manager.save(1, {"reference": ref_model.state_dict(), **_groups(model, opt)}, {})
    store.reset_stats()
    manager.save(2, _groups(model, opt), {})  # reference not passed again
    assert store.stats.objects_written <= 2  # meta + rng (policy/opt unchanged)
    groups, _, _ = manager.load("latest")
    for k, v in ref_model.state_dict().items():
        assert torch.equal(groups["reference"][k], v)


def test_damaged_shared_object_is_quarantined_and_rewritten(manager, store):
    # every checkpoint links the one stored reference: damage it and all of them fail; the load
    # moves the damaged object aside, so the next save writes it again instead of skipping it
    ref_model = _model(seed=1)
    model, opt = _trained()
    manager.save(1, {"reference": ref_model.state_dict(), **_groups(model, opt)}, {})
    manager.save(2, _groups(model, opt), {})
    _, m = manager.read_manifest("latest")
    sha = m["groups"]["reference"]["tensors"]["0.weight"]["chunks"][0]["sha"]
    _flip(store.object_path(sha))
    with pytest.raises(NoValidCheckpointError, match=sha):
        manager.load("auto")
    assert not store.has_object(sha)
    quarantined = os.listdir(f"{store.root}/quarantine")
    assert len(quarantined) == 1 and quarantined[0].startswith(sha)
    store.reset_stats()
    info = manager.save(3, {"reference": ref_model.state_dict(), **_groups(model, opt)}, {})
    assert store.has_object(sha) and store.stats.objects_written >= 1
    groups, _, got = manager.load("auto")
    assert got == info
    assert all(torch.equal(groups["reference"][k], v) for k, v in ref_model.state_dict().items())


def test_verify_repair_quarantines_only_damaged_objects(manager, store):
    model, opt = _trained()
    info = manager.save(1, _groups(model, opt), {})
    _, m = manager.read_manifest(info.name)
    shas = sorted({c["sha"] for e in m["groups"]["policy"]["tensors"].values()
                   for c in e["chunks"]})
    _flip(store.object_path(shas[0]))
    assert len(manager.verify(info.name)) == 1 and store.has_object(shas[0])  # report only
    problems = manager.verify(info.name, repair=True)
    assert len(problems) == 1 and "quarantine" in problems[0]
    assert not store.has_object(shas[0]) and all(store.has_object(s) for s in shas[1:])
    assert not store.quarantine_object(shas[1], algo=m["hash"])  # an intact one is never moved


def test_refs_resolve(manager, store):
    model, opt = _trained()
    a = manager.save(4, _groups(model, opt), {})
    _bump(model)
    b = manager.save(8, _groups(model, opt), {})
    assert manager.resolve("latest") == b.name
    assert manager.resolve(4) == a.name and manager.resolve("4") == a.name
    # 12+ characters: a shorter all-digit prefix (~1% of shas at 10) would be read as a step
    assert manager.resolve(a.sha[:12]) == a.name
    assert manager.resolve(f"checkpoints/{a.name}") == a.name
    assert manager.resolve(a.uri) == a.name
    from verl_core.checkpoint import open_checkpoint

    m2, ref = open_checkpoint(a.uri)
    assert ref == a.name and m2.load(ref)[2] == a
    with pytest.raises(CheckpointNotFoundError):
        manager.resolve(5)


def test_unsupported_state_is_refused_before_commit(manager, store):
    model, opt = _trained()
    good = manager.save(1, _groups(model, opt), {})
    with pytest.raises(CheckpointSaveError, match="sampler"):
        manager.save(2, {**_groups(model, opt), "sampler": {"it": iter([1])}}, {})
    assert manager.resolve("latest") == good.name
    assert store.list_json("inflight") == []


def test_exact_resume_local(manager, resume_equivalence):
    resume_equivalence(manager)


def test_load_into_parameters_in_place(manager):
    model, opt = _trained()
    info = manager.save(1, {"policy": model.state_dict()}, {})
    other = _model(seed=9)
    params = dict(other.named_parameters())  # require grad: loaded in place all the same
    assert manager.load_into(info.name, "policy", params) == info
    for k, v in model.state_dict().items():
        assert torch.equal(other.state_dict()[k], v)
    assert all(p.requires_grad for p in other.parameters())


def test_retention_keeps_the_best_step_and_best_resolves_to_it(store):
    # checkpoint.keep_best: best.json names a step; retention and gc keep its checkpoint, and the
    # reference "best" resolves to it (what `python -m verl_core.checkpoint export <s> best` reads)
    from verl_core import layout
    from verl_core.errors import CheckpointNotFoundError

    manager = CheckpointManager(store, keep_last=1, gc_grace_s=0.0)
    with pytest.raises(CheckpointNotFoundError, match="no best checkpoint in .*checkpoint.keep_best"):
        manager.resolve("best")
    model, opt = _trained()
    infos = {}
    for step in range(1, 6):
        _bump(model, 0.5)
        if step == 3:
            store.put_json(layout.BEST_DOC, {"step": 2, "metric": "val/accuracy", "value": 0.5})
        infos[step] = manager.save(step, _groups(model, opt), {"step": step})
    assert [i.step for i in manager.list_checkpoints()] == [2, 5]
    assert manager.resolve("best") == infos[2].name and manager.verify(infos[2].name) == []
