"""Scoring a batch of responses: rule scorers in-process, custom scorers in worker processes.

``scorer`` is a ``reward.scorer`` value:

- ``auto``: :func:`~verl_core.reward.registry.default_compute_score`, by each row's data_source;
- ``arithmetic`` / ``gsm8k``: that rule scorer for every row;
- anything else: a custom ``file.py:function`` / ``module:function`` spec (see ``custom.py``).

Rule scorers are ours, fast and trusted, so they run in-process with no timeout; those that run
the response's code (``code``, ``registry.RUNS_CODE``) start one sandboxed process per call
(``reward/sandbox.py``: its own limits and wall clock), at most ``sandbox_max_concurrent`` at
once, from a thread pool (the waiting is on processes). A custom
scorer is user code that may hang or crash, so the parent never imports it: it is loaded and
called only in ``pebble.ProcessPool`` workers, each under a deadline.

- Loading: :class:`RewardScorer` loads the scorer in a worker when it starts its pool, within
  ``import_timeout_s``, before its first call. A scorer that raises, hangs or kills its process
  while importing is a :class:`~verl_core.reward.custom.ScorerLoadError` naming it and what
  happened (permanent).
- Calls: each call has ``timeout_s``. The worker interrupts an overrunning call itself
  (SIGALRM), so a timeout costs ``timeout_s`` and the worker lives on. pebble kills the worker
  only when a call ignores that (stuck in C code, or catching BaseException), ``import_timeout_s``
  + 2 s after its deadline; the respawn then costs a process start. A timed-out call scores
  ``timeout_score`` and is counted; every batch with timeouts logs a warning, and one where more
  than ``max_timeout_fraction`` of the calls timed out fails with :class:`ScorerTimeoutError` (or
  only warns, with ``on_timeouts="warn"``).
- A scorer that raises, returns a non-number or a non-finite number (``10**400``, NaN), or kills
  its worker is a bug in the scorer, not a reward: :class:`ScorerError` names the scorer, the row
  (index, data_source, ground truth) and the value. All these errors are permanent: retrying the
  phase would only repeat them.

Workers start from a ``forkserver`` (``spawn`` where unavailable), never a plain ``fork`` of a
parent that may hold torch/Ray threads, and load the scorer themselves from its spec, so
file-path scorers work without pickling functions. Cost: like any spawn/forkserver child, a
worker re-runs the parent's ``__main__`` script as ``__mp_main__`` when it starts (Python 3.11's
forkserver does not preload it): ~0.2 s under ``python -m pytest``, ~2-3 s under a script that
imports torch or flytekit. Workers start in parallel, once per :class:`RewardScorer` (and again
after a hard kill), so keep one ``RewardScorer`` open across steps. A ``__main__`` read from
stdin cannot start workers at all (a :class:`ScorerError` says the pool broke).

Responses reach every scorer as :func:`~verl_core.reward.decode.decode_responses` makes them: cut
at the first EOS, special tokens kept as text. A response with a special token before its EOS
is a wrong answer for the rule scorers (0.0); custom scorers see it and decide.
"""

from __future__ import annotations

import logging
import math
import multiprocessing
import numbers
import pickle
import reprlib
import signal
import traceback
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Sequence

from verl_core.alarm import alarm
from verl_core.errors import PermanentError
from verl_core.reward.custom import ScorerLoadError, load_scorer, parse_spec
from verl_core.reward.registry import (RULE_SCORERS, RUNS_CODE, UnknownDataSourceError,
                                       call_rule_scorer, default_compute_score, scorer_for)
from verl_core.reward.sandbox import Sandbox, SandboxLimits
from verl_core.reward.sandbox_fusion import SandboxFusion, SandboxUnavailableError

if TYPE_CHECKING:
    from verl_core.reward.config import RewardConfig

__all__ = ["RewardResult", "ScorerError", "ScorerTimeoutError", "RewardScorer", "score_responses",
           "BUILTIN_SCORERS", "ON_TIMEOUTS"]

log = logging.getLogger(__name__)

BUILTIN_SCORERS = ("auto", *RULE_SCORERS)
"""``reward.scorer`` values run in-process; every other value is a custom spec."""
ON_TIMEOUTS = ("fail", "warn")
"""What a batch with more than ``max_timeout_fraction`` timed-out calls does."""
_HARD_GRACE_S = 2.0
"""Beyond a call's own deadlines, how long a worker may ignore them before pebble kills it."""

_short = reprlib.Repr()
_short.maxstring = _short.maxother = 80
_short.maxlong = 40


@dataclass(frozen=True)
class RewardResult:
    """Scores of N responses, in input order."""

    scores: list[float]
    """(N,) one score per response; ``timeout_score`` where the scorer timed out."""
    extras: dict[str, list]
    """Extra keys of dict-returning scorers -> (N,) values, None where a call did not return the
    key (or timed out). Keys in order of first appearance."""
    num_timeouts: int
    """How many calls timed out (= sum(timed_out))."""
    timed_out: list[bool]
    """(N,) whether each call timed out."""
    special_token: list[bool] = field(default_factory=list)
    """(N,) whether a response had a special token before its EOS (empty when not given)."""


class ScorerError(PermanentError, RuntimeError):
    """A scorer raised, returned a non-number or a non-finite number, or its worker died. The
    message names the scorer spec, the row and the original exception or value."""


class ScorerTimeoutError(ScorerError):
    """More than ``max_timeout_fraction`` of a batch's calls timed out (``on_timeouts="fail"``):
    the scorer hangs, or ``timeout_s`` is too small for it."""


def _row(index: int, data_source, ground_truth) -> str:
    return (f"sample {index} (data_source={_short.repr(data_source)}, "
            f"ground_truth={_short.repr(ground_truth)})")


def _as_score(value: Any, scorer: str, row: str) -> tuple[float, dict]:
    """Validate one scorer return value -> (score, extras); ``row`` describes the sample."""
    extra: dict = {}
    raw = value
    if isinstance(value, dict):
        if "score" not in value:
            raise ScorerError(f"scorer {scorer!r} returned a dict without a 'score' key for {row}: "
                              f"keys {sorted(map(str, value))}; return a float or "
                              "{'score': float, ...}")
        extra = {k: v for k, v in value.items() if k != "score"}
        value = value["score"]
    if hasattr(value, "item") and not isinstance(value, numbers.Real):  # 0-d tensor / array
        try:
            value = value.item()
        except Exception:
            pass
    if not isinstance(value, numbers.Real):
        raise ScorerError(f"scorer {scorer!r} returned {_short.repr(raw)} ({type(raw).__name__}) "
                          f"for {row}; it must return a number or a dict with a numeric 'score'")
    try:
        score = float(value)
    except (OverflowError, ValueError):  # e.g. 10**400: a valid int, but no float
        score, why = math.inf, f" ({type(value).__name__} beyond float range)"
    else:
        why = ""
    if not math.isfinite(score):
        raise ScorerError(f"scorer {scorer!r} returned a non-finite score "
                          f"{_short.repr(value)}{why} for {row}; rewards must be finite floats")
    return score, extra


# ---------------------------------------------------------------- worker side
_WORKER_SCORERS: dict[str, Callable] = {}


class _Deadline(BaseException):
    """Raised in a worker by SIGALRM when an import or call overruns. A BaseException, so a
    scorer's own ``except Exception`` does not swallow it."""


def _deadline(seconds: float):
    """Interrupt the block with :class:`_Deadline` after ``seconds``. pebble runs tasks on the
    worker's main thread, where signal handlers run. Without ``setitimer`` (Windows), or when a
    scorer installs its own SIGALRM handler, only the parent's hard timeout applies."""
    return alarm(seconds, _Deadline)


def _worker_load(spec: str, import_timeout_s: float) -> tuple:
    """Load the scorer in this worker, once -> ``("ok",)`` or ``("load_error", message)``."""
    if spec in _WORKER_SCORERS:
        return ("ok",)
    try:
        with _deadline(import_timeout_s):
            fn = load_scorer(spec)
    except _Deadline:
        return "load_error", (f"custom scorer {spec!r}: loading it did not finish within "
                              f"reward.import_timeout_s={import_timeout_s:g}s; does the module "
                              "hang at import (a sleep, a lock, a server that never answers)?")
    except ScorerLoadError as e:
        return "load_error", str(e)
    except BaseException as e:  # SystemExit, KeyboardInterrupt raised by the import
        return "load_error", (f"custom scorer {spec!r}: importing it raised "
                              f"{type(e).__name__}: {e}")
    _WORKER_SCORERS[spec] = fn
    return ("ok",)


def _worker_call(spec: str, import_timeout_s: float, timeout_s: float, data_source,
                 solution_str, ground_truth, extra_info) -> tuple:
    """Run one scorer call -> ``("ok", value)``, ``("timeout",)``, ``("load_error", message)`` or
    ``("error", message, traceback)``; exceptions come back as text (they may not be picklable)."""
    loaded = _worker_load(spec, import_timeout_s)  # a no-op once this worker has the scorer
    if loaded[0] != "ok":
        return loaded
    try:
        with _deadline(timeout_s):
            value = _WORKER_SCORERS[spec](data_source, solution_str, ground_truth, extra_info)
    except _Deadline:
        return ("timeout",)
    except BaseException as e:  # incl. SystemExit: it must not surface as one in the parent
        return "error", f"{type(e).__name__}: {e}", traceback.format_exc()
    try:  # an unpicklable result would otherwise kill the worker while sending it back
        pickle.dumps(value)
    except Exception as e:
        return "error", (f"returned {type(value).__name__} that cannot be sent back from the "
                         f"worker (not picklable: {type(e).__name__}: {e})"), ""
    return "ok", value


def _mp_context():
    methods = multiprocessing.get_all_start_methods()
    return multiprocessing.get_context("forkserver" if "forkserver" in methods else "spawn")


def _exit_text(code) -> str:
    if code is not None and code < 0:
        try:
            return f"killed by signal {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


# ---------------------------------------------------------------- parent side
class RewardScorer:
    """Scores batches with one scorer; for custom scorers, holds a worker pool across batches.

    For a custom scorer, the first :meth:`score` (or an explicit :meth:`start`) starts the pool
    and loads the scorer in a worker; one that cannot load raises :class:`ScorerLoadError`
    there. Use as a context manager (or call :meth:`close`) so the workers are stopped.
    """

    def __init__(self, scorer: str = "auto", *, timeout_s: float = 10.0,
                 timeout_score: float = 0.0, num_workers: int = 2,
                 import_timeout_s: float = 60.0, max_timeout_fraction: float = 0.5,
                 on_timeouts: str = "fail", sandbox_limits: SandboxLimits | None = None,
                 sandbox_max_concurrent: int = 4, sandbox_isolation: str = "auto",
                 sandbox_url: str = ""):
        for name, v in (("timeout_s", timeout_s), ("import_timeout_s", import_timeout_s)):
            if not (isinstance(v, numbers.Real) and math.isfinite(v) and v > 0):
                raise ValueError(f"{name}={v!r}: must be a finite number > 0")
        if not math.isfinite(timeout_score):
            raise ValueError(f"timeout_score={timeout_score!r}: must be finite")
        if not isinstance(num_workers, int) or num_workers <= 0:
            raise ValueError(f"num_workers={num_workers!r}: must be an int > 0")
        if not 0.0 <= max_timeout_fraction <= 1.0:
            raise ValueError(f"max_timeout_fraction={max_timeout_fraction!r}: must be in [0, 1]")
        if on_timeouts not in ON_TIMEOUTS:
            raise ValueError(f"on_timeouts={on_timeouts!r}: known: {', '.join(ON_TIMEOUTS)}")
        self.scorer = scorer
        self.timeout_s = float(timeout_s)
        self.timeout_score = float(timeout_score)
        self.num_workers = num_workers
        self.import_timeout_s = float(import_timeout_s)
        self.max_timeout_fraction = float(max_timeout_fraction)
        self.on_timeouts = on_timeouts
        self.sandbox_limits = sandbox_limits or SandboxLimits()
        if not isinstance(sandbox_max_concurrent, int) or sandbox_max_concurrent < 1:
            raise ValueError(f"sandbox_max_concurrent={sandbox_max_concurrent!r}: must be an "
                             "int >= 1")
        self.sandbox_max_concurrent = sandbox_max_concurrent
        self.sandbox_isolation = sandbox_isolation
        self.sandbox_url = sandbox_url
        self._sandbox: Sandbox | SandboxFusion | None = None
        self._pool = None
        if self.is_custom:
            parse_spec(scorer)  # a malformed spec fails here, before any process starts

    @classmethod
    def from_config(cls, cfg: "RewardConfig") -> "RewardScorer":
        """The scorer a run's ``reward`` config section describes."""
        return cls(cfg.scorer, timeout_s=cfg.timeout_s, timeout_score=cfg.timeout_score,
                   num_workers=cfg.num_workers, import_timeout_s=cfg.import_timeout_s,
                   max_timeout_fraction=cfg.max_timeout_fraction, on_timeouts=cfg.on_timeouts,
                   sandbox_limits=SandboxLimits(timeout_s=cfg.sandbox_timeout_s,
                                                memory_mb=cfg.sandbox_memory_mb),
                   sandbox_max_concurrent=cfg.sandbox_max_concurrent,
                   sandbox_isolation=cfg.sandbox_isolation, sandbox_url=cfg.sandbox_url)

    @property
    def is_custom(self) -> bool:
        return self.scorer not in BUILTIN_SCORERS

    def score(self, data_sources: Sequence[str], solution_strs: Sequence[str],
              ground_truths: Sequence[str], extra_infos: Sequence[dict | None] | None = None,
              *, special_token: Sequence[bool] | None = None) -> RewardResult:
        """Score N responses (all sequences of length N). Deterministic, in input order.

        ``special_token``: (N,) from :func:`~verl_core.reward.decode.decode_responses`; rule
        scorers score a flagged response 0.0 (a wrong answer) without reading it, custom scorers
        are called as usual."""
        n = len(solution_strs)
        if extra_infos is None:
            extra_infos = [None] * n
        special = [bool(f) for f in special_token] if special_token is not None else [False] * n
        lengths = {"data_sources": len(data_sources), "solution_strs": n,
                   "ground_truths": len(ground_truths), "extra_infos": len(extra_infos),
                   "special_token": len(special)}
        if len(set(lengths.values())) != 1:
            raise ValueError(f"score: inputs differ in length: {lengths}")
        if self.is_custom:
            raw, timed_out = self._score_custom(data_sources, solution_strs, ground_truths,
                                                extra_infos)
        else:
            raw, timed_out = self._score_rule(data_sources, solution_strs, ground_truths,
                                              extra_infos, special), [False] * n
        scores: list[float] = []
        extras: dict[str, list] = {}
        for i, value in enumerate(raw):
            if timed_out[i]:
                scores.append(self.timeout_score)
                continue
            score, extra = _as_score(value, self.scorer,
                                     _row(i, data_sources[i], ground_truths[i]))
            scores.append(score)
            for k, v in extra.items():
                extras.setdefault(k, [None] * n)[i] = v
        num_timeouts = sum(timed_out)
        if num_timeouts:
            self._report_timeouts(num_timeouts, n)
        return RewardResult(scores=scores, extras=extras, num_timeouts=num_timeouts,
                            timed_out=timed_out,
                            special_token=special if special_token is not None else [])

    def _report_timeouts(self, k: int, n: int) -> None:
        msg = (f"custom scorer {self.scorer!r}: {k} of {n} calls timed out after "
               f"reward.timeout_s={self.timeout_s:g}s and scored "
               f"reward.timeout_score={self.timeout_score:g}")
        if k / n > self.max_timeout_fraction and self.on_timeouts == "fail":
            raise ScorerTimeoutError(
                f"{msg}; that is more than reward.max_timeout_fraction="
                f"{self.max_timeout_fraction:g} of the batch, so these rewards would be noise: "
                "fix the scorer if it hangs, raise reward.timeout_s if it is just slow, or set "
                "reward.on_timeouts='warn' to train on them anyway")
        log.warning(msg)

    def sandbox(self) -> Sandbox | SandboxFusion:
        """The sandbox (limits, pool) the code-running rule scorers get, made on first use: the
        local one, or the SandboxFusion service at ``sandbox_url``."""
        if self._sandbox is None and self.sandbox_url:
            self._sandbox = SandboxFusion(self.sandbox_url, self.sandbox_limits,
                                          max_concurrent=self.sandbox_max_concurrent)
        if self._sandbox is None:
            self._sandbox = Sandbox(self.sandbox_limits,
                                    max_concurrent=self.sandbox_max_concurrent,
                                    isolation=self.sandbox_isolation)
        return self._sandbox

    def _score_rule(self, data_sources, solution_strs, ground_truths, extra_infos,
                    special) -> list:
        n = len(solution_strs)
        names = [self.scorer if self.scorer != "auto" else scorer_for(data_sources[i])
                 for i in range(n)]
        # rows whose scorer runs their code: one sandboxed process each, in a bounded pool
        sandboxed = [i for i in range(n) if not special[i] and names[i] in RUNS_CODE]
        futures = {}
        if sandboxed:
            from concurrent.futures import ThreadPoolExecutor

            sb = self.sandbox()
            pool = ThreadPoolExecutor(sb.max_concurrent, thread_name_prefix="sandbox")
            futures = {i: pool.submit(RULE_SCORERS[names[i]], solution_strs[i],
                                      ground_truths[i], sandbox=sb) for i in sandboxed}
        out = []
        try:
            for i in range(n):  # in index order: the first failure is deterministic
                if special[i]:  # a special token inside the answer: wrong, whatever it says
                    out.append(0.0)
                    continue
                try:
                    if i in futures:
                        out.append(futures[i].result())
                    elif self.scorer == "auto":
                        out.append(default_compute_score(data_sources[i], solution_strs[i],
                                                         ground_truths[i], extra_infos[i]))
                    else:
                        out.append(call_rule_scorer(self.scorer, solution_strs[i],
                                                    ground_truths[i], extra_infos[i]))
                except (UnknownDataSourceError, SandboxUnavailableError):
                    raise  # a config problem or an outage, with its own fix in the message
                except Exception as e:
                    raise ScorerError(f"scorer {names[i] or self.scorer!r} failed on "
                                      f"{_row(i, data_sources[i], ground_truths[i])}: "
                                      f"{type(e).__name__}: {e}") from e
        finally:
            if futures:
                pool.shutdown(wait=True, cancel_futures=True)
        return out

    def start(self) -> None:
        """Start the worker pool and load the scorer in one worker, under the import deadline
        (a no-op for rule scorers and once started)."""
        if not self.is_custom or self._pool is not None:
            return
        import pebble  # only custom scorers need it
        from pebble import ProcessExpired

        self._pool = pebble.ProcessPool(max_workers=self.num_workers, context=_mp_context())
        spec = self.scorer
        try:
            fut = self._pool.schedule(_worker_load, args=(spec, self.import_timeout_s),
                                      timeout=self.import_timeout_s + _HARD_GRACE_S)
            try:
                result = fut.result()
            except TimeoutError:  # the import ignored SIGALRM (stuck in C code)
                raise ScorerLoadError(
                    f"custom scorer {spec!r}: loading it did not finish within "
                    f"reward.import_timeout_s={self.import_timeout_s:g}s and its worker had to "
                    "be killed; does the module hang at import?") from None
            except ProcessExpired as e:
                raise ScorerLoadError(
                    f"custom scorer {spec!r}: importing it killed its worker process "
                    f"({_exit_text(e.exitcode)}); does the module call os._exit, crash the "
                    "interpreter or run out of memory at import?") from None
            except Exception as e:  # BrokenProcessPool: the worker died before it could report
                raise ScorerError(
                    f"custom scorer {spec!r}: its worker process died before loading it "
                    f"finished ({type(e).__name__}: {e}). Either importing the scorer kills the "
                    "process (os._exit, a crash), or workers cannot start: they re-run the "
                    "__main__ script, which must guard its code with "
                    "`if __name__ == '__main__':` and not be read from stdin") from e
            if result[0] != "ok":
                raise ScorerLoadError(result[1])
        except BaseException:
            self.close()
            raise

    def _score_custom(self, data_sources, solution_strs, ground_truths, extra_infos):
        from concurrent.futures import CancelledError

        from pebble import ProcessExpired

        self.start()
        pool = self._pool
        # the hard timeout is a backstop: a worker that has not loaded the scorer yet (or was
        # respawned) imports it first, within import_timeout_s, then calls it within timeout_s
        hard_timeout = self.import_timeout_s + self.timeout_s + _HARD_GRACE_S
        futures = [pool.schedule(_worker_call, args=(self.scorer, self.import_timeout_s,
                                                     self.timeout_s, data_sources[i],
                                                     solution_strs[i], ground_truths[i],
                                                     extra_infos[i]),
                                 timeout=hard_timeout)
                   for i in range(len(solution_strs))]
        raw: list = [None] * len(futures)
        timed_out = [False] * len(futures)
        try:
            for i, fut in enumerate(futures):  # in index order: the first failure is deterministic
                row = _row(i, data_sources[i], ground_truths[i])
                try:
                    result = fut.result()
                except TimeoutError:  # the call ignored the worker's deadline; pebble killed it
                    timed_out[i] = True
                    continue
                except ProcessExpired as e:
                    raise ScorerError(f"scorer {self.scorer!r}: the worker process died while "
                                      f"scoring {row} ({_exit_text(e.exitcode)}); the scorer "
                                      "crashed the interpreter (segfault, os._exit, OOM kill?)"
                                      ) from None
                except CancelledError:
                    raise ScorerError(f"scorer {self.scorer!r}: the call for {row} was "
                                      "cancelled (the pool was closed?)") from None
                except Exception as e:  # e.g. the return value could not be pickled back
                    raise ScorerError(f"scorer {self.scorer!r}: the call for {row} failed "
                                      f"in the worker pool: {type(e).__name__}: {e}") from e
                if result[0] == "timeout":
                    timed_out[i] = True
                    continue
                if result[0] == "load_error":  # a worker other than the first failed to load it
                    raise ScorerLoadError(result[1])
                if result[0] == "error":
                    tb = f"\nworker traceback:\n{result[2]}" if result[2] else ""
                    raise ScorerError(f"scorer {self.scorer!r} failed on {row}: {result[1]}{tb}")
                raw[i] = result[1]
        except BaseException:
            for fut in futures:
                fut.cancel()
            raise
        return raw, timed_out

    def close(self) -> None:
        """Stop the worker pool (if any). Safe to call twice."""
        pool, self._pool = getattr(self, "_pool", None), None
        if pool is not None:
            pool.stop()
            pool.join(timeout=10)

    def __enter__(self) -> "RewardScorer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


def score_responses(scorer: str, data_sources: Sequence[str], solution_strs: Sequence[str],
                    ground_truths: Sequence[str], extra_infos: Sequence[dict | None] | None = None,
                    *, special_token: Sequence[bool] | None = None, **options) -> RewardResult:
    """Score N responses once (a pool, if needed, lives only for this call); ``options`` are
    :class:`RewardScorer`'s. To score many batches with a custom scorer, keep a
    :class:`RewardScorer` open instead."""
    with RewardScorer(scorer, **options) as rs:
        return rs.score(data_sources, solution_strs, ground_truths, extra_infos,
                        special_token=special_token)
