import os
import subprocess
import sys
import time

import verl_core


def test_version_and_health_check(tmp_path):
    assert verl_core.__version__.count(".") == 2
    r = verl_core.health_check()
    assert r["ok"] and r["checks"]["torch"]["ok"] and r["version"] == verl_core.__version__


def test_store_probe_round_trips_and_fails_on_unwritable_store(tmp_path):
    assert verl_core.health_check(str(tmp_path / "store"))["checks"]["store"]["ok"]
    blocker = tmp_path / "file"
    blocker.write_text("x")  # a path under a regular file cannot be created
    r = verl_core.health_check(str(blocker / "store"))
    assert not r["ok"] and "unreachable" in r["checks"]["store"]["detail"]


def test_stale_heartbeat_is_unhealthy(tmp_path):
    hb = tmp_path / "hb"
    hb.write_text("")
    assert verl_core.health_check(heartbeat_file=str(hb), max_heartbeat_age_s=60)["ok"]
    old = time.time() - 120
    os.utime(hb, (old, old))
    assert not verl_core.health_check(heartbeat_file=str(hb), max_heartbeat_age_s=60)["ok"]


def test_cli_exit_code(tmp_path):
    ok = subprocess.run([sys.executable, "-m", "verl_core.health"], capture_output=True, timeout=120)
    bad = subprocess.run([sys.executable, "-m", "verl_core.health", "--heartbeat-file",
                          str(tmp_path / "missing")], capture_output=True, timeout=120)
    assert ok.returncode == 0 and bad.returncode == 1
