"""The local asset cache is private to the user and never trusted: every use checks sizes, the
first use in a process re-hashes, and a damaged copy is refilled from the run store."""

import os
import stat

import pytest

from verl_core.store import RunStore
from verl_core.engine import assets as assets_mod
from verl_core.engine.assets import AssetCacheError, materialize_assets, publish_assets
from verl_core.assets import Assets


@pytest.fixture
def published(tmp_path, monkeypatch):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text('{"model_type": "llama"}')
    (model / "model.safetensors").write_bytes(bytes(range(256)) * 64)
    data = tmp_path / "train.parquet"
    data.write_bytes(b"PAR1 not really parquet PAR1")
    store = RunStore(str(tmp_path / "store"))
    index = publish_assets(store, Assets(str(model), [str(data)], [str(data)]))
    monkeypatch.setenv("VERL_ASSET_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(assets_mod, "_VERIFIED", set())  # a fresh process
    return store, index, (model / "model.safetensors").read_bytes()


def _weights(a: Assets) -> bytes:
    with open(os.path.join(a.model_path, "model.safetensors"), "rb") as f:
        return f.read()


def test_cache_is_private(published, tmp_path):
    store, index, _ = published
    materialize_assets(store, index)
    mode = stat.S_IMODE(os.stat(tmp_path / "cache").st_mode)
    assert mode == 0o700


def test_default_cache_is_per_user_not_the_shared_temp_folder(monkeypatch, tmp_path):
    monkeypatch.delenv("VERL_ASSET_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert assets_mod.cache_root() == str(tmp_path / "xdg" / "verl-flyte" / "assets")


def test_cache_owned_by_another_user_is_refused(published, tmp_path):
    store, index, _ = published
    other = tmp_path / "cache"
    other.mkdir()
    os.chown(other, 65534, 65534)  # nobody: the tests run as root, as CI does
    with pytest.raises(AssetCacheError, match="belongs to uid 65534.*VERL_ASSET_CACHE"):
        materialize_assets(store, index)


@pytest.mark.parametrize("damage", ["truncate", "same_size"])
def test_damaged_cache_is_refilled_from_the_store(published, damage, monkeypatch):
    store, index, weights = published
    a = materialize_assets(store, index)
    path = os.path.join(a.model_path, "model.safetensors")
    with open(path, "r+b") as f:  # what an unlucky (or hostile) neighbour could do
        if damage == "truncate":
            f.truncate(len(weights) // 2)  # caught by the size check, even in the same process
        else:
            f.write(b"\0" * 16)  # same size: caught by the re-hash of a new process
            monkeypatch.setattr(assets_mod, "_VERIFIED", set())
    assert _weights(materialize_assets(store, index)) == weights


def test_store_objects_are_verified_when_filling(published):
    from verl_core.errors import CorruptObjectError

    store, index, _ = published
    sha = index["model"]["model.safetensors"]
    with open(store.object_path(sha), "r+b") as f:
        f.write(b"\xff" * 8)
    with pytest.raises(CorruptObjectError, match="model/model.safetensors"):
        materialize_assets(store, index)
