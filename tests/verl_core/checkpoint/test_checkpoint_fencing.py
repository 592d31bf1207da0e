"""Fenced commits (issue 21.3): a checkpoint manager whose fence is the launcher's lease
generation commits no manifest and no ``latest`` once another launch holds the run, whether the
takeover happened before the save or while it was being written; the run's worker, fenced by its
launcher, writes no lineage record and no checkpoint once another launch took the run; an export
becomes visible only complete (renamed into place locally, ``config.json`` and the completion
marker last elsewhere) and only under the fence."""

from __future__ import annotations

import functools
import json
import os
import threading

import fsspec
import pytest
import torch

from verl_core.checkpoint import CheckpointManager, RunStore
from verl_core.checkpoint.hf_export import (EXPORT_MARKER, export_hf, publish_export,
                                            verify_export)
from verl_core.store.lease import FencedError, RunLease, break_lease


def _state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"policy": {"w": torch.randn(64, 64, generator=g), "b": torch.randn(64, generator=g)}}


def _objects(store: RunStore) -> set[str]:
    root = os.path.join(store.root, "objects")
    return {f for _, _, files in os.walk(root) for f in files}


def _steps(manager: CheckpointManager) -> list[int]:
    return sorted(i.step for i in manager.list_checkpoints())


@pytest.fixture
def fenced(store):
    """``(manager, launch_a, take_over)``: a manager fenced by launch "a"'s lease; ``take_over()``
    is a second launch "b" taking the run (the lease broken, as after ``kill -9`` of a, then
    acquired by b)."""
    a = RunLease(store, 30, owner="a")
    a.acquire()
    manager = CheckpointManager(store, gc_grace_s=0.0, chunk_bytes=16 << 10)
    manager.fence = functools.partial(a.fence().check, store)
    others = []

    def take_over():
        break_lease(store)
        b = RunLease(RunStore(store.uri), 30, owner="b")
        b.acquire()
        others.append(b)

    yield manager, a, take_over
    for lease in [a, *others]:
        lease.release()


def test_a_stale_generation_writes_nothing_and_commits_nothing(fenced, store):
    manager, _, take_over = fenced
    first = manager.save(1, _state(1), {})
    objects = _objects(store)
    take_over()
    with pytest.raises(FencedError, match=r"the checkpoint of step 2 refused: .* launch a "
                                          r"\(lease generation 1\) .* b \(host"):
        manager.save(2, _state(2), {})
    assert manager.resolve("latest") == first.name
    assert _steps(manager) == [1]
    assert _objects(store) == objects  # refused before the first object was written
    assert store.list_json("inflight") == []


@pytest.mark.parametrize("when", ["the manifest", "moving latest"])
def test_a_takeover_during_the_write_is_refused_at_the_commit(fenced, store, when):
    """The new launch takes the run while the old writer is mid-save (its objects written): the
    check right before the manifest, or right before ``latest``, refuses."""
    manager, _, take_over = fenced
    first = manager.save(1, _state(1), {})
    check = manager.fence

    def racing(what: str) -> None:
        if what.startswith(when):
            take_over()
        check(what)

    manager.fence = racing
    with pytest.raises(FencedError, match=f"^{when}"):
        manager.save(2, _state(2), {})
    assert manager.resolve("latest") == first.name
    assert _steps(manager) == ([1] if when == "the manifest" else [1, 2])


def test_an_async_save_commits_under_the_fence_it_started_with(fenced, store):
    """The fence is captured when the save starts: a fence handed over later (a new launch
    reusing the worker) does not adopt a save the old launch started."""
    manager, _, take_over = fenced
    first = manager.save(1, _state(1), {})
    check, entered, go = manager.fence, threading.Event(), threading.Event()

    def slow(what: str) -> None:
        if what.startswith("the manifest"):
            entered.set()
            go.wait(30)
        check(what)

    manager.fence = slow
    handle = manager.async_save_distributed(2, _state(2), {})
    assert entered.wait(30)
    take_over()
    manager.fence = None  # e.g. the new launch's own fence: not the one the save started under
    go.set()
    with pytest.raises(FencedError):
        handle.wait()
    manager.close()
    assert manager.resolve("latest") == first.name and _steps(manager) == [1]


def test_an_unfenced_manager_commits_as_before(manager):
    assert manager.fence is None
    info = manager.save(1, _state(1), {})
    assert manager.resolve("latest") == info.name


# ---------------------------------------------------------------------- exports
def _folder(tmp_path) -> str:
    d = tmp_path / "built"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (d / "model.safetensors").write_bytes(os.urandom(4096))
    (d / "tokenizer.json").write_text("{}")
    return str(d)


def _refuse(what: str) -> None:
    raise FencedError(f"{what} refused: test", None)


def test_local_export_appears_only_complete_and_only_under_the_fence(tmp_path):
    src, dest = _folder(tmp_path), tmp_path / "store" / "exports" / "tag"
    fs = fsspec.filesystem("file")
    with pytest.raises(FencedError, match=f"^the export {dest} refused"):
        publish_export(src, fs, str(dest), fence=_refuse)
    assert os.listdir(dest.parent) == []  # nothing visible, no temp left behind
    publish_export(src, fs, str(dest), fence=lambda what: None)
    assert sorted(os.listdir(dest)) == ["config.json", "model.safetensors", "tokenizer.json",
                                        EXPORT_MARKER]
    assert verify_export(str(dest), hashes=True) == []
    marker = json.loads((dest / EXPORT_MARKER).read_text())
    assert marker["files"]["model.safetensors"]["size"] == 4096
    # a folder left by a killed export (old code: config.json only) is not a complete export
    half = tmp_path / "half"
    half.mkdir()
    (half / "config.json").write_text("{}")
    assert "no verl_export.json" in verify_export(str(half))[0]
    # a re-export replaces the old one, and leftovers of a killed one are cleaned up
    (dest.parent / ".tag.tmp-dead0000").mkdir()
    (src_path := tmp_path / "built" / "model.safetensors").write_bytes(os.urandom(100))
    publish_export(src, fs, str(dest))
    assert sorted(os.listdir(dest.parent)) == ["tag"]
    assert verify_export(str(dest), hashes=True) == [] and src_path.stat().st_size == 100


def test_object_store_export_writes_config_and_marker_last_under_the_fence(tmp_path):
    """No rename on S3 (here fsspec's in-memory filesystem, also not local): refused at the
    fence, the folder has no config.json (not a model folder) and no marker."""
    src, uri = _folder(tmp_path), "memory://bucket/run/exports/tag"
    fs, path = fsspec.core.url_to_fs(uri)
    try:
        with pytest.raises(FencedError):
            publish_export(src, fs, path, fence=_refuse)
        names = sorted(p.rsplit("/", 1)[-1] for p in fs.ls(path, detail=False))
        assert names == ["model.safetensors", "tokenizer.json"]
        assert "no verl_export.json" in verify_export(uri)[0]
        publish_export(src, fs, path, fence=lambda what: None)
        assert verify_export(uri, hashes=True) == []
        fs.pipe_file(f"{path}/model.safetensors", b"short")
        assert verify_export(uri) == [f"{uri}: model.safetensors has 5 bytes, the marker says "
                                      "4096"]
    finally:
        fs.rm("/bucket", recursive=True)


def test_export_hf_carries_the_completion_marker(manager, tiny_llama, tmp_path):
    model = tiny_llama()
    manager.save(1, {"policy": model.state_dict()}, {"hf_config": model.config.to_dict()})
    out = tmp_path / "hf"
    export_hf(manager, "latest", str(out))
    assert verify_export(str(out), hashes=True) == []


# ---------------------------------------------------------------------- the run's worker
def test_a_worker_whose_launch_lost_the_run_writes_no_lineage_and_no_checkpoint(tmp_path,
                                                                              monkeypatch):
    """Another launch takes the run between two phases of this one (before this launcher's next
    lease check): the worker still runs the update it was asked for, but its commits check the
    lease doc itself and refuse."""
    from verl_core import phases
    from tests.presets import tiny_run
    from verl_core.engine.workers import RunWorkers
    from verl_core.engine.workers import WORKERS
    from verl_core import writer
    from verl_core.prepare import prepare_run

    monkeypatch.setenv("VERL_ASSET_CACHE", str(tmp_path / "assets"))
    cfg = tiny_run(**{
        "total_steps": 1, "model.warmup_sft_steps": 2, "data.synthetic_train_size": 32,
        "data.train_batch_size": 4, "rollout.n": 2, "checkpoint.async_save": False})
    spec = prepare_run(cfg, str(tmp_path / "store"), "r", log_fn=lambda *_: None)
    st = spec.open_store()
    other = RunLease(RunStore(st.uri), 30, owner="b")
    try:
        advantaged = phases.advantage(spec, phases.reward(spec, phases.rollout(
            spec, phases.StepState(step=0))))
        break_lease(st)
        other.acquire()  # a second launch of the run, after the first was presumed dead
        with pytest.raises(FencedError, match=r"^the lineage record of update 0 refused: .* "
                                              r"b \(host .* holds it now \(generation 3\)"):
            phases.update(spec, advantaged)
        assert st.list_json(f"lineage/{spec.trajectory_hash[:16]}") == []
        with pytest.raises(FencedError, match="^the checkpoint of step 0 refused"):
            RunWorkers(spec).checkpoint(0, True, True)  # forced, synchronous
        assert st.list_json("checkpoints") == [] and not st.has_json("latest")
    finally:
        other.release()
        WORKERS.release_all()
        writer.release_lease(spec)
