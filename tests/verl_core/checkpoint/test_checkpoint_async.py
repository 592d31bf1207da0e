"""AsyncCheckpointer: snapshot semantics, background errors, previous checkpoint stays latest."""

from __future__ import annotations

import pytest
import torch

from verl_core.checkpoint import AsyncCheckpointer, CheckpointManager, StoreUnavailableError


def test_async_save_snapshots_before_returning(manager):
    w = torch.randn(256, 256)
    with AsyncCheckpointer(manager) as ac:
        ac.save(1, {"policy": {"w": w}}, {"m": [1]})
        expected = w.clone()
        w.add_(1.0)  # training continues and mutates the live tensor
        info = ac.wait()
        assert info.step == 1 and ac.last_blocking_s >= 0
        ac.save(2, {"policy": {"w": w}}, {"m": [2]})
    groups, meta, _ = manager.load(info.name)
    assert torch.equal(groups["policy"]["w"], expected) and meta == {"m": [1]}
    assert manager.load("latest")[2].step == 2  # close() waited for the last save


def test_background_error_is_reraised_and_previous_stays_latest(manager, store, monkeypatch):
    ac = AsyncCheckpointer(manager)
    ac.save(1, {"policy": {"w": torch.randn(64, 64)}})
    good = ac.wait()
    real = store.put_parts
    calls = {"n": 0}

    def flaky(parts, **kw):
        calls["n"] += 1
        if calls["n"] == 3:
            raise StoreUnavailableError("injected: storage went away mid-save")
        return real(parts, **kw)

    monkeypatch.setattr(store, "put_parts", flaky)
    ac.save(2, {"policy": {"w": torch.randn(512, 512)}})  # returns; fails in the background
    with pytest.raises(StoreUnavailableError, match="injected"):
        ac.wait()
    assert ac.wait() == good  # raised once only
    assert CheckpointManager(store).resolve("latest") == good.name
    assert CheckpointManager(store).load("auto")[2] == good

    monkeypatch.setattr(store, "put_parts", real)  # storage is back: the run continues
    ac.save(3, {"policy": {"w": torch.randn(512, 512)}})
    ac.save(4, {"policy": {"w": torch.randn(8, 8)}})  # waits for 3, then snapshots 4
    ac.close()
    assert manager.load("latest")[2].step == 4


def test_error_reraised_on_next_save(manager, store, monkeypatch):
    ac = AsyncCheckpointer(manager)
    monkeypatch.setattr(store, "put_parts",
                        lambda *a, **k: (_ for _ in ()).throw(StoreUnavailableError("down")))
    ac.save(1, {"policy": {"w": torch.randn(4, 4)}})
    with pytest.raises(StoreUnavailableError, match="down"):
        ac.save(2, {"policy": {"w": torch.randn(4, 4)}})
    ac.close(raise_errors=False)
    assert store.get_json("latest", default=None) is None
