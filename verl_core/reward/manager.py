"""Scoring a batch of responses: rule scorers in-process, custom scorers in worker processes.

``scorer`` is a ``reward.scorer`` value:

- ``auto``: :func:`~verl_core.reward.registry.default_compute_score`, by each row's data_source;
- ``arithmetic`` / ``gsm8k``: that rule scorer for every row;
- anything else: a custom ``file.py:function`` / ``module:function`` spec (see ``custom.py``).

Rule scorers are ours, fast and trusted, so they run in-process with no timeout. A custom
scorer is user code that may hang (a regex blow-up, a sandbox that never answers), so every call
runs in a ``pebble.ProcessPool`` worker with a per-call timeout: a call that overruns is killed
and scores ``timeout_score`` (counted, never a hung run). A scorer that raises or returns a
non-number is a bug in the scorer, not a reward, so it fails the batch with :class:`ScorerError`.

Workers start from a ``forkserver`` (``spawn`` where unavailable), never a plain ``fork`` of a
parent that may hold torch/Ray threads, and load the scorer themselves from its spec, so
file-path scorers work without pickling functions. Cost: like any spawn/forkserver child, a
worker re-runs the parent's ``__main__`` script as ``__mp_main__`` when it starts (Python 3.11's
forkserver does not preload it): ~0.2 s under ``python -m pytest``, ~2-3 s under a script that
imports torch or flytekit. Workers start in parallel, once per :class:`RewardScorer` and again
after each timeout kill, so keep one ``RewardScorer`` open across steps. A ``__main__`` read
from stdin cannot start workers at all (a :class:`ScorerError` says the pool broke).
"""

from __future__ import annotations

import math
import multiprocessing
import numbers
import pickle
import traceback
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from verl_core.reward.custom import load_scorer
from verl_core.reward.registry import RULE_SCORERS, UnknownDataSourceError, default_compute_score

__all__ = ["RewardResult", "ScorerError", "RewardScorer", "score_responses", "BUILTIN_SCORERS"]

BUILTIN_SCORERS = ("auto", *RULE_SCORERS)
"""``reward.scorer`` values run in-process; every other value is a custom spec."""


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


class ScorerError(RuntimeError):
    """A scorer raised, returned a non-number, or its worker died. The message names the scorer
    spec, the sample index and the original exception."""


def _as_score(value: Any, scorer: str, index: int) -> tuple[float, dict]:
    """Validate one scorer return value -> (score, extras)."""
    extra: dict = {}
    raw = value
    if isinstance(value, dict):
        if "score" not in value:
            raise ScorerError(f"scorer {scorer!r} returned a dict without a 'score' key for sample "
                              f"{index}: keys {sorted(value)}; return a float or "
                              "{'score': float, ...}")
        extra = {k: v for k, v in value.items() if k != "score"}
        value = value["score"]
    if hasattr(value, "item") and not isinstance(value, numbers.Real):  # 0-d tensor / array
        try:
            value = value.item()
        except Exception:
            pass
    if not isinstance(value, numbers.Real):
        raise ScorerError(f"scorer {scorer!r} returned {raw!r} ({type(raw).__name__}) for sample "
                          f"{index}; it must return a number or a dict with a numeric 'score'")
    score = float(value)
    if not math.isfinite(score):
        raise ScorerError(f"scorer {scorer!r} returned a non-finite score {score} for sample "
                          f"{index}; rewards must be finite")
    return score, extra


# ---------------------------------------------------------------- worker side
_WORKER_SCORERS: dict[str, Callable] = {}


def _worker_init(spec: str) -> None:
    """Load the scorer when the worker starts, so import time is not charged to a call's timeout.
    A failure here is reported by the first call instead (pebble workers must not die here)."""
    try:
        _WORKER_SCORERS[spec] = load_scorer(spec)
    except Exception:
        pass


def _worker_call(spec: str, data_source, solution_str, ground_truth, extra_info):
    """Run one scorer call; exceptions come back as text (they may not be picklable)."""
    try:
        fn = _WORKER_SCORERS.get(spec)
        if fn is None:
            fn = _WORKER_SCORERS[spec] = load_scorer(spec)
        value = fn(data_source, solution_str, ground_truth, extra_info)
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


# ---------------------------------------------------------------- parent side
class RewardScorer:
    """Scores batches with one scorer; for custom scorers, holds a worker pool across batches.

    Use as a context manager (or call :meth:`close`) so the workers are stopped.
    """

    def __init__(self, scorer: str = "auto", *, timeout_s: float = 10.0,
                 timeout_score: float = 0.0, num_workers: int = 2):
        if not timeout_s > 0:
            raise ValueError(f"timeout_s={timeout_s!r}: must be > 0")
        if not isinstance(num_workers, int) or num_workers <= 0:
            raise ValueError(f"num_workers={num_workers!r}: must be an int > 0")
        self.scorer = scorer
        self.timeout_s = float(timeout_s)
        self.timeout_score = float(timeout_score)
        self.num_workers = num_workers
        self._pool = None
        if scorer not in BUILTIN_SCORERS:
            load_scorer(scorer)  # fail fast, in the caller, on a bad spec

    @property
    def is_custom(self) -> bool:
        return self.scorer not in BUILTIN_SCORERS

    def score(self, data_sources: Sequence[str], solution_strs: Sequence[str],
              ground_truths: Sequence[str], extra_infos: Sequence[dict | None] | None = None
              ) -> RewardResult:
        """Score N responses (all sequences of length N). Deterministic, in input order."""
        n = len(solution_strs)
        if extra_infos is None:
            extra_infos = [None] * n
        lengths = {"data_sources": len(data_sources), "solution_strs": n,
                   "ground_truths": len(ground_truths), "extra_infos": len(extra_infos)}
        if len(set(lengths.values())) != 1:
            raise ValueError(f"score: inputs differ in length: {lengths}")
        if self.is_custom:
            raw, timed_out = self._score_custom(data_sources, solution_strs, ground_truths,
                                                extra_infos)
        else:
            raw, timed_out = self._score_rule(data_sources, solution_strs, ground_truths,
                                              extra_infos), [False] * n
        scores: list[float] = []
        extras: dict[str, list] = {}
        for i, value in enumerate(raw):
            if timed_out[i]:
                scores.append(self.timeout_score)
                continue
            score, extra = _as_score(value, self.scorer, i)
            scores.append(score)
            for k, v in extra.items():
                extras.setdefault(k, [None] * n)[i] = v
        return RewardResult(scores=scores, extras=extras, num_timeouts=sum(timed_out),
                            timed_out=timed_out)

    def _score_rule(self, data_sources, solution_strs, ground_truths, extra_infos) -> list:
        out = []
        for i in range(len(solution_strs)):
            try:
                if self.scorer == "auto":
                    out.append(default_compute_score(data_sources[i], solution_strs[i],
                                                     ground_truths[i], extra_infos[i]))
                else:
                    out.append(RULE_SCORERS[self.scorer](solution_strs[i], ground_truths[i]))
            except UnknownDataSourceError:  # a config problem, with its own fix in the message
                raise
            except Exception as e:
                raise ScorerError(f"scorer {self.scorer!r} failed on sample {i} "
                                  f"(data_source={data_sources[i]!r}): {type(e).__name__}: {e}"
                                  ) from e
        return out

    def _ensure_pool(self):
        if self._pool is None:
            import pebble  # only custom scorers need it

            self._pool = pebble.ProcessPool(max_workers=self.num_workers,
                                            initializer=_worker_init, initargs=(self.scorer,),
                                            context=_mp_context())
        return self._pool

    def _score_custom(self, data_sources, solution_strs, ground_truths, extra_infos):
        from concurrent.futures import CancelledError

        from pebble import ProcessExpired

        pool = self._ensure_pool()
        futures = [pool.schedule(_worker_call, args=(self.scorer, data_sources[i],
                                                     solution_strs[i], ground_truths[i],
                                                     extra_infos[i]),
                                 timeout=self.timeout_s)
                   for i in range(len(solution_strs))]
        raw: list = [None] * len(futures)
        timed_out = [False] * len(futures)
        try:
            for i, fut in enumerate(futures):  # in index order: the first failure is deterministic
                try:
                    result = fut.result()
                except TimeoutError:  # pebble killed the worker; the scorer's own are caught there
                    timed_out[i] = True
                    continue
                except ProcessExpired as e:
                    raise ScorerError(f"scorer {self.scorer!r}: the worker process died while "
                                      f"scoring sample {i} (exit code {e.exitcode}); the scorer "
                                      "crashed the interpreter (segfault, os._exit, OOM kill?)"
                                      ) from None
                except CancelledError:
                    raise ScorerError(f"scorer {self.scorer!r}: the call for sample {i} was "
                                      "cancelled (the pool was closed?)") from None
                except Exception as e:  # e.g. the return value could not be pickled back
                    raise ScorerError(f"scorer {self.scorer!r}: the call for sample {i} failed "
                                      f"in the worker pool: {type(e).__name__}: {e}") from e
                if result[0] == "error":
                    tb = f"\nworker traceback:\n{result[2]}" if result[2] else ""
                    raise ScorerError(f"scorer {self.scorer!r} failed on sample {i} "
                                      f"(data_source={data_sources[i]!r}): {result[1]}{tb}")
                raw[i] = result[1]
        except BaseException:
            for fut in futures:
                fut.cancel()
            raise
        return raw, timed_out

    def close(self) -> None:
        """Stop the worker pool (if any). Safe to call twice."""
        pool, self._pool = self._pool, None
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
                    *, timeout_s: float = 10.0, timeout_score: float = 0.0,
                    num_workers: int = 2) -> RewardResult:
    """Score N responses once (a pool, if needed, lives only for this call). To score many
    batches with a custom scorer, keep a :class:`RewardScorer` open instead."""
    with RewardScorer(scorer, timeout_s=timeout_s, timeout_score=timeout_score,
                      num_workers=num_workers) as rs:
        return rs.score(data_sources, solution_strs, ground_truths, extra_infos)
