"""The code sandbox (``reward/sandbox.py``): each hostile kind scores 0, is stopped by the limit
the test names, and leaves no trace on the machine (no file, no connection, no process)."""

import os
import socket
import subprocess
import threading

import pytest

from verl_core.reward.sandbox import (SANDBOX_UID_BASE, Sandbox, SandboxError, SandboxLimits,
                                      isolation_available)

TESTS = ["assert f(1) == 2", "assert f(5) == 6"]
GOOD = "def f(x):\n    return x + 1\n"

needs_namespaces = pytest.mark.skipif(
    isolation_available() is not None,
    reason=f"namespaces unavailable here: {isolation_available()}")


@pytest.fixture(scope="module")
def sandbox():
    return Sandbox(SandboxLimits(timeout_s=8.0, cpu_s=1), isolation="namespaces") \
        if isolation_available() is None else None


def _sandbox_processes() -> list[str]:
    out = subprocess.run(["ps", "-eo", "uid=,pid=,stat=,comm="], capture_output=True,
                         text=True).stdout
    return [ln for ln in out.splitlines()
            if SANDBOX_UID_BASE <= int(ln.split()[0]) < SANDBOX_UID_BASE + 64
            and not ln.split()[2].startswith("Z")]


@needs_namespaces
def test_good_code_passes_and_bad_code_fails(sandbox):
    assert sandbox.run(GOOD, TESTS).score == 1.0
    r = sandbox.run("def f(x):\n    return 2\n", TESTS)  # f(1) == 2 only
    assert (r.passed, r.total, r.limit) == (1, 2, None)
    assert sandbox.run("def f(x) return", TESTS).score == 0.0  # a syntax error


@needs_namespaces
def test_fork_bomb_is_stopped_by_the_process_limit(sandbox):
    r = sandbox.run("import os\nwhile True:\n    os.fork()\n" + GOOD, TESTS)
    assert (r.score, r.limit) == (0.0, "nproc"), r
    assert _sandbox_processes() == []  # the PID namespace took every child with it


@needs_namespaces
def test_infinite_loop_is_stopped_by_the_cpu_limit(sandbox):
    r = sandbox.run("while True:\n    pass\n" + GOOD, TESTS)
    assert (r.score, r.limit) == (0.0, "cpu"), r
    assert r.seconds < 7.5  # RLIMIT_CPU (1 s here), before the 8 s wall clock
    # a loop that ignores SIGXCPU: the hard limit's SIGKILL a second later
    r = sandbox.run("import signal\nsignal.signal(signal.SIGXCPU, signal.SIG_IGN)\n"
                    "while True:\n    pass\n" + GOOD, TESTS)
    assert (r.score, r.limit) == (0.0, "cpu"), r


@needs_namespaces
def test_sleeping_code_is_stopped_by_the_wall_clock():
    sb = Sandbox(SandboxLimits(timeout_s=1.0), isolation="namespaces")
    r = sb.run("import time\ntime.sleep(60)\n" + GOOD, TESTS)
    assert (r.score, r.limit) == (0.0, "timeout"), r
    assert r.seconds < 3
    assert _sandbox_processes() == []  # the whole process group was killed


@needs_namespaces
def test_10gb_allocation_is_stopped_by_the_memory_limit(sandbox):
    r = sandbox.run("x = bytearray(10 * 1024 ** 3)\n" + GOOD, TESTS)
    assert (r.score, r.limit) == (0.0, "memory"), r
    # inside a tested function too: every test fails with MemoryError
    r = sandbox.run("def f(x):\n    return len(bytearray(10 * 1024 ** 3))\n", TESTS)
    assert (r.score, r.limit) == (0.0, "memory"), r


@needs_namespaces
def test_writing_outside_the_scratch_directory_cannot_happen(sandbox, tmp_path):
    target = tmp_path / "owned"
    r = sandbox.run(f"open({str(target)!r}, 'w').write('x')\n" + GOOD, TESTS)
    assert (r.score, r.limit) == (0.0, "filesystem"), r
    assert not target.exists()
    # the interpreter's own files are there, read-only (and the sandbox's uid owns nothing)
    r = sandbox.run(f"open({os.__file__!r}, 'a').write('x')\n" + GOOD, TESTS)
    assert (r.score, r.limit) == (0.0, "filesystem"), r
    # the scratch directory is writable (the code's cwd) and gone afterwards
    before = set(os.listdir(os.environ.get("TMPDIR", "/tmp")))
    r = sandbox.run("open('notes.txt', 'w').write('x')\nimport os\n"
                    "def f(x):\n    return x + len(open('notes.txt').read())\n", TESTS)
    assert r.score == 1.0, r
    after = set(os.listdir(os.environ.get("TMPDIR", "/tmp")))
    assert not [d for d in after - before if d.startswith("verl-sandbox-")]


@needs_namespaces
def test_a_socket_reaches_nothing(sandbox):
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    server.settimeout(0.5)
    port = server.getsockname()[1]
    arrived = []

    def accept():
        try:
            arrived.append(server.accept())
        except OSError:
            pass

    t = threading.Thread(target=accept)
    t.start()
    try:
        r = sandbox.run(f"import socket\nsocket.create_connection(('127.0.0.1', {port}))\n"
                        + GOOD, TESTS)
    finally:
        t.join()
        server.close()
    assert (r.score, r.limit) == (0.0, "network"), r
    assert arrived == []  # no connection arrived


@needs_namespaces
def test_the_run_store_and_the_environment_are_out_of_reach(sandbox, tmp_path, monkeypatch):
    store = tmp_path / "store" / "default"
    store.mkdir(parents=True)
    secret = store / "secret.json"
    secret.write_text('{"key": "s3cr3t"}')
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "s3cr3t")
    r = sandbox.run(f"print(open({str(secret)!r}).read())\n" + GOOD, TESTS)
    assert (r.score, r.limit) == (0.0, "filesystem"), r
    assert "s3cr3t" not in r.detail
    # what the code sees: no /proc, no store, no /work; an environment of its own
    probe = ("import os\n"
             "def f(x):\n"
             "    assert 'AWS_SECRET_ACCESS_KEY' not in os.environ, 'leaked'\n"
             f"    assert not os.path.exists({str(tmp_path)!r})\n"
             "    assert not os.path.exists('/proc/1/environ')\n"
             "    assert os.getuid() >= %d\n"
             "    return x + 1\n" % SANDBOX_UID_BASE)
    assert sandbox.run(probe, TESTS).score == 1.0


@needs_namespaces
def test_huge_output_is_cut_and_scores_zero(sandbox):
    r = sandbox.run("print('x' * 10 ** 8)\n" + GOOD, TESTS)
    assert (r.score, r.limit) == (0.0, "output"), r
    r = sandbox.run("import os\nfor fd in range(3, 12):\n    try:\n"
                    "        os.write(fd, b'x' * (1 << 20))\n    except OSError:\n"
                    "        pass\n" + GOOD, TESTS)
    assert (r.score, r.limit) == (0.0, "output"), r


@needs_namespaces
def test_a_big_file_is_stopped_by_the_file_size_limit(sandbox):
    r = sandbox.run("open('big', 'wb').write(b'x' * (64 << 20))\n" + GOOD, TESTS)
    assert (r.score, r.limit) == (0.0, "fsize"), r


@needs_namespaces
def test_results_cannot_be_forged(sandbox):
    # an exit before the tests passes none; printed results lack the harness's nonce
    for code in ("import sys\nsys.exit(0)\n" + GOOD, "import os\nos._exit(0)\n" + GOOD,
                 "for i in (0, 1):\n    print('0' * 32, '[\"test\", %d, true]' % i)\n"):
        assert sandbox.run(code, TESTS).score == 0.0, code


def test_limits_without_namespaces():
    """The fallback (``rlimits``): the same limits, no namespaces."""
    sb = Sandbox(SandboxLimits(timeout_s=8.0, cpu_s=1), isolation="rlimits")
    assert sb.mode == "rlimits"
    assert sb.run(GOOD, TESTS).score == 1.0
    assert sb.run("while True:\n    pass\n", TESTS).limit == "cpu"
    assert sb.run("x = bytearray(10 * 1024 ** 3)\n", TESTS).limit == "memory"


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="timeout_s"):
        SandboxLimits(timeout_s=0)
    with pytest.raises(ValueError, match="isolation"):
        Sandbox(isolation="docker")
    if isolation_available() is not None:
        with pytest.raises(SandboxError, match="not available"):
            Sandbox(isolation="namespaces")


_AS_NOBODY = r'''
import importlib.util, json, os, sys
spec = importlib.util.spec_from_file_location("sandbox", sys.argv[1])
S = importlib.util.module_from_spec(spec)
sys.modules["sandbox"] = S
spec.loader.exec_module(S)
sb = S.Sandbox(S.SandboxLimits(timeout_s=8.0, cpu_s=1))
tests, secret = ["assert f(1) == 2", "assert f(5) == 6"], sys.argv[2]
good = "def f(x):\n    return x + 1\n"
out = {"mode": sb.mode, "uid": os.getuid()}
for kind, code in {"good": good, "fork": "import os\nwhile True:\n    os.fork()\n" + good,
                   "socket": "import socket\nsocket.create_connection(('1.1.1.1', 80))\n" + good,
                   "secret": f"open({secret!r}).read()\n" + good,
                   "remount": "import ctypes\nl = ctypes.CDLL(None, use_errno=True)\n"
                              "assert l.mount(None, b'/usr', None, 32 | 4096, None) == 0\n",
                   }.items():
    r = sb.run(code, tests)
    out[kind] = [r.score, r.limit]
print(json.dumps(out))
'''


@pytest.mark.skipif(os.geteuid() != 0 or not os.path.exists("/usr/bin/python3")
                    or not os.path.exists("/usr/bin/setpriv"),
                    reason="needs root (to become another user), /usr/bin/python3 and setpriv")
def test_without_root_a_user_namespace_isolates_the_same(tmp_path):
    """As an unprivileged user (``nobody``), ``auto`` picks ``userns``: the same network and
    filesystem isolation; the process limit holds (counted with that user's own)."""
    import json
    import shutil
    import tempfile

    from verl_core.reward import sandbox as module

    if userns := subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups",
                                 "unshare", "--map-root-user", "--net", "true"],
                                capture_output=True).returncode:
        pytest.skip(f"unprivileged user namespaces are not allowed here ({userns})")
    shared = tempfile.mkdtemp(prefix="verl-sandbox-test-", dir="/tmp")  # readable by nobody
    try:
        os.chmod(shared, 0o755)
        shutil.copy(module.__file__, os.path.join(shared, "sandbox.py"))
        secret = tmp_path / "secret"  # the store of the run: nobody cannot even look there
        secret.write_text("s3cr3t")
        readable = os.path.join(shared, "secret")  # ... and one it could read outside
        shutil.copy(secret, readable)
        os.chmod(readable, 0o644)
        r = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups",
                            "--inh-caps=-all", "--bounding-set=-all", "/usr/bin/python3", "-c",
                            _AS_NOBODY, os.path.join(shared, "sandbox.py"), readable],
                           capture_output=True, text=True, timeout=120, cwd=shared,
                           env={"PATH": "/usr/bin:/bin", "TMPDIR": shared})
    finally:
        shutil.rmtree(shared, ignore_errors=True)
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert (out["mode"], out["uid"]) == ("userns", 65534)
    assert out["good"] == [1.0, None]
    assert out["fork"] == [0.0, "nproc"]
    assert out["socket"] == [0.0, "network"]
    assert out["secret"] == [0.0, "filesystem"]
    assert out["remount"][0] == 0.0  # the binds stay read-only: no capability over them
