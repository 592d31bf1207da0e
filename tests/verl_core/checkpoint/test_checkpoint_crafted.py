"""Crafted manifests and resume references: whatever a manifest claims, load, verify and export
reject it the same way (no allocation sized by a lie, no decoding verify skips), and a
``resume_from_checkpoint`` that is neither a manifest nor a run store fails permanently, creating
nothing.

Manifests are crafted as JSON in a real store; their names carry their own sha256, so each one is
a well-formed checkpoint whose *content* lies."""

from __future__ import annotations

import json
import pickle

import pytest
import torch

from verl_core.checkpoint import (
    CheckpointManager,
    CorruptObjectError,
    PermanentError,
    RunStore,
    TransientError,
    UnsafeManifestError,
    export_hf,
    open_checkpoint,
)
from verl_core.checkpoint.__main__ import main as cli
from verl_core.store import canonical_json, sha256_hex


def _save_good(manager, step=1):
    """Small tensors packed together (``w``), one cut into objects of its own (``big``: two
    64 KiB chunks), a numpy array and a bf16 tensor in a nested group."""
    import numpy as np

    g = torch.Generator().manual_seed(step)
    policy = {"w": torch.randn(4, 4, generator=g), "big": torch.randn(32, 1024, generator=g)}
    sampler = {"perm": np.arange(6), "h": torch.zeros(4, dtype=torch.bfloat16)}
    return manager.save(step, {"policy": policy, "sampler": sampler},
                        {"hf_config": {"model_type": "x"}, "step": step})


def _forge(manager, edit, step=2, latest=True) -> str:
    """Copy the newest manifest, apply ``edit(manifest)``, write it as step ``step`` (name = its
    own sha256) and, with ``latest``, point ``latest.json`` at it. Returns its name."""
    store = manager.store
    _, m = manager.read_manifest("latest")
    m = json.loads(json.dumps(m))
    m["step"] = step
    edit(m)
    raw = canonical_json(m)
    name = f"{step:012d}-{sha256_hex([raw])}"
    store.put_json_raw(f"checkpoints/{name}", raw)
    if latest:
        store.put_json("latest", {"name": name, "step": step, "sha": name.split("-")[1]})
    return name


def _set_meta(m, sha, size):
    m["objects"].pop(m["meta"]["sha"])
    m["meta"] = {"sha": sha, "size": size}
    m["objects"][sha] = size


def _rejected_everywhere(manager, name, err, match):
    """load, verify and load("auto") agree: the forged checkpoint is refused, named, skipped."""
    with pytest.raises(err, match=match):
        manager.load(name)
    assert manager.verify(name)
    assert manager.verify(name, hashes=False), "a size-only verify must decode as much as load"
    _, _, info = CheckpointManager(manager.store).load("auto")
    assert info.step == 1  # fell back to the good checkpoint


# ------------------------------------------------------------------ 1. sizes the index lies about
def _absurd_shape(m):
    e = m["groups"]["policy"]["tensors"]["w"]
    e["shape"] = [1 << 24, 1 << 24]  # 2**48 float32: 1 PiB, in a chunk of a few hundred bytes
    e["chunks"][0]["rows"] = [0, 1 << 24]


def _wider_dtype(m):
    m["groups"]["policy"]["tensors"]["big"]["dtype"] = "float64"  # 2 x 128 KiB in 2 x 64 KiB


@pytest.mark.parametrize("edit", [_absurd_shape, _wider_dtype])
def test_index_claiming_more_data_than_its_objects_hold_is_refused(manager, tmp_path, edit):
    _save_good(manager)
    name = _forge(manager, edit)
    tensor = "'w'" if edit is _absurd_shape else "'big'"
    _rejected_everywhere(manager, name, UnsafeManifestError, rf"{name}.*{tensor}")
    assert name in manager.list_checkpoints()[-1].error
    with pytest.raises(UnsafeManifestError, match=rf"{name}.*{tensor}"):
        export_hf(manager, name, str(tmp_path / "hf"))
    assert not (tmp_path / "hf").exists()


def test_object_size_the_store_does_not_have_is_refused_before_allocating(manager, tmp_path):
    # a self-consistent lie: 2**36 rows of 4 KiB (256 TiB), the last ones in an object the
    # manifest says is that big; only the store knows better, and it is asked before allocating
    _save_good(manager)
    row = 1024 * 4

    def huge(m):
        e = m["groups"]["policy"]["tensors"]["big"]
        c = e["chunks"][1]  # rows 16:32, alone in its object
        header = c["size"] - 8 - 16 * row
        e["shape"][0] = c["rows"][1] = 1 << 36  # 2**36 rows of 4 KiB: 256 TiB
        del m["objects"][c["sha"]]
        c["size"] = 8 + header + ((1 << 36) - 16) * row
        m["objects"][c["sha"]] = c["size"]

    name = _forge(manager, huge)
    sha = manager.read_manifest(name)[1]["groups"]["policy"]["tensors"]["big"]["chunks"][1]["sha"]
    _rejected_everywhere(manager, name, CorruptObjectError, rf"{sha}.*manifest says")
    assert cli(["export", f"{manager.store.root}/checkpoints/{name}.json",
                str(tmp_path / "hf")]) == 2
    assert not (tmp_path / "hf").exists()


# ------------------------------------------------------------------ 2. verify decodes as load does
def _tree(bad):
    def edit(m):
        m["groups"]["sampler"]["tree"]["perm"] = bad
    return edit


@pytest.mark.parametrize("bad", [
    {"$np": "perm", "dtype": "object"},  # numpy object arrays would unpickle
    {"$np": "h", "dtype": "float32"},  # h is bf16, which numpy cannot hold
    {"$t": ["perm"]},  # not a name
    {"$t": "missing"},
    {"$dtype": "object"},
    {"$bytes": "not base64!"},
    {"$npscalar": "uint8", "v": 300},
    {"$npscalar": "float64", "v": [1, 2]},
    {"$pickle": "gASV"},
], ids=lambda b: json.dumps(b))
def test_state_tree_load_refuses_fails_verify_too(manager, bad):
    info = _save_good(manager)
    manager.load(info.name)  # the original decodes
    name = _forge(manager, _tree(bad))
    _rejected_everywhere(manager, name, CorruptObjectError, rf"{name}.*malformed state tree")


@pytest.mark.parametrize("blob", [
    pickle.dumps({"hf_config": {}}),  # a valid object (its hash matches), but not JSON
    b"[1, 2, 3]",  # JSON, not an object
    b'{"step": {"$pickle": "gASV"}}',  # JSON, not a meta tree
    b'{"step": 1',  # truncated JSON
], ids=["pickle", "list", "tag", "truncated"])
def test_meta_load_refuses_fails_verify_too(manager, blob):
    _save_good(manager)
    sha = manager.store.put_bytes(blob, algo=manager.hash_algo)  # its hash matches: a valid object
    name = _forge(manager, lambda m: _set_meta(m, sha, len(blob)))
    _rejected_everywhere(manager, name, CorruptObjectError, rf"{name} meta")


def test_meta_size_that_does_not_match_the_object_fails_load_and_verify(manager):
    _save_good(manager)

    def wrong_size(m):
        _set_meta(m, m["meta"]["sha"], m["meta"]["size"] + 1)

    name = _forge(manager, wrong_size)
    _rejected_everywhere(manager, name, CorruptObjectError, rf"{name} meta.*manifest says")


# ------------------------------------------------------------------ 3. resume references
def test_run_folder_resumes_from_its_newest_valid_checkpoint(manager, store):
    good = _save_good(manager, step=1)
    _forge(manager, _absurd_shape)  # latest, but invalid
    mgr, ref = open_checkpoint(store.root)
    assert ref == good.name  # resolved once, so verify, read_manifest and load name the same one
    assert mgr.verify(ref) == [] and mgr.read_manifest(ref)[0] == good
    assert mgr.load(ref, groups=["policy"])[2] == good
    assert open_checkpoint(f"file://{store.root}/")[1] == good.name


def test_manifest_path_names_that_checkpoint(manager, store):
    a = _save_good(manager, step=1)
    _save_good(manager, step=2)
    mgr, ref = open_checkpoint(a.uri)
    assert ref == a.name and mgr.load(ref)[2] == a


def _not_a_reference(tmp_path, store, kind) -> str:
    if kind == "missing":
        return str(tmp_path / "no" / "such" / "run")
    if kind == "file":
        (tmp_path / "notes.txt").write_text("hello")
        return str(tmp_path / "notes.txt")
    if kind == "store.json":
        return f"{store.root}/store.json"
    if kind == "plain folder":
        (tmp_path / "plain").mkdir()
        (tmp_path / "plain" / "model.safetensors").write_bytes(b"x")
        return str(tmp_path / "plain")
    if kind == "missing manifest":
        return f"{store.root}/checkpoints/{7:012d}-{'ab' * 32}.json"
    if kind == "manifest outside a store":
        (tmp_path / "x" / "checkpoints").mkdir(parents=True)
        p = tmp_path / "x" / "checkpoints" / f"{7:012d}-{'ab' * 32}.json"
        p.write_text("{}")
        return str(p)
    raise AssertionError(kind)


KINDS = ["missing", "file", "store.json", "plain folder", "missing manifest",
         "manifest outside a store"]


@pytest.mark.parametrize("kind", KINDS)
def test_anything_else_is_a_permanent_error_that_creates_nothing(manager, store, tmp_path, kind):
    _save_good(manager)
    path = _not_a_reference(tmp_path, store, kind)
    before = sorted(str(p) for p in tmp_path.rglob("*"))
    with pytest.raises(PermanentError, match="not a checkpoint manifest or run store") as e:
        open_checkpoint(path)
    assert not isinstance(e.value, TransientError)
    assert path in str(e.value) and "store.json" in str(e.value)  # says what to pass instead
    assert sorted(str(p) for p in tmp_path.rglob("*")) == before


@pytest.mark.parametrize("kind", ["missing", "file", "plain folder"])
def test_cli_export_of_a_bad_reference_names_it_and_creates_nothing(store, tmp_path, capsys,
                                                                    kind):
    path = _not_a_reference(tmp_path, store, kind)
    before = sorted(str(p) for p in tmp_path.rglob("*"))
    assert cli(["export", path, str(tmp_path / "hf")]) == 2
    assert "not a checkpoint manifest or run store" in capsys.readouterr().err
    assert sorted(str(p) for p in tmp_path.rglob("*")) == before


def test_prepare_takes_run_folders_and_refuses_what_load_refuses(manager, store, tmp_path):
    """``resume_step`` (prepare) accepts an explicit reference exactly when the worker's
    ``open_checkpoint`` + ``load`` would succeed with it."""
    from verl_core.config import preset
    from verl_core.prepare import resume_step

    good = _save_good(manager, step=1)
    bad_tree = _forge(manager, _tree({"$np": "perm", "dtype": "object"}), step=2)
    here = RunStore(str(tmp_path / "new-run"))

    def spec(ref):
        return preset("ppo", **{"checkpoint.resume_from_checkpoint": ref})

    assert resume_step(here, spec(store.root)) == good.step  # run folder: newest valid
    assert resume_step(here, spec(good.uri)) == good.step
    with pytest.raises(CorruptObjectError):
        manager.load(bad_tree)
    with pytest.raises(ValueError, match="malformed state tree"):
        resume_step(here, spec(f"{store.root}/checkpoints/{bad_tree}.json"))
    with pytest.raises(PermanentError, match="not a checkpoint manifest or run store"):
        resume_step(here, spec(str(tmp_path / "typo")))
    assert not (tmp_path / "typo").exists()
