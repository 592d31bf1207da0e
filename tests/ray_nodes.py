"""Real Ray clusters for tests: nodes started with ``ray start`` (the CLI a KubeRay pod runs), each
in the foreground (``--block``) in its own session so a test can stop it, or SIGKILL a node's
raylet to lose that node."""
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

import psutil

RAY = os.path.join(os.path.dirname(sys.executable), "ray")
# lose a node fast: the GCS declares a silent raylet dead after ~3 missed 0.5 s health checks
FAST_FAILURE = {"RAY_health_check_period_ms": "500", "RAY_health_check_timeout_ms": "500",
                "RAY_health_check_failure_threshold": "3", "RAY_AUTH_MODE": "disabled"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ray_start(*args, env, log: str) -> subprocess.Popen:
    """A Ray node in the foreground (``--block``), its output in ``log``. Every port it listens
    on is a free one picked here: Ray's fixed defaults (the client server's 10001, the dashboard
    agent's 52365) collide with any other Ray instance on the machine."""
    ports = [f"--{name}={_free_port()}" for name in (
        "dashboard-agent-listen-port", "dashboard-agent-grpc-port", "metrics-export-port",
        "runtime-env-agent-port", "node-manager-port", "object-manager-port")]
    if "--head" in args:
        ports.append(f"--ray-client-server-port={_free_port()}")
    with open(log, "ab") as out:
        return subprocess.Popen([RAY, "start", "--block", "--disable-usage-stats", *ports, *args],
                                env=env, start_new_session=True, stdout=out,
                                stderr=subprocess.STDOUT)


def _stop(proc: subprocess.Popen) -> None:
    """The node and every process it started (SIGKILL: nothing of it needs to survive)."""
    try:
        family = psutil.Process(proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        family = []
    for p in [psutil.Process(proc.pid), *family] if proc.poll() is None else family:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    proc.wait(timeout=30)


def alive_nodes(ray) -> list[dict]:
    return [n for n in ray.nodes() if n["Alive"]]


class RayNodes:
    """A head node (``num_cpus`` CPUs) and, after :meth:`start_second`, a second node with as many
    CPUs, a ``second`` resource and a node label."""

    def __init__(self, tmp, num_cpus: int = 1):
        self.env = {**os.environ, **FAST_FAILURE}
        self.num_cpus = num_cpus
        self.port = _free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.log = os.path.join(str(tmp), "ray-start.log")
        os.makedirs(str(tmp), exist_ok=True)
        # the session folder (logs, sockets): short, since a unix socket path has <= 107 bytes
        self.temp_dir = tempfile.mkdtemp(prefix="ray-", dir="/tmp")
        self.head = _ray_start("--head", f"--port={self.port}", f"--num-cpus={num_cpus}",
                               "--node-ip-address=127.0.0.1", "--include-dashboard=false",
                               f"--temp-dir={self.temp_dir}", "--labels=verl-test-node=head",
                               env=self.env,
                               log=self.log)
        self.second = None
        self.wait_ready()

    def wait_ready(self, timeout_s: float = 120.0) -> None:
        """Until the head's GCS port answers; fails with the nodes' output if one exited."""
        deadline = time.time() + timeout_s
        while True:
            for p in (self.head, self.second):
                if p is not None and p.poll() is not None:
                    with open(self.log, errors="replace") as f:
                        raise RuntimeError(f"ray start exited ({p.returncode}):\n"
                                           f"{f.read()[-4000:]}")
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                return
            except OSError:
                if time.time() > deadline:
                    raise TimeoutError(f"the Ray head did not start in {timeout_s:.0f}s")
                time.sleep(0.3)

    def start_second(self) -> None:
        self.second = _ray_start(f"--address={self.address}", f"--num-cpus={self.num_cpus}",
                                 "--node-ip-address=127.0.0.1", '--resources={"second": 1}',
                                 "--labels=verl-test-node=second", env=self.env, log=self.log)

    def kill_second_raylet(self) -> int:
        """SIGKILL the second node's raylet (its workers go with it): a node lost."""
        [raylet] = [p for p in psutil.Process(self.second.pid).children(recursive=True)
                    if p.name() == "raylet"]
        raylet.send_signal(signal.SIGKILL)
        return raylet.pid

    def stop(self) -> None:
        for p in (self.second, self.head):
            if p is not None:
                _stop(p)
        shutil.rmtree(self.temp_dir, ignore_errors=True)
