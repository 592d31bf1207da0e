"""Running a response's Python code against tests in a sandbox: one process per call, limited
and isolated, so hostile code scores 0 and never harms the trainer, the run store or the machine.

What belongs here: starting the sandboxed process, its limits and isolation, and reading back
which tests passed. What does not: pulling the code out of a response and reading the tests out
of a ground truth (``reward/code.py``), scoring a batch (``reward/manager.py``).

One call = one process tree, started by :meth:`Sandbox.run`:

- **Isolation** (``isolation="namespaces"``, what ``auto`` picks where it works, e.g. as root on
  CI): ``unshare --mount --net --pid --ipc --uts --fork --kill-child`` puts the harness in new
  namespaces. It is PID 1 of its PID namespace, so when it ends every process it left behind
  (a fork bomb's) is killed by the kernel. The network namespace has only a loopback that is
  down: no connection leaves it (connect fails with ENETUNREACH). In its mount namespace the
  harness builds a new root on a size-limited tmpfs holding read-only, nosuid binds of the
  interpreter's prefix and ``/usr`` (the C libraries), ``/dev/null|zero|random|urandom`` and an
  empty ``/work`` (the cwd, ``HOME`` and ``TMPDIR``), chroots into it, then drops to its own
  unprivileged uid (one per concurrent slot, ``SANDBOX_UID_BASE + slot``) with no_new_privs:
  nothing else of the machine's filesystem exists for the code (no run store, no ``/work``, no
  ``/tmp``, no ``/proc``), and what it can see it cannot write. The tmpfs vanishes with the
  namespace, so the scratch directory is gone when the call ends.
- **Limits** (every mode): RLIMIT_CPU (``cpu_s``; SIGXCPU, then SIGKILL one second later),
  RLIMIT_AS (``memory_mb``), RLIMIT_FSIZE (``file_size_mb``; writes beyond it fail with EFBIG),
  RLIMIT_NPROC (``max_processes``; enforced only for a non-root uid, hence the uid switch),
  RLIMIT_NOFILE and no core dumps; a wall-clock deadline (``timeout_s``) after which the parent
  kills the whole process group (``start_new_session``); at most ``max_output_bytes`` of output
  are read back, then the call is killed. The response's own stdout/stderr go to /dev/null; the
  harness reports on a private copy of the pipe, each line prefixed with a random nonce, so
  printed text cannot forge a result, and a test counts only when the harness reports it (an
  ``exit(0)`` or ``os._exit`` before the tests passes none).
- **Environment**: the parent's is never inherited: ``PATH``, ``LANG``, ``HOME``/``TMPDIR``
  (the scratch directory) and ``PYTHONHASHSEED=0`` only (no S3 keys, no store paths). The
  interpreter runs with ``-S -s -P``: the standard library only, no site-packages.
- **Without root** (``isolation="userns"``, what ``auto`` picks where this process is not root
  and unprivileged user namespaces are allowed): the same namespaces, mounts and chroot inside a
  user namespace (``unshare --map-root-user``); instead of the uid switch, a nested user
  namespace entered before the chroot leaves the code no capability over its mounts (the binds
  stay read-only), and RLIMIT_NPROC counts the trainer's uid's processes too (the limit is set
  that many above them).
- **Fallback** (``isolation="rlimits"``, what ``auto`` picks where ``unshare`` is refused, e.g.
  a container whose seccomp profile forbids it): the same limits and environment in a plain
  child process with a scratch directory as cwd, removed after; with no network or filesystem
  isolation and a process limit shared with the trainer's own uid. ``auto`` logs a warning
  naming what does not hold (docs/rewards.md, "Code execution rewards").

Why the standard library (``subprocess``, ``resource``, ``ctypes`` for ``mount``/``chroot``)
and no sandbox package: what is needed is a few system calls; the Python sandboxes on PyPI
either restrict the interpreter from inside (which a response can undo) or wrap a service (gVisor,
nsjail, SandboxFusion) that CI cannot install. A cluster should add one of those (docs).
"""

from __future__ import annotations

import errno
import json
import logging
import math
import os
import queue
import secrets
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from typing import Sequence

__all__ = ["SandboxLimits", "SandboxResult", "Sandbox", "SandboxError", "isolation_available",
           "SANDBOX_UID_BASE", "LIMIT_KINDS"]

log = logging.getLogger(__name__)

SANDBOX_UID_BASE = 61000
"""The sandbox's uid (and gid) in ``namespaces`` mode is this plus the call's slot (0 to
``max_concurrent - 1``): RLIMIT_NPROC counts per uid, so concurrent calls never share a count."""
LIMIT_KINDS = ("cpu", "timeout", "memory", "nproc", "fsize", "output", "network", "filesystem")
"""What can stop a call (:attr:`SandboxResult.limit`)."""


class SandboxError(RuntimeError):
    """The sandbox itself could not run (``unshare`` refused, the harness did not start): a
    problem of the machine, not of the response; the message says what to change."""


@dataclass(frozen=True)
class SandboxLimits:
    """What one sandboxed call may use."""

    timeout_s: float = 5.0
    """Wall-clock limit of a call."""
    cpu_s: float = 0.0
    """CPU-time limit (RLIMIT_CPU, whole seconds); 0: half of ``timeout_s``."""
    memory_mb: int = 1024
    """Address-space limit (RLIMIT_AS) of the process (verl's
    ``sandbox_fusion.memory_limit_mb``)."""
    file_size_mb: int = 16
    """Largest file the code may write (RLIMIT_FSIZE); the scratch tmpfs holds twice this."""
    max_processes: int = 8
    """Processes (and threads) the code may have at once (RLIMIT_NPROC, per sandbox uid)."""
    max_output_bytes: int = 1 << 16
    """Most bytes read back from a call; beyond it the call is killed and scores 0."""

    def __post_init__(self):
        if not (isinstance(self.cpu_s, (int, float)) and 0 <= self.cpu_s < math.inf):
            raise ValueError(f"SandboxLimits.cpu_s={self.cpu_s!r}: must be >= 0 (0: half of "
                             "timeout_s)")
        for name in ("timeout_s", "memory_mb", "file_size_mb", "max_processes",
                     "max_output_bytes"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v > 0):
                raise ValueError(f"SandboxLimits.{name}={v!r}: must be a finite number > 0")

    @property
    def cpu_limit_s(self) -> int:
        """RLIMIT_CPU in whole seconds: ``cpu_s``, else half the wall clock (at least 1), so busy
        code is stopped by the CPU limit even on a loaded machine, and sleeping or blocked code by
        the wall clock."""
        return max(1, math.ceil(self.cpu_s or self.timeout_s / 2))


@dataclass(frozen=True)
class SandboxResult:
    """What one call did."""

    passed: int
    """Tests that passed."""
    total: int
    """Tests given."""
    limit: str | None = None
    """Which limit stopped the code (one of :data:`LIMIT_KINDS`), None when none did."""
    detail: str = ""
    """Short text: the error that ended the code or a failed test, for logs."""
    seconds: float = 0.0
    """Wall-clock time of the call, start to kill."""

    @property
    def score(self) -> float:
        """Fraction of the tests passed (0.0 without tests)."""
        return self.passed / self.total if self.total else 0.0


# ------------------------------------------------------------------ the harness (in the sandbox)
# Runs as ``python -S -s -P -c _HARNESS SETUP_JSON`` with the payload on stdin (the standard
# library only). It builds the sandbox (namespaces mode: mounts, chroot, uid), sets the limits,
# then runs the code and the tests in one interpreter, reporting each result as a line prefixed
# with the call's nonce on a private copy of the pipe (``report``). The response's code runs in
# the same process, so it could find the nonce in memory: the nonce stops printed text and an
# early exit from counting as passed tests, not code written to forge results.
_HARNESS = r'''
import builtins, ctypes, errno, io, json, os, resource, signal, sys
setup = json.loads(sys.argv[1])
payload = json.loads(sys.stdin.read())
nonce, me = payload.pop("nonce"), os.getpid()
out = os.fdopen(os.dup(1), "w", buffering=1)
def report(*parts):
    if os.getpid() == me:  # a forked child of the response never reports
        try:
            sys.stdout.flush()
        except BaseException:
            pass
        out.write("\n" + nonce + " " + json.dumps(parts) + "\n")
        out.flush()
if setup["mode"] != "rlimits":
    libc = ctypes.CDLL(None, use_errno=True)
    def mount(src, dst, fstype, flags, data=None):
        enc = lambda s: None if s is None else s.encode()
        if libc.mount(enc(src), enc(dst), enc(fstype), flags, enc(data)) != 0:
            e = ctypes.get_errno()
            raise OSError(e, f"mount {src} on {dst}: {os.strerror(e)}")
    RDONLY, NOSUID, NODEV, REMOUNT, BIND, REC, PRIVATE = 1, 2, 4, 32, 4096, 16384, 1 << 18
    mount(None, "/", None, REC | PRIVATE)
    root = setup["root"]
    mount("tmpfs", root, "tmpfs", NOSUID | NODEV,
          f"size={setup['tmpfs_mb']}m,nr_inodes=4096,mode=755")
    for path in setup["binds"]:
        dst = root + path
        if os.path.islink(path):
            os.makedirs(os.path.dirname(dst), exist_ok=True)
            os.symlink(os.readlink(path), dst)
            continue
        if os.path.isdir(path):
            os.makedirs(dst, exist_ok=True)
        else:
            os.makedirs(os.path.dirname(dst), exist_ok=True)
            open(dst, "w").close()
        mount(path, dst, None, BIND)
        dev = path.startswith("/dev/")
        # keep the source's own flags (a user namespace may not clear them), add ours
        f = os.statvfs(path).f_flag
        kept = (f & (RDONLY | NOSUID | NODEV | 8 | 1024 | 2048)) | ((1 << 21) if f & 4096 else 0)
        mount(None, dst, None, REMOUNT | BIND | NOSUID | kept | (0 if dev else RDONLY | NODEV))
    os.makedirs(root + "/work")
    os.chmod(root + "/work", 0o1777)
    uid = setup["uid"]
    # userns mode: a nested user namespace (before the chroot, which forbids it) leaves no
    # capability over this mount namespace: the binds stay read-only for good
    if uid is None and libc.unshare(0x10000000) != 0:  # CLONE_NEWUSER
        raise OSError(ctypes.get_errno(), "unshare(CLONE_NEWUSER)")
    os.chroot(root)
    os.chdir("/work")
    if uid is not None:
        os.setgroups([])
        os.setgid(uid)
        os.setuid(uid)
    libc.prctl(38, 1, 0, 0, 0)  # PR_SET_NO_NEW_PRIVS
else:
    os.chdir(setup["root"])
cpu, mb = setup["cpu_s"], 1 << 20
for what, soft, hard in ((resource.RLIMIT_CPU, cpu, cpu + 1),
                         (resource.RLIMIT_AS, setup["memory_mb"] * mb, setup["memory_mb"] * mb),
                         (resource.RLIMIT_FSIZE, setup["file_size_mb"] * mb,
                          setup["file_size_mb"] * mb),
                         (resource.RLIMIT_NPROC, setup["nproc"], setup["nproc"]),
                         (resource.RLIMIT_NOFILE, 64, 64), (resource.RLIMIT_CORE, 0, 0)):
    resource.setrlimit(what, (soft, hard))
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write beyond RLIMIT_FSIZE fails with EFBIG
def _cpu(*_):
    report("limit", "cpu")
    os._exit(3)
signal.signal(signal.SIGXCPU, _cpu)
os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
os.dup2(1, 2)  # the response's output shares the pipe, and the parent's bound on it
def why(e):
    return [type(e).__name__, getattr(e, "errno", None), str(e)[:200]]
def same_output(got, want):
    lines = lambda s: [ln.rstrip() for ln in str(s).rstrip().splitlines()]
    return lines(got) == lines(want)
def run_program(code, stdin):
    sys.stdin, sys.stdout = io.StringIO(stdin), io.StringIO()
    try:
        exec(code, {"__name__": "__main__", "__builtins__": builtins})
    except SystemExit:
        pass
    finally:
        got, sys.stdin, sys.stdout = sys.stdout.getvalue(), sys.__stdin__, sys.__stdout__
    return got
kind, tests = payload["kind"], payload["tests"]
report("ready")
try:
    code = compile(payload["code"], "<response>", "exec")
except BaseException as e:
    report("load", *why(e))
    report("done")
    os._exit(0)
g = {"__name__": "__main__", "__builtins__": builtins}
if kind != "stdio":
    try:
        exec(code, g)
    except BaseException as e:
        report("load", *why(e))
        report("done")
        os._exit(0)
fn = None
if kind == "call":
    name = payload["fn_name"]
    fn = g.get(name) or getattr(g.get("Solution", type("_", (), {}))(), name, None)
for i, t in enumerate(tests):
    try:
        if kind == "assert":
            exec(compile(t, f"<test {i}>", "exec"), g)
            ok = True
        elif kind == "stdio":
            ok = same_output(run_program(code, t[0]), t[1])
        else:
            args = t[0] if isinstance(t[0], list) else \
                [json.loads(x) for x in str(t[0]).splitlines()]
            got = fn(*args)
            got = list(got) if isinstance(got, tuple) else got
            want = t[1]
            ok = got == want or (isinstance(want, list) and len(want) > 0 and got == want[0])
        report("test", i, bool(ok))
    except BaseException as e:
        report("test", i, False, *why(e))
report("done")
os._exit(0)
'''


# ------------------------------------------------------------------ isolation modes
ISOLATIONS = ("auto", "namespaces", "userns", "rlimits")
_probe_lock = threading.Lock()
_probed: dict[str, str | None] = {}
_warned = False


def _unshare_cmd(userns: bool = False) -> list[str]:
    exe = shutil.which("unshare") or "/usr/bin/unshare"
    return [exe, *(["--map-root-user"] if userns else []), "--mount", "--net", "--pid", "--ipc",
            "--uts", "--fork", "--kill-child"]


def isolation_available() -> str | None:
    """Why ``namespaces`` cannot run here (None when it can): it needs root (for the uid switch,
    and so RLIMIT_NPROC applies) and ``unshare`` allowed to create the namespaces."""
    with _probe_lock:
        if "namespaces" not in _probed:
            _probed["namespaces"] = _probe()
        return _probed["namespaces"]


def userns_available() -> str | None:
    """Why ``userns`` (the same namespaces without root, in a user namespace) cannot run here
    (None when it can)."""
    with _probe_lock:
        if "userns" not in _probed:
            _probed["userns"] = _probe(userns=True)
        return _probed["userns"]


def _probe(userns: bool = False) -> str | None:
    if not sys.platform.startswith("linux"):
        return f"namespaces are Linux's (this is {sys.platform})"
    if os.geteuid() != 0 and not userns:
        return ("it needs root: the sandboxed code runs as its own uid, and Linux applies "
                "RLIMIT_NPROC only to a non-root uid; this process runs as uid "
                f"{os.geteuid()}")
    if not shutil.which("unshare"):
        return "the unshare command (util-linux) is not installed"
    try:
        r = subprocess.run([*_unshare_cmd(userns), "true"], capture_output=True, timeout=10,
                           env={"PATH": "/usr/bin:/bin"})
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"unshare failed to run: {e}"
    if r.returncode != 0:
        return (f"unshare refused new namespaces ({r.stderr.decode(errors='replace').strip()}); "
                "a container needs CAP_SYS_ADMIN or a seccomp profile that allows unshare")
    return None


def _resolve(isolation: str) -> str:
    global _warned
    if isolation not in ISOLATIONS:
        raise ValueError(f"isolation={isolation!r}: known: {', '.join(ISOLATIONS)}")
    if isolation == "rlimits":
        return "rlimits"
    why = isolation_available() if isolation != "userns" else "not asked for"
    if isolation == "namespaces" and why:
        raise SandboxError(f"sandbox isolation 'namespaces' is not available: {why}")
    if not why:
        return "namespaces"
    why_userns = userns_available()
    if isolation == "userns" and why_userns:
        raise SandboxError(f"sandbox isolation 'userns' is not available: {why_userns}")
    if not why_userns:
        if isolation == "auto" and not _warned:
            _warned = True
            log.warning("code sandbox: namespaces as root unavailable (%s); using a user "
                        "namespace: the same network and filesystem isolation, but the "
                        "process limit counts this uid's own processes too (docs/rewards.md, "
                        "'Code execution rewards')", why)
        return "userns"
    if not _warned:
        _warned = True
        log.warning("code sandbox: namespaces unavailable (%s; %s); falling back to resource "
                    "limits only: the code can reach the network and read what this "
                    "process's uid can read (docs/rewards.md, 'Code execution rewards')",
                    why, why_userns)
    return "rlimits"


def _binds() -> list[str]:
    """What the sandbox's root shows: the interpreter's prefix (its standard library and shared
    library), ``/usr`` and the top-level links into it, and the harmless devices."""
    prefix = os.path.realpath(sys.base_prefix)
    out = ["/usr"]
    for p in ("/lib", "/lib64", "/bin", "/lib32", "/libx32"):
        if os.path.lexists(p):
            out.append(p)
    if not prefix.startswith("/usr/"):
        out.append(prefix)
    out += [d for d in ("/dev/null", "/dev/zero", "/dev/random", "/dev/urandom")
            if os.path.exists(d)]
    return out


def _python() -> str:
    """The base interpreter (a venv's ``python`` is a link into a folder the sandbox hides)."""
    return os.path.realpath(getattr(sys, "_base_executable", None) or sys.executable)


# ------------------------------------------------------------------ the parent side
_ERRNO_LIMITS = {errno.ENETUNREACH: "network", errno.EADDRNOTAVAIL: "network",
                 errno.ECONNREFUSED: "network", errno.EAGAIN: "nproc", errno.EFBIG: "fsize",
                 errno.ENOSPC: "fsize", errno.ENOENT: "filesystem", errno.EROFS: "filesystem",
                 errno.EACCES: "filesystem", errno.EPERM: "filesystem"}


def _limit_of(err: list) -> str | None:
    """The limit an exception reported by the harness (``[type, errno, text]``) stands for."""
    kind, code = err[0], err[1]
    if kind == "MemoryError":
        return "memory"
    return _ERRNO_LIMITS.get(code)


class Sandbox:
    """Runs code against tests, at most ``max_concurrent`` calls at once (each in its own slot:
    its own uid in ``namespaces`` mode). Thread-safe: :meth:`map` runs a batch of calls on a
    thread pool of that size (the waiting is on processes, so threads suffice)."""

    def __init__(self, limits: SandboxLimits | None = None, *, max_concurrent: int = 4,
                 isolation: str = "auto"):
        if not isinstance(max_concurrent, int) or max_concurrent < 1:
            raise ValueError(f"max_concurrent={max_concurrent!r}: must be an int >= 1")
        self.limits = limits or SandboxLimits()
        self.max_concurrent = max_concurrent
        self.mode = _resolve(isolation)
        self._slots: queue.Queue[int] = queue.Queue()
        for s in range(max_concurrent):
            self._slots.put(s)

    def run(self, code: str, tests: Sequence, *, kind: str = "assert",
            fn_name: str | None = None) -> SandboxResult:
        """Run ``code`` then each test: ``kind="assert"``: ``tests`` are Python statements
        (``assert f(2) == 3``) run in the code's namespace; ``"stdio"``: ``(stdin, expected
        stdout)`` pairs, the whole program run once per pair; ``"call"``: ``(args, expected)``
        pairs, ``fn_name`` (a function, or a method of ``Solution``) called with them."""
        slot = self._slots.get()
        try:
            return self._run(slot, code, list(tests), kind, fn_name)
        finally:
            self._slots.put(slot)

    def map(self, calls: Sequence[dict]) -> list[SandboxResult]:
        """:meth:`run` for each ``dict`` of its keyword arguments, ``max_concurrent`` at once, in
        input order."""
        if self.max_concurrent == 1 or len(calls) <= 1:
            return [self.run(**c) for c in calls]
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(self.max_concurrent, thread_name_prefix="sandbox") as ex:
            return list(ex.map(lambda c: self.run(**c), calls))

    def _run(self, slot: int, code: str, tests: list, kind: str,
             fn_name: str | None) -> SandboxResult:
        lim = self.limits
        nonce = secrets.token_hex(16)
        scratch = tempfile.mkdtemp(prefix="verl-sandbox-")
        os.chmod(scratch, 0o755)
        namespaced = self.mode != "rlimits"
        # as root, its own uid per slot, so RLIMIT_NPROC counts its processes alone; else the
        # limit counts this uid's processes too: allow that many more
        uid = SANDBOX_UID_BASE + slot if self.mode == "namespaces" else None
        nproc = lim.max_processes if uid is not None else _own_processes() + lim.max_processes
        setup = {"mode": self.mode, "root": scratch, "binds": _binds() if namespaced else [],
                 "uid": uid, "cpu_s": lim.cpu_limit_s, "memory_mb": int(lim.memory_mb),
                 "file_size_mb": int(lim.file_size_mb), "tmpfs_mb": 2 * int(lim.file_size_mb) + 1,
                 "nproc": int(nproc)}
        home = "/work" if namespaced else scratch
        env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": home, "TMPDIR": home,
               "PYTHONHASHSEED": "0"}
        cmd = [_python(), "-S", "-s", "-P", "-c", _HARNESS, json.dumps(setup)]
        if namespaced:
            cmd = _unshare_cmd(userns=self.mode == "userns") + cmd
        payload = json.dumps({"nonce": nonce, "code": code, "tests": tests, "kind": kind,
                              "fn_name": fn_name}).encode()
        t0 = time.perf_counter()
        try:
            proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                    stderr=subprocess.STDOUT, env=env, cwd=scratch,
                                    start_new_session=True, close_fds=True)
        except OSError as e:
            shutil.rmtree(scratch, ignore_errors=True)
            raise SandboxError(f"code sandbox: could not start {cmd[0]}: {e}") from e
        cpu = 0.0
        try:
            data, why = _exchange(proc, payload, t0 + lim.timeout_s, lim.max_output_bytes)
        finally:
            cpu = _kill_group(proc)
            shutil.rmtree(scratch, ignore_errors=True)
        seconds = time.perf_counter() - t0
        return _parse(data, nonce, len(tests), why, proc.returncode, seconds,
                      cpu_spent=cpu >= lim.cpu_limit_s - 0.05)


def _own_processes() -> int:
    """Processes and threads of this uid now (RLIMIT_NPROC counts them all), for the fallback."""
    uid, n = os.getuid(), 0
    try:
        for pid in os.listdir("/proc"):
            if pid.isdigit():
                try:
                    if os.stat(f"/proc/{pid}").st_uid == uid:
                        n += len(os.listdir(f"/proc/{pid}/task"))
                except OSError:
                    pass
    except OSError:
        return 4096
    return n


def _exchange(proc: subprocess.Popen, payload: bytes, deadline: float,
              max_bytes: int) -> tuple[bytes, str | None]:
    """Send the payload, read the output until EOF -> (output, None), or until the deadline
    (``"timeout"``) or ``max_bytes`` (``"output"``)."""
    try:
        proc.stdin.write(payload)
        proc.stdin.close()
    except (BrokenPipeError, OSError):
        pass
    buf = bytearray()
    fd = proc.stdout.fileno()
    with selectors.DefaultSelector() as sel:
        sel.register(fd, selectors.EVENT_READ)
        while True:
            left = deadline - time.perf_counter()
            if left <= 0:
                return bytes(buf), "timeout"
            if not sel.select(left):
                continue
            chunk = os.read(fd, 65536)
            if not chunk:
                return bytes(buf), None
            buf += chunk
            if len(buf) > max_bytes:
                return bytes(buf[:max_bytes]), "output"


def _kill_group(proc: subprocess.Popen) -> float:
    """Kill the call's process group and reap it -> the CPU seconds it and the children it
    waited for used (``unshare`` reports a killed child as exit status 1, so the CPU time is
    what tells that the hard CPU limit ended it)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
        cpu = usage.ru_utime + usage.ru_stime
    except ChildProcessError:  # already reaped
        proc.wait()
        cpu = 0.0
    proc.stdout.close()
    return cpu


def _parse(data: bytes, nonce: str, total: int, why: str | None, returncode: int,
           seconds: float, cpu_spent: bool = False) -> SandboxResult:
    """The result from the harness's nonce-prefixed lines; ``why``: what the parent stopped it
    for (``timeout``, ``output``); ``cpu_spent``: it used its whole CPU time."""
    prefix = nonce + " "
    ready = done = False
    passed, limit, detail = set(), why, ""
    for line in data.decode("utf-8", errors="replace").splitlines():
        if not line.startswith(prefix):
            continue
        try:
            parts = json.loads(line[len(prefix):])
        except ValueError:
            continue
        tag = parts[0]
        if tag == "ready":
            ready = True
        elif tag == "done":
            done = True
        elif tag == "limit":
            limit = limit or parts[1]
        elif tag == "load":
            detail = f"{parts[1]}: {parts[3]}"
            limit = limit or _limit_of(parts[1:])
        elif tag == "test":
            i, ok = parts[1], parts[2]
            if ok is True and isinstance(i, int) and 0 <= i < total:
                passed.add(i)
            elif len(parts) > 3:
                detail = detail or f"test {i}: {parts[3]}: {parts[5]}"
                limit = limit or _limit_of(parts[3:])
    if not ready and why is None:
        text = data.decode("utf-8", errors="replace").strip()[-400:]
        raise SandboxError(f"code sandbox: the harness did not start (exit status {returncode}): "
                           f"{text or 'no output'}; if the namespaces could not be set up, "
                           "reward.sandbox_isolation=rlimits runs without them")
    if not done and limit is None:
        # killed without a report of its own: RLIMIT_CPU's SIGKILL (the code ignored SIGXCPU;
        # unshare reports a killed child as exit status 1), or the OOM killer
        sig = -returncode if returncode and returncode < 0 else None
        limit = "cpu" if cpu_spent or sig == signal.SIGXCPU else None
        detail = detail or f"ended before its tests finished (exit status {returncode})"
    return SandboxResult(passed=len(passed), total=total, limit=limit, detail=detail,
                         seconds=seconds)

