import os
import subprocess
import sys
import time

import pytest

import verl_core
from verl_core.health import UnhealthyError

PROBE = [sys.executable, "-c", "import verl_core; verl_core.health_check()"]


@pytest.fixture(autouse=True)
def _no_probe_env(monkeypatch):
    for name in ("VERL_STORE", "VERL_HEARTBEAT_FILE", "VERL_HEARTBEAT_MAX_AGE_S"):
        monkeypatch.delenv(name, raising=False)


def _age(path, seconds):
    old = time.time() - seconds
    os.utime(path, (old, old))


def test_version_and_health_check():
    assert verl_core.__version__.count(".") == 2
    r = verl_core.health_check()
    assert r["ok"] and r["checks"]["torch"]["ok"] and r["version"] == verl_core.__version__
    assert set(r["checks"]) <= {"torch", "cuda"}  # nothing configured, nothing else checked


def test_store_probe_round_trips_and_failure_raises_with_the_report(tmp_path):
    assert verl_core.health_check(str(tmp_path / "store"))["checks"]["store"]["ok"]
    blocker = tmp_path / "file"
    blocker.write_text("x")  # a path under a regular file cannot be created
    r = verl_core.health_report(str(blocker / "store"))
    assert not r["ok"] and "unreachable" in r["checks"]["store"]["detail"]
    with pytest.raises(UnhealthyError, match="store: store .* unreachable") as e:
        verl_core.health_check(str(blocker / "store"))
    assert e.value.report["checks"]["store"] == r["checks"]["store"]


def test_heartbeat_fresh_stale_and_not_yet_written(tmp_path):
    hb = tmp_path / "hb"
    r = verl_core.health_check(heartbeat_file=str(hb), max_heartbeat_age_s=60)
    assert "not written yet" in r["checks"]["heartbeat"]["detail"]  # no phase started: healthy
    verl_core.beat(str(hb))
    assert verl_core.health_check(heartbeat_file=str(hb), max_heartbeat_age_s=60)["ok"]
    _age(hb, 120)
    with pytest.raises(UnhealthyError, match=r"heartbeat age 1\d\d\.\ds \(max 60s\)"):
        verl_core.health_check(heartbeat_file=str(hb), max_heartbeat_age_s=60)
    verl_core.beat(str(hb))  # a phase starting or ending refreshes it
    assert verl_core.health_check(heartbeat_file=str(hb), max_heartbeat_age_s=60)["ok"]


def test_store_and_heartbeat_come_from_the_environment(tmp_path, monkeypatch):
    hb = tmp_path / "beats" / "hb"
    verl_core.beat()  # unset: a no-op
    monkeypatch.setenv("VERL_HEARTBEAT_FILE", str(hb))
    monkeypatch.setenv("VERL_STORE", str(tmp_path / "store"))
    verl_core.beat()  # creates the folder and the file
    r = verl_core.health_check()
    assert r["checks"]["store"]["ok"] and r["checks"]["heartbeat"]["ok"]
    assert "(max 600s)" in r["checks"]["heartbeat"]["detail"]  # the documented default
    _age(hb, 30)
    monkeypatch.setenv("VERL_HEARTBEAT_MAX_AGE_S", "20")
    assert not verl_core.health_report()["checks"]["heartbeat"]["ok"]
    assert verl_core.health_report(heartbeat_file="")["ok"]  # "" skips a configured check
    for bad in ("abc", "0", "-5", "nan", "inf"):
        monkeypatch.setenv("VERL_HEARTBEAT_MAX_AGE_S", bad)
        with pytest.raises(ValueError, match="VERL_HEARTBEAT_MAX_AGE_S=.*positive number"):
            verl_core.health_report()
    monkeypatch.setenv("VERL_HEARTBEAT_FILE", str(tmp_path / "file" / "hb"))
    (tmp_path / "file").write_text("x")
    with pytest.raises(OSError, match="VERL_HEARTBEAT_FILE=.*cannot touch"):
        verl_core.beat()


def test_probe_commands_exit_codes_and_a_hung_phase(tmp_path):
    """The design's probe (``python -c ... health_check()``) and both CLI spellings: 0 while the
    heartbeat is fresh; non-zero once a process that beat at its phase start hangs past the age."""
    hb = tmp_path / "hb"
    env = {**os.environ, "VERL_HEARTBEAT_FILE": str(hb), "VERL_HEARTBEAT_MAX_AGE_S": "6",
           "VERL_STORE": str(tmp_path / "store")}

    def run(cmd, **extra):
        return subprocess.run(cmd, env={**env, **extra}, capture_output=True, text=True,
                              timeout=120)

    # a "phase" that beats when it starts, then hangs
    hung = subprocess.Popen([sys.executable, "-c", "import time, verl_core; verl_core.beat(); "
                             "print('started', flush=True); time.sleep(120)"],
                            env=env, stdout=subprocess.PIPE, text=True)
    try:
        assert hung.stdout.readline().strip() == "started"
        t_beat = os.path.getmtime(hb)
        fresh = run(PROBE)
        if time.time() - t_beat < 6:  # a very slow machine may already be past the 6 s age
            assert fresh.returncode == 0, fresh.stderr
        time.sleep(max(0.0, t_beat + 6.5 - time.time()))
        assert hung.poll() is None  # still hanging
        stale = run(PROBE)
        assert stale.returncode != 0 and "UnhealthyError" in stale.stderr
        assert "heartbeat age" in stale.stderr
        for cli in (["-m", "verl_core", "health"], ["-m", "verl_core.health"]):
            out = run([sys.executable, *cli])
            assert out.returncode == 1 and '"ok": false' in out.stdout, out.stderr
            out = run([sys.executable, *cli], VERL_HEARTBEAT_MAX_AGE_S="3600")
            assert out.returncode == 0 and '"store"' in out.stdout, out.stderr
    finally:
        hung.kill()
        hung.wait()
    bad = run([sys.executable, "-m", "verl_core", "health"], VERL_HEARTBEAT_MAX_AGE_S="soon")
    assert bad.returncode == 2 and "VERL_HEARTBEAT_MAX_AGE_S='soon'" in bad.stderr
    unknown = run([sys.executable, "-m", "verl_core", "healthz"])
    assert unknown.returncode == 2 and "use one of: health, train, checkpoint" in unknown.stderr
