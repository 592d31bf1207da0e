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
    for name in ("VERL_STORE", "VERL_HEARTBEAT_FILE", "VERL_HEARTBEAT_MAX_AGE_S",
                 "VERL_HEALTH_TIMEOUT_S"):
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
    monkeypatch.delenv("VERL_HEARTBEAT_MAX_AGE_S")
    for bad in ("soon", "0", "nan"):
        monkeypatch.setenv("VERL_HEALTH_TIMEOUT_S", bad)
        with pytest.raises(ValueError, match="VERL_HEALTH_TIMEOUT_S=.*under the liveness"):
            verl_core.health_report()
    monkeypatch.delenv("VERL_HEALTH_TIMEOUT_S")
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


def test_store_check_uses_the_endpoint_of_VERL_S3_ENDPOINT(moto_s3, monkeypatch):
    """The S3 recipe (docs/cluster.md) sets only VERL_S3_ENDPOINT: the probe must round-trip to that
    server (the same options the run's store resolves), not to AWS's default endpoint."""
    endpoint, bucket, _ = moto_s3
    monkeypatch.setenv("VERL_S3_ENDPOINT", endpoint)
    r = verl_core.health_check(f"s3://{bucket}/runs", timeout_s=30)
    assert r["checks"]["store"] == {"ok": True, "detail": f"round trip to s3://{bucket}/runs"}
    import boto3

    s3 = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")
    assert s3.list_objects_v2(Bucket=bucket).get("KeyCount", 0) == 0  # the probe cleaned up


def test_a_stalled_store_is_unhealthy_within_the_deadline(moto_server_factory, tmp_path,
                                                           monkeypatch):
    """A SIGSTOPped S3 server accepts connections and never replies (botocore alone would wait
    minutes: read timeout x attempts, per call). In-process the report comes at the deadline
    (the checks run at once, so one deadline covers all of them); both probe spellings answer
    unhealthy, naming the stall, inside the deploy probes' timeoutSeconds (30 s), start-up
    included."""
    server = moto_server_factory()
    bucket = server.create_bucket()
    deadline = 3.0
    env = {**os.environ, "VERL_S3_ENDPOINT": server.endpoint, "VERL_STORE": f"s3://{bucket}/r",
           "VERL_HEALTH_TIMEOUT_S": str(deadline)}

    def probe(cmd):
        t = time.monotonic()
        out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
        return out, time.monotonic() - t

    healthy, t_healthy = probe(PROBE)  # the server answers: same command, same environment
    assert healthy.returncode == 0, healthy.stderr
    server.pause()
    # the in-process report finds the server as the probes do (it read whatever endpoint an
    # earlier test left in this process's environment before, or AWS's)
    monkeypatch.setenv("VERL_S3_ENDPOINT", server.endpoint)
    try:
        t = time.monotonic()
        r = verl_core.health_report(f"s3://{bucket}/r", timeout_s=deadline)
        # join() returns at the deadline; 0.5 s covers building the report on a busy machine
        assert time.monotonic() - t < deadline + 0.5
        assert not r["ok"] and r["checks"]["torch"]["ok"]
        assert r["checks"]["store"]["detail"] == (
            f"store s3://{bucket}/r: the round trip stalled: no answer within 3s "
            "(VERL_HEALTH_TIMEOUT_S sets this deadline)")
        for cmd in (PROBE, [sys.executable, "-m", "verl_core", "health"]):
            out, took = probe(cmd)
            assert out.returncode == 1 and "round trip stalled" in out.stdout + out.stderr
            assert took < 30, (took, t_healthy)  # healthy: ~4 s here, stalled: ~4 s + 3 s
    finally:
        server.resume()
    resumed, _ = probe(PROBE)
    assert resumed.returncode == 0, resumed.stderr  # the stall was the only fault


def test_check_deadline_fits_the_deploy_probes():
    """Kubernetes kills a probe at timeoutSeconds and counts that as a failure without our
    report. Every probe in deploy/ must leave the interpreter's start-up (~4 s on 2 busy cores,
    measured by the test above) plus one check deadline inside its timeoutSeconds."""
    import pathlib

    import yaml
    from verl_core.health import DEFAULT_CHECK_TIMEOUT_S

    def probes(node):
        if isinstance(node, dict):
            for k, v in node.items():
                if k == "livenessProbe":
                    yield v
                yield from probes(v)
        elif isinstance(node, list):
            for v in node:
                yield from probes(v)

    root = pathlib.Path(__file__).resolve().parents[2] / "deploy" / "k8s"
    found = [p for f in sorted(root.glob("*.yaml")) for doc in yaml.safe_load_all(f.read_text())
             for p in probes(doc)]
    assert found
    for p in found:
        assert p["exec"]["command"][-1] == "health"
        assert p["timeoutSeconds"] >= DEFAULT_CHECK_TIMEOUT_S + 10, p
