"""The SandboxFusion backend (``reward/sandbox_fusion.py``) against a loopback server this test
starts, speaking ``/run_code`` as verl's sandbox_fusion utils show it (the server runs the code
with the test's own interpreter: the test's code is trusted)."""

import json
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from verl_core.reward.manager import RewardScorer
from verl_core.reward.sandbox import SandboxLimits
from verl_core.reward.sandbox_fusion import SandboxFusion, SandboxUnavailableError

REQUESTS = []


class _RunCode(BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def do_POST(self):
        req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        REQUESTS.append(req)
        if self.path == "/broken":
            self.send_error(500, "boom")
            return
        try:
            r = subprocess.run([sys.executable, "-c", req["code"]], input=req["stdin"] or "",
                               capture_output=True, text=True, timeout=req["run_timeout"])
            run = {"status": "Finished", "stdout": r.stdout, "stderr": r.stderr,
                   "return_code": r.returncode, "execution_time": 0.0}
            status = "Success" if r.returncode == 0 else "Failed"
        except subprocess.TimeoutExpired:
            run, status = {"status": "TimeLimitExceeded", "stdout": "", "stderr": "",
                           "return_code": None}, "Failed"
        body = json.dumps({"status": status, "run_result": run, "compile_result": None}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


@pytest.fixture(scope="module")
def server():
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _RunCode)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()


def test_the_three_test_kinds_score_as_the_local_sandbox(server):
    REQUESTS.clear()
    sf = SandboxFusion(server + "/run_code", SandboxLimits(timeout_s=3, memory_mb=512),
                       max_concurrent=2)
    asserts = ["assert add3(1) == 4", "assert add3(-3) == 0"]
    assert sf.run("def add3(x):\n    return x + 3\n", asserts).score == 1.0
    assert sf.run("def add3(x):\n    return x\n", asserts).score == 0.0
    req = REQUESTS[0]  # verl's request fields
    assert req["language"] == "python" and req["memory_limit_MB"] == 512
    assert req["run_timeout"] == 3 and req["code"].endswith("\n\nassert add3(1) == 4")
    prog = "a, b = map(int, input().split())\nprint(a + b)\n"
    assert sf.run(prog, [("1 2\n", "3\n"), ("0 0\n", "1")], kind="stdio").score == 0.5
    call = sf.run("class Solution:\n    def twice(self, x):\n        return 2 * x\n",
                  [([1], [2]), ([4], 8)], kind="call", fn_name="twice")
    assert call.score == 1.0


def test_the_reward_manager_uses_it_and_an_outage_is_an_error(server):
    rows = ("synthetic/code", "def add3(x):\n    return x + 3\n", "assert add3(1) == 4")
    with RewardScorer("auto", sandbox_url=server + "/run_code") as rs:
        assert rs.score(*[[v] for v in rows]).scores == [1.0]
    with RewardScorer("auto", sandbox_url=server + "/broken") as rs:
        with pytest.raises(SandboxUnavailableError, match="HTTP 500"):
            rs.score(*[[v] for v in rows])
    with RewardScorer("auto", sandbox_url="http://127.0.0.1:9/run_code") as rs:
        with pytest.raises(SandboxUnavailableError, match="is the service up"):
            rs.score(*[[v] for v in rows])
