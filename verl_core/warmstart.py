"""The tiny model's supervised warm start as a durable, visible phase.

The warm start (``training/sft.py``, up to ``model.warmup_sft_steps`` steps) is the longest thing a
newcomer's first run does before its first RL step. Here it:

- **talks**: a progress line at least every :data:`PROGRESS_S` seconds (step, loss, the training
  slice's accuracy against its target, rate, ETA);
- **keeps its work**: its whole state (weights, AdamW moments, LR schedule, the sampling
  generator, the losses so far) is saved into the run store every :data:`SAVE_EVERY_S` seconds
  and when SIGINT/SIGTERM arrives (``interrupt.py``), as an object named by a doc
  ``assets/warmstart/<key>`` (a gc root: garbage collection keeps what it names). The same
  command resumes from it, and the steps that follow are the uninterrupted run's bit for bit;
- **is reused**: its finished model folder is stored under the same doc and copied into a
  private per-user cache (``engine/assets.py``'s cache root), so another run whose warm start has
  the same inputs (``key``: :func:`warm_start_key`) takes it at once, whatever its RL settings.

What does not belong here: the supervised loop itself (``training/sft.py``), the tiny model and
the targets (``assets.py``, ``tiny_warmup.py``), what the run records as its assets
(``prepare.py``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import os
import shutil
import tempfile
import time

import torch

from verl_core import interrupt
from verl_core.guard.faults import maybe_inject
from verl_core.layout import warm_start_doc
from verl_core.local_cache import cache_root
from verl_core.local_cache import file_sha256 as _file_sha
from verl_core.local_cache import files_under as _files_under
from verl_core.store import canonical_json, check_sha256

WARM_START_VERSION = 1
"""Part of the key: bump it when the warm start's math changes, so no stored result of the old
math is taken for the new."""
PROGRESS_S = 5.0
"""Seconds between progress lines at most (plus one at the start and one at the end)."""
SAVE_EVERY_S = 15.0
"""Seconds between saves of the warm start's state (an interrupt saves at once): what a SIGKILL
can cost. A save of the tiny model takes milliseconds."""
SAVE_COST_SHARE = 0.1
"""At most this share of the warm start's time goes to saving: after a save that took ``d``
seconds the next one waits ``max(SAVE_EVERY_S, d / SAVE_COST_SHARE)`` (a real model's weights and
AdamW moments are gigabytes: seconds to write)."""


def warm_start_key(cfg, train_files: list[str], chat_template: str | None) -> str:
    """sha256 of everything the warm start's result depends on: the run seed, the tiny model's
    and the warm start's own fields, the prompts' encoding, the probe's generation limit, scorer
    and tool limits, the tools' YAML and the training files' bytes; for the format warm start of
    a model you bring, its ``format_*`` fields and the model folder's files instead of the tiny
    model's fields and the probe. An RL setting (learning
    rate, batch size, steps, ...) is not in it: runs differing only there share one warm
    start."""
    m = cfg.model
    # the tiny model's warm start, or the format warm start of a model you bring
    fields = {f.name: getattr(m, f.name) for f in dataclasses.fields(m)
              if f.name.startswith(("format_",) if m.path else ("tiny_", "warmup_"))}
    rc = cfg.rollout
    # a tool YAML by its content; a built-in (``builtin:calculator``) by its name
    tools = "" if not (rc.multi_turn and rc.tool_config_path) else \
        _file_sha(rc.tool_config_path) if os.path.isfile(rc.tool_config_path) else \
        rc.tool_config_path
    doc = {
        "version": WARM_START_VERSION,
        "seed": cfg.seed,
        "model": fields,
        "data": {"max_prompt_length": cfg.data.max_prompt_length,
                 "truncation": cfg.data.truncation,
                 "train": [_file_sha(f) for f in train_files]},
        "probe": {"max_new_tokens": rc.max_new_tokens,
                  "reward": dataclasses.asdict(cfg.reward),
                  "turns": [rc.max_assistant_turns, rc.max_user_turns, rc.max_parallel_calls,
                            rc.max_tool_response_length, rc.tool_response_truncate_side,
                            rc.tool_budget_s] if rc.multi_turn else None,
                  "tools": tools},
        "chat_template": chat_template or "",
    }
    if rc.multi_turn and rc.interaction_config_path:  # simulated users (only then: no other
        # run's key changes): a YAML by its content, a built-in by its name
        doc["probe"]["users"] = _file_sha(rc.interaction_config_path) \
            if os.path.isfile(rc.interaction_config_path) else rc.interaction_config_path
    if m.path:  # the folder it starts from, by content; no probe (it trains a fixed step count)
        doc["source"] = folder_sha256(m.path)
        del doc["probe"]
    return hashlib.sha256(json.dumps(doc, sort_keys=True, default=str).encode()).hexdigest()


def folder_sha256(path: str) -> str:
    """sha256 over a folder's files (their names and contents)."""
    return hashlib.sha256(json.dumps({rel: _file_sha(os.path.join(path, rel))
                                      for rel in _files_under(path)},
                                     sort_keys=True).encode()).hexdigest()


def _cache_dir(key: str) -> str:
    return os.path.join(cache_root(), f"warmstart-{check_sha256(key, 'warm start key')}")


class WarmStart:
    """The durable side of one warm start: its doc in ``store`` (None: nothing is saved, the
    lines are still printed), its cached result, its progress lines and interrupt status."""

    def __init__(self, store, key: str, log, *, total_steps: int, target: float,
                 what: str = "the tiny model"):
        self.store, self.key, self.log = store, key, log
        self.total, self.target, self.what = total_steps, target, what
        self._save_wait = SAVE_EVERY_S
        self._state_sha = ""  # the saved state the doc names now (deleted when superseded)
        self.doc = warm_start_doc(key)
        self._t0 = self._last_line = self._last_save = time.perf_counter()
        self._start_step = 0
        self.saved_step = 0
        self.steps_done, self.accuracy = 0, float("nan")
        """Set by the caller when the warm start ends: its steps and its last probe accuracy."""

    # ------------------------------------------------------------------ a finished warm start
    def reuse(self, model_path: str) -> bool:
        """Write the finished warm start's model folder to ``model_path`` from the run store, or
        else from the private cache (then also into the store). False: there is none."""
        doc = self._read_doc()
        if doc is not None and doc.get("done"):
            files = {rel: self.store.get_bytes(sha, what=f"warm-start model file {rel}")
                     for rel, sha in doc["model"].items()}
            _write_folder(model_path, files)
            acc = doc.get("accuracy")
            acc = "" if acc is None else f", train-slice accuracy {acc:.3f}"
            self.log(f"warm start: reused the finished one of this run ({doc['steps']} steps"
                     f"{acc})")
            self._cache(model_path)
            return True
        cached = _read_cache(_cache_dir(self.key))
        if cached is None:
            return False
        files, info = cached
        _write_folder(model_path, files)
        self.log(f"warm start: reused a finished one with the same inputs from the local cache "
                 f"({info.get('steps', '?')} steps; key {self.key[:12]})")
        if self.store is not None:
            acc = info.get("accuracy")
            self.finish(model_path, info.get("steps", 0),
                        float("nan") if acc is None else acc, cache=False)
        return True

    def finish(self, model_path: str, steps: int, accuracy: float, *, cache: bool = True) -> None:
        """Store the finished model folder under the doc (and in the cache): the next prepare
        with the same key takes it instead of training again."""
        if self.store is not None:
            files = {}
            for rel in _files_under(model_path):
                with open(os.path.join(model_path, rel), "rb") as f:
                    files[rel] = self.store.put_bytes(f.read())
            self.store.put_json(self.doc, {"format": 1, "key": self.key, "done": True,
                                           "steps": steps, "accuracy": _finite(accuracy),
                                           "model": files})
            self._drop_state()
        if cache:
            self._cache(model_path, steps=steps, accuracy=accuracy)

    def _cache(self, model_path: str, **info) -> None:
        try:
            _write_cache(_cache_dir(self.key), model_path, info)
        except OSError:  # a cache that cannot be written costs the next run a warm start only
            pass

    # ------------------------------------------------------------------ a warm start in progress
    def resume_point(self) -> dict | None:
        """The saved state to continue from (``torch.load`` of what :meth:`save` wrote), or None."""
        doc = self._read_doc()
        if doc is None or doc.get("done") or "state" not in doc:
            stop = (f", stopping once the training slice's greedy accuracy reaches "
                    f"{self.target:.2f}" if self.target < 1.0 else "")
            where = (f"; saved every {SAVE_EVERY_S:.0f}s (longer when a save is slow) and on "
                     f"Ctrl-C in {self.store.uri}" if self.store is not None else "")
            self.log(f"warm start: up to {self.total} supervised steps of {self.what}{stop}"
                     f"{where}")
            return None
        data = self.store.get_bytes(doc["state"], what="warm-start state")
        state = torch.load(io.BytesIO(data), weights_only=False)
        self._start_step = self.saved_step = doc["step"]
        self._state_sha = doc["state"]
        self.log(f"warm start: resuming from step {doc['step']} (saved in {self.store.uri})")
        return state

    def save(self, step: int, state: dict) -> None:
        if self.store is None:
            return
        t0 = time.perf_counter()
        buf = io.BytesIO()
        torch.save(state, buf)
        sha = self.store.put_bytes(buf.getvalue())
        del buf
        self.store.put_json(self.doc, {"format": 1, "key": self.key, "done": False,
                                       "step": step, "state": sha})
        self._drop_state(keep=sha)
        self.saved_step = step
        self._last_save = time.perf_counter()
        self._save_wait = max(SAVE_EVERY_S, (self._last_save - t0) / SAVE_COST_SHARE)

    def _drop_state(self, keep: str = "") -> None:
        """Delete the state object the doc no longer names: only the newest save is ever needed,
        and nothing else names it (it holds this warm start's own optimizer moments)."""
        if self._state_sha and self._state_sha != keep:
            self.store.delete_object(self._state_sha)
        self._state_sha = keep

    def after_step(self, step: int, loss_window: list[float], accuracy: float, state_fn) -> None:
        """Called after every step (``step`` done in all): progress line, periodic save, and on
        an interrupt a save and the exit. ``state_fn()``: the whole state to save."""
        now = time.perf_counter()
        interrupt.status(where=f"the warm start (step {step} of at most {self.total})")
        maybe_inject("warm_start", step)  # VERL_FAULTS: a kill, or a SIGTERM saved just below
        if interrupt.requested():
            self.save(step, state_fn())
            interrupt.status(kept=self._kept())
            interrupt.exit_now()
        if self.store is not None and now - self._last_save >= self._save_wait:
            self.save(step, state_fn())
        interrupt.status(kept=self._kept())
        if now - self._last_line >= PROGRESS_S:
            self._last_line = now
            self.log(self.progress_line(step, loss_window, accuracy, now))

    def _kept(self) -> str:
        if self.store is None:
            return "nothing of the warm start (no run store)"
        return f"the warm start's progress up to step {self.saved_step}"

    def progress_line(self, step: int, loss_window: list[float], accuracy: float,
                      now: float) -> str:
        rate = (step - self._start_step) / max(now - self._t0, 1e-9)
        loss = sum(loss_window) / len(loss_window) if loss_window else float("nan")
        acc = ("" if accuracy != accuracy else
               f", train-slice accuracy {accuracy:.3f} (stops at {self.target:.2f})"
               if self.target < 1.0 else f", train-slice accuracy {accuracy:.3f}")
        eta = (self.total - step) / rate if rate > 0 else float("inf")
        return (f"warm start: step {step}/{self.total}, loss {loss:.3f}{acc}, {rate:.1f} steps/s, "
                f"ETA {'≤ ' if self.target < 1.0 else ''}{eta:.0f}s")

    def _read_doc(self) -> dict | None:
        if self.store is None:
            return None
        doc = self.store.get_json(self.doc, default=None)
        if doc is not None and (not isinstance(doc, dict) or doc.get("key") != self.key):
            return None  # not ours (hand-edited): trained again, the doc then overwritten
        return doc


def _finite(x: float):
    return x if x == x else None


def _write_folder(path: str, files: dict[str, bytes]) -> None:
    for rel, data in files.items():
        target = os.path.join(path, rel)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        with open(target, "wb") as f:
            f.write(data)


_RECORD = ".complete"


def _write_cache(root: str, model_path: str, info: dict) -> None:
    """The model folder into the cache entry ``root``: filled aside, then renamed in (atomic)."""
    if os.path.exists(root):
        return
    parent = os.path.dirname(root)
    tmp = tempfile.mkdtemp(prefix=".partial-", dir=parent)
    try:
        record = {}
        for rel in _files_under(model_path):
            with open(os.path.join(model_path, rel), "rb") as f:
                data = f.read()
            _write_folder(tmp, {rel: data})
            record[rel] = hashlib.sha256(data).hexdigest()
        with open(os.path.join(tmp, _RECORD), "wb") as f:
            f.write(canonical_json({"files": record, "info": {k: _finite(v) if isinstance(v, float)
                                                              else v for k, v in info.items()}},
                                   sort_keys=True))
        os.replace(tmp, root)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _read_cache(root: str) -> tuple[dict[str, bytes], dict] | None:
    """The cached folder's files, each checked against the sha recorded when it was filled;
    None (and the entry removed) when absent or damaged."""
    if not os.path.isdir(root):
        return None
    try:
        with open(os.path.join(root, _RECORD), "rb") as f:
            record = json.loads(f.read())
        files = {}
        for rel, sha in record["files"].items():
            if rel.startswith("/") or ".." in rel.split("/"):
                raise ValueError(f"unsafe name {rel!r}")
            with open(os.path.join(root, rel), "rb") as f:
                data = f.read()
            if hashlib.sha256(data).hexdigest() != sha:
                raise ValueError(f"{rel} changed since it was cached")
            files[rel] = data
        return files, record.get("info") or {}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        shutil.rmtree(root, ignore_errors=True)
        return None
