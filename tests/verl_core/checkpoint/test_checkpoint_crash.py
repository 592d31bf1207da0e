"""SIGKILL during a checkpoint write: a fresh process resumes from the newest valid checkpoint."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from verl_core.checkpoint import CheckpointManager, RunStore

CHILD = textwrap.dedent("""
    import sys, torch
    from verl_core.checkpoint import CheckpointManager, RunStore

    def state(step):  # 64 MiB, different every step, reproducible from the step number
        g = torch.Generator().manual_seed(step)
        return {"policy": {"w": torch.randn(16384, 1024, generator=g)}}

    m = CheckpointManager(RunStore(sys.argv[1]), chunk_bytes=4 << 20)
    if sys.argv[2] == "async":  # the write runs in a background thread while "training" goes on
        from verl_core.checkpoint import AsyncCheckpointer

        ac = AsyncCheckpointer(m)
        ac.save(1, state(1), {"step": 1})
        ac.wait()
        print("committed", 1, flush=True)
        ac.save(2, state(2), {"step": 2})
        while True:
            torch.randn(256, 256) @ torch.randn(256, 256)
    step = 1
    while True:
        m.save(step, state(step), {"step": step})
        print("committed", step, flush=True)
        step += 1
""")


def _objects(root):
    base = os.path.join(root, "objects")
    if not os.path.isdir(base):
        return 0
    return sum(len([n for n in os.listdir(os.path.join(base, d)) if not n.startswith(".")])
               for d in os.listdir(base))


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_sigkill_mid_save_resumes_from_previous(tmp_path, mode):
    root = str(tmp_path / "store")
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    env = {**os.environ, "PYTHONPATH": os.getcwd() + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.Popen([sys.executable, str(script), root, mode], stdout=subprocess.PIPE,
                            env=env, text=True)
    try:
        assert proc.stdout.readline().split() == ["committed", "1"]
        after_first = 16 + 1  # 16 chunks + the meta object
        deadline = time.monotonic() + 60
        while _objects(root) <= after_first:  # wait for the first object of step 2
            assert time.monotonic() < deadline and proc.poll() is None
            time.sleep(0.001)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == -signal.SIGKILL

    store = RunStore(root)
    mgr = CheckpointManager(store, gc_grace_s=0.0, inflight_timeout_s=0.0)
    assert mgr.resolve("latest").startswith("000000000001-")
    assert [i.step for i in mgr.list_checkpoints()] == [1]
    assert _objects(root) > after_first  # the killed save left unreferenced objects behind
    groups, meta, info = mgr.load("auto")
    g = torch.Generator().manual_seed(1)
    assert info.step == 1 and meta == {"step": 1}
    assert torch.equal(groups["policy"]["w"], torch.randn(16384, 1024, generator=g))
    assert mgr.verify(info.name) == []

    # the run continues: the next save commits and garbage collection removes the leftovers
    mgr.save(2, {"policy": {"w": torch.zeros(4, 4)}}, {"step": 2})
    mgr.gc()
    assert _objects(root) == after_first + 2  # step 1 + step 2's chunk and meta
    assert store.list_json("inflight") == []
