"""Custom agent loops on verl's ``AgentLoopBase`` contract (issue 45, its first part).

A user's class with verl's method names runs a row's whole episode: ``async def run(self,
sampling_params, **kwargs) -> AgentLoopOutput``, calling ``await self.server_manager.generate(
request_id, prompt_ids=..., sampling_params=...)`` (verl's token-in/token-out call: a
:class:`TokenOutput` with ``token_ids`` and ``log_probs``) as often as it likes, with its own
observations between the calls, and the run's tools (``self.tools``: the tool host's, with
verl's ``BaseTool`` methods). No verl import is needed: this module has verl's
:class:`AgentLoopBase`, :class:`AgentLoopOutput` and :func:`register` under verl's names (and
answers ``import verl.experimental.agent_loop`` where verl is not installed).

- **Which loop**: a row's ``agent_name`` (a column, or ``extra_info["agent_name"]``, as verl),
  else ``rollout.agent_loop`` (verl's ``agent.default_agent_loop``), else ``tool_agent`` with
  ``rollout.multi_turn`` and ``single_turn_agent`` without. A name is a registered one
  (:func:`register`, verl's ``agent_loop_config_path`` YAML: ``[{name, _target_}]``), a dotted
  ``module.Class`` or ``path/to/file.py:Class``. A name that resolves to nothing is refused
  when the run is prepared (:func:`check_agent_loops`).
- **Batched, per-row seeded**: every row's loop runs at once, each in a thread of its own with
  its own event loop; the trainer's thread serves their pending ``generate`` requests in one
  engine call per tick (each request with its row's seed for its index k: ``turn_seed(seed,
  row, k)``, and what is left of the row's budget), so a row's tokens depend neither on the
  other rows nor on how they were batched or split across workers.
- **Checked**: the response's sampled positions (mask 1) must be exactly what the engine
  sampled after exactly the preceding tokens (one of the row's recorded calls); their log-probs
  are the recorded ones (a loop's own ``response_logprobs`` are not read). Masked positions are
  the loop's observations.
- **Isolated**: a loop that raises, returns something malformed or runs (its own code, not
  waiting on the engine or a tool) past ``rollout.agent_loop_timeout_s`` scores its row 0 with
  an empty response (``agent_loop/errors``, ``agent_loop/timeouts``), the run goes on. The
  limit: loops run in the trainer's process (threads), so a loop that hangs in sync code is
  abandoned, not killed (its thread runs on until its code returns), and one that ends the
  process (``os._exit``, a segfault) ends the run.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import importlib
import importlib.util
import json
import logging
import math
import os
import sys
import threading
import time
import types
from dataclasses import dataclass, field
from typing import Any

from verl_core.errors import PermanentError, TransientError

log = logging.getLogger(__name__)

SINGLE_TURN = "single_turn_agent"
TOOL_AGENT = "tool_agent"


class AgentLoopError(PermanentError, ValueError):
    """An agent loop that cannot be used (a name, path or config that resolves to no loop
    class): the message names it and the fix."""


class AgentLoopStopped(RuntimeError):
    """Raised in a loop the rollout gave up on (it ran past its time): its row is scored 0."""


# ------------------------------------------------------------------ verl's contract
@dataclass
class TokenOutput:
    """What ``server_manager.generate`` returns (verl's ``TokenOutput``)."""

    token_ids: list[int]
    log_probs: list[float] | None = None
    stop_reason: str | None = None
    """``completed`` (an EOS ended it) or ``length`` (the row's budget or ``max_tokens``)."""
    num_preempted: int | None = None
    extra_fields: dict = field(default_factory=dict)


@dataclass
class AgentLoopOutput:
    """A loop's result (verl's field names): ``response_mask`` is 1 on the tokens the engine
    sampled, 0 on the loop's own observations."""

    prompt_ids: list[int]
    response_ids: list[int]
    response_mask: list[int]
    response_logprobs: list[float] | None = None
    reward_score: float | None = None
    """When set, the row's score (verl: a loop that scored its own episode); the scorer is not
    asked."""
    num_turns: int = 0
    metrics: Any = None
    extra_fields: dict = field(default_factory=dict)
    """Given to the scorer in the row's ``extra_info`` (JSON values; stored with the batch)."""
    multi_modal_data: dict | None = None
    routed_experts: Any = None


class _AttrDict(dict):
    """A mapping also read by attribute (verl's loops read ``self.config.actor_rollout_ref...``)."""

    def __getattr__(self, key):
        try:
            value = self[key]
        except KeyError:
            raise AttributeError(key) from None
        return _AttrDict(value) if isinstance(value, dict) else value


class DictConfigWrap:
    def __init__(self, config):
        self.config = _AttrDict(config)


class AgentLoopBase:
    """verl's base class: a loop gets the trainer's config, the ``server_manager`` (the engine's
    token-in/token-out ``generate``), the tokenizer and the tools (``self.tools``: name -> tool
    with verl's ``BaseTool`` methods, run in the tool host) and implements :meth:`run`."""

    def __init__(self, trainer_config=None, server_manager=None, tokenizer=None, processor=None,
                 dataset_cls=None, data_config=None, tools=None, **kwargs):
        self.config = getattr(trainer_config, "config", trainer_config) or _AttrDict()
        self.rollout_config = _AttrDict(self.config.get("actor_rollout_ref", {})
                                        .get("rollout", {}))
        self.server_manager = server_manager
        self.tokenizer = tokenizer
        self.processor = processor
        self.dataset_cls = dataset_cls
        self.data_config = getattr(data_config, "config", data_config) or _AttrDict()
        self.tools = tools or {}
        self.apply_chat_template_kwargs = {}

    async def run(self, sampling_params: dict[str, Any], **kwargs) -> AgentLoopOutput:
        raise NotImplementedError


_agent_loop_registry: dict[str, dict] = {}
"""verl's registry: name -> ``{"_target_": "module.Class"}``."""
_registered_classes: dict[str, type] = {}  # the classes themselves (a file's has no module path)


def register(agent_name: str):
    """verl's decorator: ``@register("my_agent")`` makes the class the loop of that name."""
    def decorator(cls: type) -> type:
        _agent_loop_registry[agent_name] = {"_target_": f"{cls.__module__}.{cls.__qualname__}"}
        _registered_classes[agent_name] = cls
        return cls
    return decorator


@register(SINGLE_TURN)
class SingleTurnAgentLoop(AgentLoopBase):
    """verl's ``single_turn_agent``: one generate call (what a row of a batch with custom loops
    samples when it names this loop)."""

    async def run(self, sampling_params, **kwargs) -> AgentLoopOutput:
        prompt = list(kwargs["prompt_ids"])
        out = await self.server_manager.generate(request_id="0", prompt_ids=prompt,
                                                 sampling_params=sampling_params)
        return AgentLoopOutput(prompt_ids=prompt, response_ids=list(out.token_ids),
                               response_mask=[1] * len(out.token_ids), num_turns=2)


_agent_loop_registry[TOOL_AGENT] = {"_target_": "verl_core.rollout.multi_turn.generate_turns"}


def install_verl_alias() -> None:
    """Where verl is not installed: ``verl.experimental.agent_loop`` (and its
    ``.agent_loop`` module) import as this module, so a loop written for verl runs unchanged."""
    if "verl" in sys.modules:
        if not getattr(sys.modules["verl"], "_verl_core_alias", False):
            return  # the real verl
    elif importlib.util.find_spec("verl") is not None:
        return
    this = sys.modules[__name__]
    for name in ("verl", "verl.experimental"):
        if name not in sys.modules:
            mod = types.ModuleType(name)
            mod.__path__ = []
            mod._verl_core_alias = True
            sys.modules[name] = mod
    sys.modules["verl.experimental.agent_loop"] = this
    sys.modules["verl.experimental.agent_loop.agent_loop"] = this


# ------------------------------------------------------------------ finding a loop's class
def _import_class(spec: str) -> type:
    install_verl_alias()
    target, sep, attr = spec.rpartition(":")
    if sep and target.endswith(".py"):
        if not os.path.isfile(target):
            raise AgentLoopError(f"agent loop {spec!r}: file {target!r} does not exist")
        name = f"verl_agent_loop_{abs(hash(os.path.abspath(target)))}"
        module = sys.modules.get(name)
        if module is None:
            s = importlib.util.spec_from_file_location(name, target)
            module = importlib.util.module_from_spec(s)
            try:
                s.loader.exec_module(module)
            except BaseException as e:  # noqa: BLE001 - user code: named, never raised through
                raise AgentLoopError(f"agent loop {spec!r}: running {target!r} raised "
                                     f"{type(e).__name__}: {e}") from e
            sys.modules[name] = module
    else:
        target, _, attr = spec.rpartition(".")
        if not target:
            raise AgentLoopError(
                f"agent loop {spec!r} is not a registered name ({sorted(_agent_loop_registry)}), "
                "a dotted 'package.module.Class' or 'path/to/file.py:Class'; register it with "
                "@register or rollout.agent_loop_config_path")
        try:
            module = importlib.import_module(target)
        except BaseException as e:  # noqa: BLE001 - user code: named, never raised through
            raise AgentLoopError(f"agent loop {spec!r}: importing module {target!r} failed "
                                 f"({type(e).__name__}: {e}); check the name, install the "
                                 "package, or give 'path/to/file.py:Class'") from e
    cls = getattr(module, attr, None)
    if not isinstance(cls, type):
        raise AgentLoopError(f"agent loop {spec!r}: {target!r} has no class {attr!r}")
    if not asyncio.iscoroutinefunction(getattr(cls, "run", None)):
        raise AgentLoopError(f"agent loop {spec!r}: {cls.__name__} needs verl's "
                             "'async def run(self, sampling_params, **kwargs)'")
    return cls


def load_agent_loop_config(path: str) -> dict[str, dict]:
    """verl's ``agent_loop_config_path`` YAML: a list of ``{name, _target_, ...}``; name -> its
    entry (the keys beside ``name`` and ``_target_`` are given to the class's ``__init__``, as
    verl's Hydra instantiation does)."""
    import yaml

    try:
        with open(path) as f:
            doc = yaml.safe_load(f)
    except OSError as e:
        raise AgentLoopError(f"agent loop config {path!r} cannot be read ({e}); "
                             "rollout.agent_loop_config_path names a local YAML file") from e
    except yaml.YAMLError as e:
        raise AgentLoopError(f"agent loop config {path!r} is not valid YAML: {e}") from e
    if not isinstance(doc, list) or not doc:
        raise AgentLoopError(f"agent loop config {path!r}: expected a list of entries "
                             "[{name: ..., _target_: module.Class}] (verl's layout)")
    out = {}
    for i, e in enumerate(doc):
        if not (isinstance(e, dict) and isinstance(e.get("name"), str)
                and isinstance(e.get("_target_"), str)):
            raise AgentLoopError(f"agent loop config {path!r}, entry {i}: needs 'name' and "
                                 "'_target_' ('package.module.Class' or 'path/to/file.py:Class')")
        out[e["name"]] = dict(e)
    return out


def init_kwargs(spec: str, config_path: str = "") -> dict:
    """The keywords ``config_path``'s entry ``spec`` gives its class (none for other names)."""
    entry = load_agent_loop_config(config_path).get(spec, {}) if config_path else {}
    return {k: v for k, v in entry.items() if k not in ("name", "_target_")}


def resolve(spec: str, config_path: str = "") -> type | str:
    """The loop class ``spec`` names (:data:`TOOL_AGENT` for the built-in tool loop): a name
    of ``config_path``'s YAML, a registered name, a dotted path or ``file.py:Class``."""
    if spec == TOOL_AGENT:
        return TOOL_AGENT
    targets = load_agent_loop_config(config_path) if config_path else {}
    if spec in targets:
        target = targets[spec]["_target_"]
        return TOOL_AGENT if target == TOOL_AGENT else _import_class(target)
    if spec in _registered_classes:
        return _registered_classes[spec]
    if spec in _agent_loop_registry:
        return _import_class(_agent_loop_registry[spec]["_target_"])
    return _import_class(spec)


def agent_name_of(row) -> str:
    """A dataset row's ``agent_name`` (verl's column, kept in ``extra_info``), "" when absent."""
    name = (row.extra_info or {}).get("agent_name") if hasattr(row, "extra_info") else None
    return name if isinstance(name, str) else ""


def loop_kwargs(row) -> dict:
    """What a loop's ``run`` gets for a dataset row (verl's dataset fields; ``prompt_ids``,
    the row's rendered prompt, is added when it runs): ``raw_prompt`` (the messages),
    ``extra_info``, ``data_source``, ``reward_model``, ``index``, ``agent_name``,
    ``tools_kwargs``."""
    info = dict(row.extra_info or {})
    return {"raw_prompt": [{"role": r, "content": c} for r, c in row.messages],
            "extra_info": info, "data_source": row.data_source,
            "reward_model": {"style": "rule", "ground_truth": row.ground_truth},
            "index": row.index, "agent_name": agent_name_of(row),
            "tools_kwargs": info.get("tools_kwargs") or {}}


def verl_view(cfg) -> dict:
    """The part of verl's config a loop reads (``self.config``, ``self.rollout_config``)."""
    rc, d = cfg.rollout, cfg.data
    return {"actor_rollout_ref": {"rollout": {
        "response_length": rc.max_new_tokens, "prompt_length": d.max_prompt_length,
        "temperature": rc.temperature, "top_p": rc.top_p, "top_k": rc.top_k, "n": rc.n,
        "multi_turn": {"enable": rc.multi_turn, "max_assistant_turns": rc.max_assistant_turns
                       or None, "max_user_turns": rc.max_user_turns or None},
        "agent": {"default_agent_loop": default_loop(rc),
                  "agent_loop_config_path": rc.agent_loop_config_path or None}}},
        "data": {"max_prompt_length": d.max_prompt_length,
                 "max_response_length": rc.max_new_tokens}}


def default_loop(rc) -> str:
    return rc.agent_loop or (TOOL_AGENT if rc.multi_turn else SINGLE_TURN)


def uses_agent_loops(rc, rows) -> bool:
    """Whether a batch of ``rows`` runs through the agent loops (a loop is configured, or a row
    names one); else the rollout is as before loops existed (bit-identical)."""
    return bool(rc.agent_loop or rc.agent_loop_config_path
                or any(agent_name_of(r) for r in rows))


def check_agent_loops(cfg, rows) -> None:
    """Before any work: every loop the run can use (the default, the config's, each row's
    ``agent_name``) resolves to a class; the tool loop needs ``rollout.multi_turn``."""
    rc = cfg.rollout
    if not uses_agent_loops(rc, rows):
        return
    if rc.partial_rollout:
        raise AgentLoopError("rollout.partial_rollout with agent loops is not offered: a tick "
                             "serves rows at different request indices in one engine call; "
                             "drop one of them")
    names = {default_loop(rc)} | {agent_name_of(r) for r in rows} - {""}
    if rc.agent_loop_config_path:
        names |= set(load_agent_loop_config(rc.agent_loop_config_path))
    for name in sorted(names):
        if resolve(name, rc.agent_loop_config_path) == TOOL_AGENT and not rc.multi_turn:
            raise AgentLoopError(f"agent loop {name!r} is the built-in tool loop, which needs "
                                 "rollout.multi_turn=True and rollout.tool_config_path")


# ------------------------------------------------------------------ running the loops
class _Tool:
    """One tool of the host as a loop sees it (verl's ``BaseTool`` methods), its requests served
    with the other rows' by the trainer's thread."""

    def __init__(self, hub, row, name, schema):
        self._hub, self._row, self.name = hub, row, name
        self.tool_schema = schema
        self._n = 0

    def _id(self, instance_id):
        return f"{self._hub.prefix}:{self._row.row}:{self.name}:{instance_id}"

    async def create(self, instance_id=None, **kwargs):
        if instance_id is None:
            self._n += 1
            instance_id = str(self._n)
        await self._hub.call(self._row, ("tool", "create", self.name, self._id(instance_id),
                                         kwargs))
        return instance_id

    async def execute(self, instance_id, parameters, **kwargs):
        r = await self._hub.call(self._row, ("tool", "execute", self.name,
                                             self._id(instance_id),
                                             {"parameters": parameters, **kwargs}))
        return types.SimpleNamespace(text=r.observation()), r.reward, {"status": r.status}

    async def calc_reward(self, instance_id, **kwargs):
        r = await self._hub.call(self._row, ("tool", "calc_reward", self.name,
                                             self._id(instance_id), {}))
        return r.reward if r.status == "ok" else 0.0

    async def release(self, instance_id, **kwargs):
        await self._hub.call(self._row, ("tool", "release", self.name, self._id(instance_id),
                                         {}))


class _Server:
    """``server_manager`` of one row: verl's ``generate`` call, served by the trainer's thread."""

    def __init__(self, hub, row):
        self._hub, self._row = hub, row

    async def generate(self, request_id=None, *, prompt_ids, sampling_params=None, **_):
        return await self._hub.call(self._row, ("generate", [int(t) for t in prompt_ids],
                                                dict(sampling_params or {})))


@dataclass
class _Row:
    i: int  # index in this call's rows
    row: int  # index in the phase's whole batch (its seeds)
    cls: type
    init: dict
    prompt: list[int]
    kwargs: dict
    state: str = "running"  # running | waiting | done
    used_s: float = 0.0
    since: float = 0.0
    request: Any = None
    future: Any = None
    k: int = 0  # generate requests answered
    sampled: int = 0  # tokens sampled so far (the budget)
    calls: list = field(default_factory=list)  # (prompt_ids, token_ids, log_probs)
    result: Any = None
    error: str = ""
    status: str = ""  # ok | error | timeout


class _Hub:
    """Runs the rows' loops (a thread each) and serves their requests from the calling thread."""

    def __init__(self, engine, params, host, prefix, timeout_s, tick_s=0.05):
        self.engine, self.params, self.host, self.prefix = engine, params, host, prefix
        self.timeout_s, self.tick_s = timeout_s, tick_s
        self.cond = threading.Condition()

    async def call(self, r: _Row, request):
        fut = concurrent.futures.Future()
        with self.cond:
            if r.state == "done":
                raise AgentLoopStopped("the rollout stopped this agent loop (it ran past "
                                       "rollout.agent_loop_timeout_s)")
            r.used_s += time.monotonic() - r.since
            r.state, r.request, r.future = "waiting", request, fut
            self.cond.notify_all()
        return await asyncio.wrap_future(fut)

    def _thread(self, r: _Row, make) -> None:
        async def body():
            loop = make(r)
            return await loop.run(self.sampling_dict(), **r.kwargs)
        try:
            result, error = asyncio.run(body()), ""
        except BaseException as e:  # noqa: BLE001 - user code: its row scores 0
            result, error = None, f"{type(e).__name__}: {e}"
        with self.cond:
            if r.state != "done":
                r.result, r.error, r.state = result, error, "done"
                r.status = "error" if error else "ok"
            self.cond.notify_all()

    def sampling_dict(self) -> dict:
        p = self.params
        return {"temperature": p.temperature, "top_p": p.top_p, "top_k": p.top_k,
                "max_tokens": p.max_new_tokens, "logprobs": True}

    def run(self, rows: list[_Row], make) -> None:
        now = time.monotonic()
        for r in rows:
            r.since = now
            threading.Thread(target=self._thread, args=(r, make), daemon=True,
                             name=f"agent-loop-{r.row}").start()
        while True:
            with self.cond:
                first_wait = None
                while True:
                    live = [r for r in rows if r.state != "done"]
                    if not live:
                        return
                    now = time.monotonic()
                    for r in live:
                        if r.state == "running" and r.used_s + now - r.since > self.timeout_s:
                            r.state, r.status = "done", "timeout"
                            r.error = (f"ran past rollout.agent_loop_timeout_s="
                                       f"{self.timeout_s:g}s")
                    running = [r for r in live if r.state == "running"]
                    waiting = [r for r in live if r.state == "waiting"]
                    if waiting and first_wait is None:
                        first_wait = now
                    if waiting and (not running or now - first_wait >= self.tick_s):
                        break
                    if not waiting and not running:
                        continue
                    left = min(self.timeout_s - (r.used_s + now - r.since) for r in running)
                    if waiting:
                        left = min(left, self.tick_s - (now - first_wait))
                    self.cond.wait(max(left, 0.001))
                todo = [(r, r.request, r.future) for r in waiting]
            answers = self._serve([(r, q) for r, q, _ in todo])
            with self.cond:
                now = time.monotonic()
                for (r, _, fut), a in zip(todo, answers):
                    if r.state == "done":  # timed out meanwhile: never
                        continue
                    r.state, r.since = "running", now
                    if isinstance(a, BaseException):
                        fut.set_exception(a)
                    else:
                        fut.set_result(a)

    def _serve(self, todo: list) -> list:
        from verl_core.agent.tools import Request
        from verl_core.rollout.base import SamplingParams
        from verl_core.rollout.multi_turn import _left_pad, turn_seed

        out: list[Any] = [None] * len(todo)
        groups: dict[tuple, list[int]] = {}
        tools = []
        budget = self.params.max_new_tokens
        for j, (r, q) in enumerate(todo):
            if q[0] == "tool":
                if self.host is None:
                    out[j] = AgentLoopError("no tools: set rollout.multi_turn=True and "
                                            "rollout.tool_config_path")
                else:
                    tools.append(j)
                continue
            sp = q[2]
            # the row's budget: the whole response so far (its observations too), as verl's
            # response_length; a prompt not extending the row's counts what was sampled
            used = len(q[1]) - len(r.prompt) if q[1][:len(r.prompt)] == r.prompt else 0
            limit = min(int(sp.get("max_tokens") or sp.get("max_new_tokens") or budget),
                        budget - max(used, r.sampled))
            if limit <= 0 or not q[1]:
                r.k += 1
                out[j] = TokenOutput([], [], stop_reason="length")
                r.calls.append((q[1], [], []))
                continue
            key = (float(sp.get("temperature", self.params.temperature)),
                   float(sp.get("top_p", self.params.top_p)),
                   int(sp.get("top_k", self.params.top_k)))
            groups.setdefault(key, []).append(j)
            todo[j] = (r, q, limit)
        stop = set(self.engine.eos_token_ids)
        for (temp, top_p, top_k), js in sorted(groups.items()):
            params = SamplingParams(temperature=temp, top_p=top_p, top_k=top_k,
                                    max_new_tokens=budget, seed=self.params.seed)
            ids, mask = _left_pad([todo[j][1][1] for j in js], self.engine.pad_token_id)
            try:
                g = self.engine.generate(ids, mask, params,
                                         row_seeds=[turn_seed(self.params.seed, todo[j][0].row,
                                                              todo[j][0].k) for j in js],
                                         row_limits=[todo[j][2] for j in js])
            except Exception as e:  # noqa: BLE001 - e.g. a prompt longer than the model takes
                if isinstance(e, TransientError):
                    raise  # the engine died: the phase is retried, as without loops
                for j in js:
                    out[j] = RuntimeError(f"generate failed: {type(e).__name__}: {e}")
                continue
            for n, j in enumerate(js):
                r, q, _ = todo[j]
                take = int(g.response_mask[n].sum())
                toks = g.response_ids[n, :take].tolist()
                lps = g.logprobs[n, :take].tolist()
                r.k += 1
                r.sampled += take
                r.calls.append((q[1], toks, lps))
                out[j] = TokenOutput(toks, lps, stop_reason="completed"
                                     if take and toks[-1] in stop else "length")
        if tools:
            got = self.host.run([Request(todo[j][1][1], todo[j][1][2], todo[j][1][3],
                                         dict(todo[j][1][4])) for j in tools])
            for j, res in zip(tools, got):
                out[j] = res
        return out


def _run_loops(engine, tokenizer, prompts, params, rows, loop_classes, row_kwargs, *, host,
               tool_schemas, prefix, timeout_s, trainer_config) -> list[_Row]:
    """Each row's loop run to its end (or given up on); their generate requests batched."""
    hub = _Hub(engine, params, host, prefix, timeout_s)
    schemas = {s["function"]["name"]: s for s in (tool_schemas or [])}

    def make(r: _Row):
        tools = {name: _Tool(hub, r, name, s) for name, s in schemas.items()}
        return r.cls(trainer_config=DictConfigWrap(trainer_config), server_manager=_Server(hub, r),
                     tokenizer=tokenizer, processor=None, dataset_cls=None,
                     data_config=DictConfigWrap(trainer_config.get("data", {})), tools=tools,
                     **r.init)
    todo = [_Row(i, rows[i], loop_classes[i][0], loop_classes[i][1], list(prompts[i]),
                 {**row_kwargs[i], "prompt_ids": list(prompts[i])})
            for i in range(len(prompts))]
    hub.run(todo, make)
    return todo


def _check(r: _Row, budget: int) -> tuple[list[int], list[float], list[float], dict]:
    """A finished row's response, mask and the engine's log-probs, checked against its recorded
    calls; raises ValueError naming what is malformed."""
    out = r.result
    if isinstance(out, dict):
        out = types.SimpleNamespace(**out)
    for name in ("prompt_ids", "response_ids", "response_mask"):
        if not isinstance(getattr(out, name, None), (list, tuple)):
            raise ValueError(f"run() returned {type(r.result).__name__} whose {name} is not a "
                             "list (return AgentLoopOutput(prompt_ids=..., response_ids=..., "
                             "response_mask=...))")
    if [int(t) for t in out.prompt_ids] != r.prompt:
        raise ValueError("prompt_ids are not the row's prompt: return kwargs['prompt_ids']")
    ids, m = [int(t) for t in out.response_ids], [int(t) for t in out.response_mask]
    if len(ids) != len(m) or not set(m) <= {0, 1}:
        raise ValueError(f"response_mask ({len(m)} entries of 0/1 expected) does not fit "
                         f"response_ids ({len(ids)})")
    ids, m = ids[:budget], m[:budget]  # verl's loops cut at response_length: so here
    by_prompt: dict[tuple, list] = {}  # a context sampled twice: either sample may be used
    for c in r.calls:
        by_prompt.setdefault(tuple(c[0]), []).append(c)
    logp = [0.0] * len(ids)
    pos = 0
    while pos < len(ids):
        if not m[pos]:
            pos += 1
            continue
        calls = [c for c in by_prompt.get(tuple(r.prompt + ids[:pos]), []) if c[1]]
        call = next((c for c in calls if c[1][0] == ids[pos]), calls[0] if calls else None)
        if call is None:
            raise ValueError(f"response position {pos} is marked sampled (mask 1) but no "
                             "generate call of this row had the prompt and response before it "
                             "as its prompt_ids")
        toks, lps = call[1], call[2]
        n = 0
        while n < len(toks) and pos + n < len(ids) and m[pos + n]:
            if ids[pos + n] != toks[n]:
                raise ValueError(f"response position {pos + n}: id {ids[pos + n]} is marked "
                                 f"sampled but the engine sampled {toks[n]} there")
            logp[pos + n] = lps[n]
            n += 1
        pos += n
    score = getattr(out, "reward_score", None)
    if score is not None and not (isinstance(score, (int, float)) and math.isfinite(score)):
        raise ValueError(f"reward_score={score!r}: a finite number or None")
    extra = dict(getattr(out, "extra_fields", None) or {})
    try:
        extra = json.loads(json.dumps(extra, sort_keys=True))
    except (TypeError, ValueError) as e:
        raise ValueError(f"extra_fields must be JSON values (they are stored): {e}") from None
    info = {"reward_score": None if score is None else float(score),
            "num_turns": int(getattr(out, "num_turns", 0) or 0), "extra_fields": extra}
    return ids, [float(x) for x in m], logp, info


def _spans(mask: list[float]) -> list[dict]:
    """Each maximal sampled run as a turn (its ``sampled`` span, the observation after it as
    ``appended``), in :mod:`verl_core.rollout.multi_turn`'s layout."""
    turns, pos = [], 0
    while pos < len(mask):
        start = pos
        while pos < len(mask) and mask[pos] == mask[start]:
            pos += 1
        if mask[start]:
            turns.append({"sampled": [start, pos], "calls": [], "results": []})
        elif turns:
            turns[-1]["appended"] = [start, pos]
        else:
            turns.append({"sampled": [0, 0], "calls": [], "results": [], "appended": [0, pos]})
    return turns


def run_agent_loops(engine, tokenizer, prompts: list[list[int]], params, *, rows: list[int],
                    names: list[str], config_path: str, row_kwargs: list[dict],
                    tool_turns, host=None, tool_schemas=None, prefix: str = "",
                    timeout_s: float = 60.0, trainer_config: dict | None = None):
    """The rollout of ``prompts`` with each row's agent loop ``names[i]``: the
    :data:`TOOL_AGENT` rows through ``tool_turns(indices)`` (the built-in tool loop on those
    rows, a ``MultiTurnOutput``), the others through their classes, batched; one
    ``MultiTurnOutput`` in the rows' order, its stored turns carrying each row's
    ``agent`` record (name, status, error, reward_score, extra_fields)."""
    import torch

    from verl_core.rollout.multi_turn import MultiTurnOutput

    n, budget = len(prompts), params.max_new_tokens
    classes = {name: resolve(name, config_path) for name in sorted(set(names))}
    resp: list[list[int]] = [[] for _ in range(n)]
    mask: list[list[float]] = [[] for _ in range(n)]
    attn: list[list[float]] = [[] for _ in range(n)]
    logp: list[list[float]] = [[] for _ in range(n)]
    turns: list[list[dict]] = [[] for _ in range(n)]
    rewards: list[list[float]] = [[] for _ in range(n)]
    agent: list[dict] = [{} for _ in range(n)]
    latency: list[float] = []
    tool_rows = [i for i in range(n) if classes[names[i]] == TOOL_AGENT]
    if tool_rows:
        out = tool_turns(tool_rows)
        for j, i in enumerate(tool_rows):
            real = int(out.attention_mask[j].sum())
            resp[i] = out.response_ids[j, :real].tolist()
            mask[i] = out.response_mask[j, :real].tolist()
            attn[i] = [1.0] * real
            logp[i] = out.logprobs[j, :real].tolist()
            turns[i], rewards[i] = out.turns[j], out.tool_rewards[j]
            agent[i] = {"name": names[i], "status": "ok"}
        latency = list(out.tool_latency_s)
    loop_rows = [i for i in range(n) if classes[names[i]] != TOOL_AGENT]
    failed = []
    if loop_rows:
        with engine.held():
            done = _run_loops(engine, tokenizer, [prompts[i] for i in loop_rows], params,
                              [rows[i] for i in loop_rows],
                              [(classes[names[i]], init_kwargs(names[i], config_path))
                               for i in loop_rows],
                              [row_kwargs[i] for i in loop_rows], host=host,
                              tool_schemas=tool_schemas, prefix=prefix, timeout_s=timeout_s,
                              trainer_config=trainer_config or {})
        for i, r in zip(loop_rows, done):
            info = {}
            if r.status == "ok":
                try:
                    ids, m, lp, info = _check(r, budget)
                except ValueError as e:
                    r.status, r.error = "error", f"malformed output: {e}"
            if r.status != "ok":
                ids, m, lp = [engine.eos_token_ids[0]], [0.0], [0.0]
                info = {"reward_score": 0.0}
                failed.append(f"row {r.row} ({names[i]}): {r.status}: {r.error}")
            resp[i], mask[i], logp[i], attn[i] = ids, m, lp, [1.0] * len(ids)
            turns[i] = _spans(m)
            agent[i] = {"name": names[i], "status": r.status,
                        **({"error": r.error} if r.error else {}), **info}
    if failed:
        log.warning("agent loops: %d of %d rows scored 0 (%s%s)", len(failed), len(loop_rows),
                    failed[0], "; ..." if len(failed) > 1 else "")
    T = max(1, max(len(r) for r in resp))
    pad = lambda xs, v: [x + [v] * (T - len(x)) for x in xs]  # noqa: E731
    out = MultiTurnOutput(
        response_ids=torch.tensor(pad(resp, engine.pad_token_id), dtype=torch.long),
        response_mask=torch.tensor(pad(mask, 0.0), dtype=torch.float32),
        attention_mask=torch.tensor(pad(attn, 0.0), dtype=torch.float32),
        logprobs=torch.tensor(pad(logp, 0.0), dtype=torch.float32),
        turns=turns, tool_rewards=rewards, tool_latency_s=latency)
    object.__setattr__(out, "agents", agent)
    return out


def stored_with_agents(out) -> list[dict]:
    """``out.stored_turns()`` with each row's ``agent`` record, when the rollout ran loops."""
    stored = out.stored_turns()
    agents = getattr(out, "agents", None)
    if agents:
        for s, a in zip(stored, agents):
            s["agent"] = a
    return stored


def agent_metrics(stored: list[dict]) -> dict[str, float]:
    """``agent_loop/errors`` and ``agent_loop/timeouts``: rows whose loop failed (raised or
    returned malformed output) or ran out of time (each scored 0)."""
    agents = [s.get("agent") for s in stored if s.get("agent")]
    if not agents:
        return {}
    return {"agent_loop/errors": float(sum(a["status"] == "error" for a in agents)),
            "agent_loop/timeouts": float(sum(a["status"] == "timeout" for a in agents))}


def loop_scores(stored: list[dict] | None) -> list[float | None] | None:
    """Per row, the score its loop set (``reward_score``; 0 for a failed loop), None where the
    scorer scores; None when no row has one."""
    if not stored:
        return None
    got = [(s.get("agent") or {}).get("reward_score") for s in stored]
    return got if any(g is not None for g in got) else None

