"""pytest plugin: a real S3-compatible server (``moto_server``) on 127.0.0.1 for store tests.

Register with ``pytest_plugins = ["tests.conftest_s3"]`` in ``tests/conftest.py``.

Fixtures:
    moto_s3          -> (endpoint_url, bucket, storage_options): a fresh bucket on a server shared
                        by the session; dummy credentials are set in the environment for the test.
    moto_server_factory -> callable starting a dedicated server (``MotoServer``) the test may kill,
                        pause (SIGSTOP) or resume; every server it started is killed at teardown.
    moto_s3_serial   -> like ``moto_s3``, on a server that handles one request at a time, for
                        compare-and-swap races (see ``_SERIAL_SERVER``).
    moto_s3_readme   -> ``(endpoint_url, bucket)`` configured per docs/cluster.md: VERL_S3_ENDPOINT
                        set in the environment, keys in AWS_* variables, no storage_options.

The other fixtures unset VERL_S3_ENDPOINT, so their tests pass explicit storage_options.

No real credentials are ever read or needed: the fixtures set AWS_ACCESS_KEY_ID=testing etc.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
import uuid
from dataclasses import dataclass, field

import pytest

DUMMY_ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_SECURITY_TOKEN": "testing",
    "AWS_SESSION_TOKEN": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
}
_UNSET_ENV = ("AWS_PROFILE", "AWS_CONFIG_FILE", "AWS_SHARED_CREDENTIALS_FILE", "AWS_ENDPOINT_URL",
              "VERL_S3_ENDPOINT")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# moto checks a conditional PUT's If-Match/If-None-Match and then writes, without a lock, so on
# its threaded server two racing conditional PUTs could both pass (S3 itself decides them
# atomically). Served one request at a time, moto's conditional writes are atomic too.
_SERIAL_SERVER = """
import sys
from werkzeug.serving import run_simple
from moto.moto_server.werkzeug_app import (DomainDispatcherApplication, MotoRequestHandler,
                                           create_backend_app)
run_simple("127.0.0.1", int(sys.argv[1]), DomainDispatcherApplication(create_backend_app),
           threaded=False, request_handler=MotoRequestHandler)
"""


def _moto_cmd(port: int, serial: bool = False) -> list[str]:
    if serial:
        return [sys.executable, "-c", _SERIAL_SERVER, str(port)]
    exe = shutil.which("moto_server") or os.path.join(os.path.dirname(sys.executable),
                                                       "moto_server")
    if os.path.exists(exe):
        return [exe, "-H", "127.0.0.1", "-p", str(port)]
    return [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)]


@dataclass
class MotoServer:
    """A ``moto_server`` subprocess; ``endpoint`` is ``http://127.0.0.1:<port>``."""

    proc: subprocess.Popen
    port: int
    endpoint: str = field(init=False)

    def __post_init__(self):
        self.endpoint = f"http://127.0.0.1:{self.port}"

    def kill(self) -> None:
        """SIGKILL the server (all its in-memory data is gone)."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)

    def pause(self) -> None:
        """SIGSTOP: connections hang until the client times out."""
        os.kill(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        os.kill(self.proc.pid, signal.SIGCONT)

    def storage_options(self, **config) -> dict:
        """s3fs options for this server: short timeouts so a dead server fails fast."""
        cfg = {"connect_timeout": 2, "read_timeout": 5, "retries": {"max_attempts": 2,
                                                                    "mode": "standard"}}
        cfg.update(config)
        return {"client_kwargs": {"endpoint_url": self.endpoint, "region_name": "us-east-1"},
                "config_kwargs": cfg}

    def create_bucket(self, name: str | None = None) -> str:
        import boto3

        name = name or f"test-{uuid.uuid4().hex[:12]}"
        boto3.client("s3", endpoint_url=self.endpoint, region_name="us-east-1",
                     aws_access_key_id="testing",
                     aws_secret_access_key="testing").create_bucket(Bucket=name)
        return name


def start_moto_server(timeout_s: float = 60.0, serial: bool = False) -> MotoServer:
    """Start ``moto_server`` on a free port of 127.0.0.1 and wait until it answers (``serial``:
    one request at a time, so conditional writes are atomic)."""
    port = _free_port()
    env = {**os.environ, **DUMMY_ENV}
    proc = subprocess.Popen(_moto_cmd(port, serial), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env=env, start_new_session=True)
    server = MotoServer(proc, port)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"moto_server exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(f"{server.endpoint}/moto-api/", timeout=1):
                return server
        except OSError:
            time.sleep(0.1)
    server.kill()
    raise RuntimeError(f"moto_server did not answer on port {port} within {timeout_s}s")


def _set_dummy_env(monkeypatch) -> None:
    for k in _UNSET_ENV:
        monkeypatch.delenv(k, raising=False)
    for k, v in DUMMY_ENV.items():
        monkeypatch.setenv(k, v)


@pytest.fixture(scope="session")
def _moto_session_server():
    server = start_moto_server()
    yield server
    server.kill()


@pytest.fixture
def moto_s3(_moto_session_server, monkeypatch):
    """``(endpoint_url, bucket, storage_options)`` with a fresh bucket for this test."""
    _set_dummy_env(monkeypatch)
    bucket = _moto_session_server.create_bucket()
    yield _moto_session_server.endpoint, bucket, _moto_session_server.storage_options()


@pytest.fixture
def moto_s3_readme(_moto_session_server, monkeypatch):
    """``(endpoint_url, bucket)``: a fresh bucket, reachable only through VERL_S3_ENDPOINT (the
    docs/cluster.md's S3 recipe); subprocesses inherit the environment."""
    _set_dummy_env(monkeypatch)
    monkeypatch.setenv("VERL_S3_ENDPOINT", _moto_session_server.endpoint)
    yield _moto_session_server.endpoint, _moto_session_server.create_bucket()


@pytest.fixture(scope="session")
def _moto_serial_session_server():
    server = start_moto_server(serial=True)
    yield server
    server.kill()


@pytest.fixture
def moto_s3_serial(_moto_serial_session_server, monkeypatch):
    """``(endpoint_url, bucket, storage_options)`` on the one-request-at-a-time server."""
    _set_dummy_env(monkeypatch)
    bucket = _moto_serial_session_server.create_bucket()
    yield (_moto_serial_session_server.endpoint, bucket,
           _moto_serial_session_server.storage_options())


@pytest.fixture
def moto_server_factory(monkeypatch):
    """Start dedicated servers (``factory() -> MotoServer``); all are killed at teardown."""
    _set_dummy_env(monkeypatch)
    started: list[MotoServer] = []

    def factory() -> MotoServer:
        s = start_moto_server()
        started.append(s)
        return s

    yield factory
    for s in started:
        try:
            s.resume()
        except ProcessLookupError:
            pass
        s.kill()
