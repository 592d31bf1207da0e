"""The single-writer run lease (verl_core/store/lease.py) on a local folder and on a real local
S3-compatible server (moto): a live holder refuses a second writer with a message naming it, a
SIGKILLed holder on the same host is taken over at once, one on another host only after its
expiry, a release lets the next writer in, and of racing contenders exactly one wins."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import replace

import pytest

from verl_core.store import RunStore
from verl_core.errors import PermanentError
from verl_core.store.lease import (LEASE_DOC, Holder, LeaseHeldError, LeaseLostError, RunLease,
                                   break_lease, read_lease)

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(
    __file__)))))
ISO = r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ"

# A real second process holding the leases of the stores given as (root, storage options) pairs
# (one process for both backends: importing verl_core takes ~4 s on a 2-core machine).
HOLDER = """
import json, sys, time
from verl_core.store import RunStore
from verl_core.store.lease import RunLease
for root, opts in json.loads(sys.argv[1]):
    RunLease(RunStore(root, opts), 30).acquire()
time.sleep(600)
"""


@pytest.fixture(params=["local", "s3"])
def open_store(request, tmp_path):
    """``open_store() -> RunStore``: a fresh store object on the same root each call (every
    contender has its own client, as separate launches would)."""
    if request.param == "local":
        root, opts = str(tmp_path / "run"), {}
    else:
        _, bucket, opts = request.getfixturevalue("moto_s3")
        root = f"s3://{bucket}/run"

    def make() -> RunStore:
        return RunStore(root, opts)

    return make


def _foreign(host: str, pid: int, ttl_s: float, *, owner="flyte:proj/dev/f1a2b3", process="",
             age_s: float = 0.0) -> Holder:
    """The doc a holder elsewhere would have written ``age_s`` seconds ago."""
    t = time.time() - age_s
    return Holder(owner=owner, host=host, pid=pid, process=process, since=t, renewed=t,
                  expires=t + ttl_s, ttl_s=ttl_s, token=uuid.uuid4().hex)


def _wait_for(cond, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = cond()
        if got:
            return got
        time.sleep(0.05)
    pytest.fail(f"timed out after {timeout_s}s waiting for {what}")


def test_live_holder_refuses_with_its_name_then_sigkill_frees_at_once(tmp_path, moto_s3):
    _, bucket, s3_opts = moto_s3
    roots = [(str(tmp_path / "run"), {}), (f"s3://{bucket}/run", s3_opts)]
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, json.dumps(roots)],
                            env={**os.environ, "PYTHONPATH": REPO}, stderr=subprocess.PIPE,
                            text=True)
    try:
        stores = [RunStore(root, opts) for root, opts in roots]

        def held():
            if proc.poll() is not None:
                pytest.fail(f"the holder exited: {proc.stderr.read()}")
            return all(read_lease(st) for st in stores)

        _wait_for(held, 60, "the subprocess to take both leases")
        for store in stores:
            holder = read_lease(store)
            assert (holder.host, holder.pid) == (socket.gethostname(), proc.pid)
            with pytest.raises(LeaseHeldError) as ei:
                RunLease(store, 30).acquire()
            msg = str(ei.value)
            assert f"{socket.gethostname()}:{proc.pid} (host {socket.gethostname()}, pid " \
                   f"{proc.pid}) since " in msg
            assert re.search(f"since {ISO}", msg) and re.search(f"wait until {ISO}", msg)
            assert f"python -m verl_core.checkpoint lease --break {store.uri}" in msg
            assert ei.value.holder == holder
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    # kill -9, re-run the same command on the same host: no wait for the 30 s expiry
    for root, opts in roots:
        t0 = time.monotonic()
        mine = RunLease(RunStore(root, opts), 30)
        got = mine.acquire()
        assert time.monotonic() - t0 < 5
        assert read_lease(mine.store).token == got.token and got.pid == os.getpid()
        mine.release()


def test_holder_on_another_host_is_refused_until_expiry_then_taken_over(open_store, caplog):
    store = open_store()
    lease = RunLease(store, 30)
    foreign = _foreign("node-7", 4242, 2.0)
    assert store.put_if(LEASE_DOC, foreign.to_json(), None)
    with pytest.raises(LeaseHeldError, match=r"flyte:proj/dev/f1a2b3 \(host node-7, pid 4242\)"):
        lease.acquire()
    time.sleep(max(0.0, foreign.expires - time.time()) + 0.05)
    lease.acquire()  # expired: taken over
    assert read_lease(store).owner == lease.owner
    assert "took over the run lease" in caplog.text and "expired at" in caplog.text
    lease.release()


def test_pid_reused_by_another_process_counts_as_gone(tmp_path):
    """Same host, same boot and pid namespace, a live pid that started at another time: the
    holder's process is gone (its pid was reused), so the lease is taken at once."""
    store = RunStore(str(tmp_path / "run"))
    boot = open("/proc/sys/kernel/random/boot_id").read().strip()
    ns = os.readlink("/proc/self/ns/pid")
    stale = _foreign(socket.gethostname(), os.getpid(), 600, owner="old-run",
                     process=f"{boot}/{ns}/1")  # start tick 1: not this process
    assert store.put_if(LEASE_DOC, stale.to_json(), None)
    RunLease(store, 30).acquire()
    # ... but the same pid with its true identity is alive and refuses
    store2 = RunStore(str(tmp_path / "run2"))
    live = RunLease(store2, 30, owner="live-run")
    live.acquire()
    with pytest.raises(LeaseHeldError, match="live-run"):
        RunLease(store2, 30).acquire()
    live.release()


def test_release_lets_the_next_writer_in(open_store):
    a, b = RunLease(open_store(), 30, owner="a"), RunLease(open_store(), 30, owner="b")
    a.acquire()
    with pytest.raises(LeaseHeldError, match="another writer holds"):
        b.acquire()
    a.release()
    assert read_lease(b.store).released
    assert b.acquire().owner == "b"
    b.release()


def test_renewal_keeps_a_live_lease_and_a_taken_one_is_lost(tmp_path):
    store = RunStore(str(tmp_path / "run"))
    a = RunLease(store, 0.6, owner="a")
    a.acquire()
    time.sleep(1.5)  # > 2 ttl: only the background renewals keep it
    with pytest.raises(LeaseHeldError):
        RunLease(store, 0.6, owner="b").acquire()
    assert break_lease(store).owner == "a"
    b = RunLease(store, 30, owner="b")
    b.acquire()
    _wait_for(lambda: a.lost, 5, "a's renewal to notice the takeover")
    assert not a.held
    with pytest.raises(LeaseLostError, match=r"lost the writer lease .* b \(host"):
        a.acquire()
    b.release()


def test_hold_only_reads_a_fresh_lease_and_takes_the_acquire_path_on_any_change(open_store):
    """A phase start (``hold``) rewrites nothing while the doc is still our last write and that
    write is younger than ttl/3; a break, a takeover or an older renewal go through acquire."""
    store = open_store()
    a = RunLease(store, 30, owner="a")
    first = a.acquire()
    assert a.hold() == first and read_lease(store) == first  # fresh and unchanged: read only
    a._held = replace(a._held, renewed=first.renewed - 11.0)  # renewed 11 s > 30/3 s ago
    renewed = a.hold()
    assert renewed.token != first.token and read_lease(store) == renewed
    break_lease(store)  # the doc changed: acquire's rules (a released lease is taken again)
    again = a.hold()
    assert again.token != renewed.token and read_lease(store) == again
    break_lease(store)
    b = RunLease(store, 30, owner="b")
    b.acquire()  # taken over by another writer: the fresh renewal does not hide it
    with pytest.raises(LeaseLostError, match=r"lost the writer lease .* b \(host"):
        a.hold()
    b.release()


def _race(stores: list[RunStore], owners: list[str]) -> list[str]:
    """All contenders call acquire() at once; returns the owners that got the lease."""
    won: list[str] = []
    barrier = threading.Barrier(len(stores))

    def go(st, owner):
        lease = RunLease(st, 30, owner=owner)
        barrier.wait()
        try:
            lease.acquire()
        except LeaseHeldError:
            return
        lease._stop.set()  # no renewals after the test
        won.append(owner)

    threads = [threading.Thread(target=go, args=a) for a in zip(stores, owners)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return won


@pytest.fixture(params=["local", "s3"])
def race_store(request, tmp_path):
    if request.param == "local":
        root, opts = str(tmp_path / "run"), {}
    else:  # a server that decides conditional writes atomically, as S3 does (conftest_s3)
        _, bucket, opts = request.getfixturevalue("moto_s3_serial")
        root = f"s3://{bucket}/run"
    return lambda: RunStore(root, opts)


def test_racing_contenders_exactly_one_wins(race_store):
    n = 6
    clients = [race_store(), race_store()]  # opening an S3 client costs ~1 s here: share two
    stores = [clients[i % 2] for i in range(n)]
    # 1. raw compare-and-swap: create, then replace the same version, all at once
    for rnd in range(4):
        cur = stores[0].get_versioned("doc")
        expected = cur[1] if cur else None
        wins: list[int] = []
        barrier = threading.Barrier(n)

        def put(i):
            barrier.wait()
            if stores[i].put_if("doc", f"{rnd}-{i}".encode(), expected) is not None:
                wins.append(i)

        threads = [threading.Thread(target=put, args=(i,)) for i in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert len(wins) == 1, (rnd, wins)
        assert stores[0].get_versioned("doc")[0] == f"{rnd}-{wins[0]}".encode()
    # 2. the lease: a fresh store, then a takeover of an expired holder
    won = _race(stores, [f"c{i}" for i in range(n)])
    assert len(won) == 1 and read_lease(stores[0]).owner == won[0]
    last = read_lease(stores[0])
    expired = Holder(**{**last.__dict__, "expires": time.time() - 1, "host": "elsewhere"})
    assert stores[0].put_if(LEASE_DOC, expired.to_json(), stores[0].get_versioned(LEASE_DOC)[1])
    won = _race(stores, [f"d{i}" for i in range(n)])
    assert len(won) == 1 and read_lease(stores[0]).owner == won[0]


def test_local_generations_are_pruned_and_a_stale_writer_withdraws(tmp_path):
    store = RunStore(str(tmp_path / "run"))
    v = store.put_if("doc", b"0", None)
    stale = v
    for i in range(1, 80):
        v = store.put_if("doc", str(i).encode(), v)
    assert len(os.listdir(tmp_path / "run" / "doc.cas")) == RunStore._CAS_KEEP
    # generation 2 was pruned; a writer that read generation 1 long ago re-creates it: refused
    assert store.put_if("doc", b"stale", stale) is None
    assert store.get_versioned("doc") == (b"79", v)
    assert store.put_if("doc", b"x", "5") is None  # not the current version: refused


def test_cli_shows_and_breaks_the_lease(tmp_path, capsys):
    from verl_core.checkpoint.__main__ import main

    store = RunStore(str(tmp_path / "run"))
    store.put_if(LEASE_DOC, _foreign("node-3", 77, 600).to_json(), None)
    assert main(["lease", store.uri]) == 0
    assert re.search(f"held by flyte:proj/dev/f1a2b3 \\(host node-3, pid 77\\).*expires {ISO}",
                     capsys.readouterr().out)
    assert main(["lease", "--break", store.uri]) == 0
    assert "it was held by flyte:proj/dev/f1a2b3" in capsys.readouterr().out
    RunLease(store, 30, owner="next").acquire()  # at once, no 600 s wait
    assert main(["lease", str(tmp_path / "not-a-store")]) == 2
    # a damaged lease doc names the fix, and --break is that fix
    bad = RunStore(str(tmp_path / "bad"))
    bad.put_if(LEASE_DOC, b"{not json", None)
    with pytest.raises(PermanentError, match=f"lease --break {re.escape(bad.uri)}"):
        RunLease(bad, 30).acquire()
    assert main(["lease", "--break", bad.uri]) == 0
    RunLease(bad, 30, owner="next").acquire()


# ---------------------------------------------------------------------- the run's integration
def _spec(store: RunStore, ttl_s: float):
    from verl_core.config import preset, with_overrides
    from verl_core.types import RunSpec

    cfg = with_overrides(preset("grpo"), {"guard.lease_ttl_s": ttl_s})
    return RunSpec(store=store.uri, incarnation=store.incarnation_id,
                   config=cfg, trajectory_hash=cfg.trajectory_hash(),
                   assets_json="{}", start_step=0, total_steps=cfg.total_steps)


def test_prepare_run_refuses_a_second_launch_before_any_work(tmp_path):
    from verl_core.config import preset
    from verl_core import writer
    from verl_core.prepare import prepare_run

    store = RunStore(str(tmp_path / "runs" / "r"))
    store.put_if(LEASE_DOC, _foreign("node-9", 99, 600).to_json(), None)
    t0 = time.monotonic()
    with pytest.raises(LeaseHeldError, match="node-9"):
        prepare_run(preset("grpo"), str(tmp_path / "runs"), "r", log_fn=lambda *_: None)
    assert time.monotonic() - t0 < 5  # no dataset, no warm start
    assert sorted(os.listdir(store.root)) == ["lease.cas", "store.json"]  # nothing published


def test_hold_lease_renews_refuses_others_releases_and_runs_the_second_writer_drill(tmp_path):
    from verl_core import writer
    from verl_core.prepare import prepare_run
    from verl_core.guard import faults

    store = RunStore(str(tmp_path / "r"))
    spec = _spec(store, 30.0)
    writer.hold_lease(spec)  # the first phase (or a new pod) takes it ...
    first = read_lease(store)
    writer.hold_lease(spec)  # ... a later phase within ttl/3 of the last renewal checks it ...
    assert read_lease(store) == first
    lease = writer.LEASES.get(store.uri, 30.0)
    lease._held = replace(lease._held, renewed=lease._held.renewed - 10.0)  # 10 s > ttl/3 ago
    writer.hold_lease(spec)  # ... and renews it when the last renewal is older
    again = read_lease(store)
    assert again.owner == first.owner and again.since == first.since
    assert again.renewed >= first.renewed and again.token != first.token
    faults._second_writer({})  # the VERL_FAULTS drill: an intruder is refused, no raise
    with pytest.raises(LeaseHeldError):
        RunLease(store, 30, owner="another-launch").acquire()
    writer.LEASES.release_mine()  # what atexit does when this process ends, even failed
    assert read_lease(store).released
    writer.hold_lease(spec)
    assert not read_lease(store).released
    writer.release_lease(spec)  # what finalize does
    assert read_lease(store).released
    # guard.lease_ttl_s=0: no lease at all
    bare = RunStore(str(tmp_path / "bare"))
    writer.hold_lease(_spec(bare, 0.0))
    assert read_lease(bare) is None


def test_lease_ttl_is_validated_and_leaves_the_trajectory_alone():
    from verl_core.config import ConfigError, preset, with_overrides

    cfg = preset("grpo")
    assert cfg.guard.lease_ttl_s == 60.0
    assert with_overrides(cfg, {"guard.lease_ttl_s": 5}).trajectory_hash() == \
        cfg.trajectory_hash()
    with pytest.raises(ConfigError, match="guard.lease_ttl_s=-1.0: must be >= 0"):
        with_overrides(cfg, {"guard.lease_ttl_s": -1})


# ---------------------------------------------------------------------- fencing (issue 21.3)
def test_generation_is_kept_by_renewals_and_bumped_whenever_the_lease_changes_hands(open_store):
    store = open_store()
    a, b = RunLease(store, 30, owner="a"), RunLease(open_store(), 30, owner="b")
    g1 = a.acquire().generation
    assert g1 == 1  # a fresh store: the first hold
    assert a.renew().generation == g1 and a.acquire().generation == g1  # renewals keep it
    fence = a.fence()
    assert (fence.store, fence.owner, fence.generation) == (store.uri, "a", g1)
    fence.check(store, "a commit")  # held: passes
    a.release()  # a release keeps the number; the next hold is a new generation
    assert read_lease(store).generation == g1
    assert b.acquire().generation == g1 + 1
    assert break_lease(store).owner == "b" and read_lease(store).generation == g1 + 2
    assert a.acquire().generation == g1 + 3  # "a" again, but a new launch of it
    with pytest.raises(LeaseLostError):  # the old fence names generation 1 of "a"
        fence.check(store, "a commit")
    a.release()


def test_a_stale_fence_is_refused_for_every_reason_a_launch_loses_the_run(tmp_path):
    """Taken over, released, broken, expired, launcher process gone, doc deleted: each refuses
    with FencedError naming the launch, its generation and why."""
    from verl_core.store.lease import FencedError

    store = RunStore(str(tmp_path / "run"))
    a = RunLease(store, 30, owner="a")
    a.acquire()
    fence = a.fence()

    def refused(pattern: str) -> None:
        with pytest.raises(FencedError, match=pattern) as ei:
            fence.check(store, "moving latest to checkpoint X")
        msg = str(ei.value)
        assert msg.startswith("moving latest to checkpoint X refused: this process writes for "
                              f"the launch a (lease generation {fence.generation}) of {store.uri}")
        assert "Nothing was committed" in msg

    # the launcher's process is gone (same host): a pid that exited, as after kill -9
    dead = subprocess.Popen(["true"])
    dead.wait()
    cur, version = read_lease(store), store.get_versioned(LEASE_DOC)[1]
    boot, ns, _ = cur.process.split("/", 2)
    assert store.put_if(LEASE_DOC, replace(cur, pid=dead.pid, process=f"{boot}/{ns}/1").to_json(),
                        version)
    refused(f"the launcher process {dead.pid} on {re.escape(socket.gethostname())} is gone")
    # expired: nobody renewed it for ttl_s (the launcher elsewhere stopped)
    cur, version = read_lease(store), store.get_versioned(LEASE_DOC)[1]
    gone = replace(cur, pid=os.getpid(), process=a._held.process, expires=time.time() - 1)
    assert store.put_if(LEASE_DOC, gone.to_json(), version)
    refused(f"it expired at {ISO}: the launcher stopped renewing it")
    a.acquire()  # renewed by its own launcher: the same generation, accepted again
    assert a.fence() == fence
    fence.check(store, "a commit")
    a.release()
    refused("the launch released it")
    b = RunLease(store, 30, owner="b")
    b.acquire()
    refused(r"b \(host .*, last renewed .* holds it now \(generation 2\)")
    b.release()
    import shutil

    shutil.rmtree(store.root + "/lease.cas")
    refused("the store has no lease doc")
