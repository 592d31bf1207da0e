"""A SandboxFusion service as the code sandbox (``reward.sandbox_url``, verl's
``reward_model.sandbox_fusion.url``): the same calls as :class:`~verl_core.reward.sandbox.Sandbox`,
each test one ``POST`` to the service's ``/run_code``, as verl's ``sandbox_fusion`` utils send it.

The protocol (SandboxFusion's ``/run_code``, as verl's ``verl/utils/reward_score/sandbox_fusion/
utils.py`` uses it): request ``{"code", "stdin", "language": "python", "compile_timeout",
"run_timeout", "memory_limit_MB", "files": {}, "fetch_files": []}``; response ``{"status":
"Success" | "Failed" | "SandboxError", "run_result": {"status": "Finished" | "TimeLimitExceeded"
| "Error", "stdout", "stderr", "return_code", "execution_time"}, "compile_result": ...}``. A test
passes as in verl: an ``assert`` test when the code with the assert appended runs to the end
(``Success``, return code 0); a stdin/stdout test when, besides, its stdout matches (line by
line, trailing white space ignored, as the local sandbox); an ``fn_name`` test when the value the
function returns (printed as JSON by a wrapper appended to the code) equals the expected one.

Unlike verl, a service that cannot be reached or answers with an HTTP error or a
``SandboxError`` is not a failed test (verl scores it -1, a wrong answer): it is a
:class:`SandboxUnavailableError` naming the URL, so an outage fails the reward phase instead of
training on zeros. verl's retries of a 504 (three tries, 1 s then 2 s apart) are kept.
"""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from typing import Sequence

from verl_core.errors import TransientError
from verl_core.reward.sandbox import SandboxLimits, SandboxResult

__all__ = ["SandboxFusion", "SandboxUnavailableError"]

_CALL_WRAPPER = """

import json as _json, sys as _sys
_args = _json.loads(_sys.stdin.read())
_fn = globals().get({name!r}) or getattr(globals()["Solution"](), {name!r})
_out = _fn(*_args)
print(_json.dumps(list(_out) if isinstance(_out, tuple) else _out))
"""


class SandboxUnavailableError(TransientError):
    """The SandboxFusion service could not be reached or failed (not the response's fault)."""


def _lines(s) -> list[str]:
    return [ln.rstrip() for ln in str(s).rstrip().splitlines()]


class SandboxFusion:
    """Runs code against tests on a SandboxFusion service at ``url`` (its ``/run_code``), at most
    ``max_concurrent`` requests at once (verl's ``sandbox_fusion.max_concurrent``)."""

    mode = "sandbox_fusion"

    def __init__(self, url: str, limits: SandboxLimits | None = None, *,
                 max_concurrent: int = 4):
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"reward.sandbox_url={url!r}: must be an http(s) URL of a "
                             "SandboxFusion service's /run_code, e.g. http://host:8080/run_code")
        self.url, self.limits, self.max_concurrent = url, limits or SandboxLimits(), max_concurrent
        self._slots = threading.BoundedSemaphore(max_concurrent)

    def run(self, code: str, tests: Sequence, *, kind: str = "assert",
            fn_name: str | None = None) -> SandboxResult:
        """As :meth:`verl_core.reward.sandbox.Sandbox.run`: one request per test."""
        t0 = time.perf_counter()
        passed, detail = 0, ""
        for t in tests:
            if kind == "assert":
                res = self._post(code + "\n\n" + t, None)
                ok = _finished(res)
            elif kind == "stdio":
                res = self._post(code, t[0])
                ok = _finished(res) and _lines(res["run_result"].get("stdout") or "") == \
                    _lines(t[1])
            else:
                args = t[0] if isinstance(t[0], list) else \
                    [json.loads(x) for x in str(t[0]).splitlines()]
                res = self._post(code + _CALL_WRAPPER.format(name=fn_name), json.dumps(args))
                ok = False
                if _finished(res):
                    try:
                        got = json.loads(res["run_result"].get("stdout") or "null")
                    except ValueError:
                        got = None
                    want = t[1]
                    ok = got == want or (isinstance(want, list) and len(want) > 0
                                         and got == want[0])
            passed += bool(ok)
            if not ok and not detail:
                rr = res.get("run_result") or {}
                detail = f"{res.get('status')}: {rr.get('status')} {str(rr.get('stderr'))[:200]}"
        return SandboxResult(passed=passed, total=len(tests), detail=detail,
                             seconds=time.perf_counter() - t0)

    def _post(self, code: str, stdin: str | None) -> dict:
        lim = self.limits
        run_timeout = max(1, round(lim.timeout_s))
        body = json.dumps({"code": code, "stdin": stdin, "language": "python",
                           "compile_timeout": run_timeout, "run_timeout": run_timeout,
                           "memory_limit_MB": int(lim.memory_mb), "files": {},
                           "fetch_files": []}).encode()
        req = urllib.request.Request(self.url, data=body, method="POST",
                                     headers={"Content-Type": "application/json",
                                              "Accept": "application/json"})
        with self._slots:
            for attempt in range(3):
                try:
                    with urllib.request.urlopen(req, timeout=2 * run_timeout + 10) as r:
                        res = json.loads(r.read(lim.max_output_bytes * 4 + 65536))
                    break
                except urllib.error.HTTPError as e:
                    if e.code == 504 and attempt < 2:  # verl retries a gateway timeout
                        time.sleep(attempt + 1)
                        continue
                    raise SandboxUnavailableError(
                        f"SandboxFusion at {self.url} answered HTTP {e.code} {e.reason}; check "
                        "the service (reward.sandbox_url)") from None
                except (urllib.error.URLError, OSError, ValueError) as e:
                    raise SandboxUnavailableError(
                        f"SandboxFusion at {self.url} could not be used ({type(e).__name__}: "
                        f"{e}); is the service up? (reward.sandbox_url)") from None
        if not isinstance(res, dict) or res.get("status") == "SandboxError":
            raise SandboxUnavailableError(f"SandboxFusion at {self.url} failed to run the code: "
                                          f"{str(res)[:300]}")
        return res


def _finished(res: dict) -> bool:
    rr = res.get("run_result") or {}
    return res.get("status") == "Success" and rr.get("status") == "Finished" and \
        rr.get("return_code") == 0
