"""Tools for multi-turn rollouts, on verl's contract (issue 25, its first part).

- **The tool config**: verl's YAML (``actor_rollout_ref.rollout.multi_turn.tool_config_path``):
  ``tools: [{class_name, config, tool_schema: {type: function, function: {name, description,
  parameters}}}]``, checked entry by entry (:func:`load_tool_config`). ``class_name`` is a dotted
  ``module.Class`` (verl's) or ``path/to/file.py:Class``.
- **Tool calls** in verl's default ``hermes`` format, what Qwen2.5/Qwen3 templates emit:
  ``<tool_call>{"name": …, "arguments": {…}}</tool_call>`` (:func:`parse_hermes`). A call that is
  not valid JSON, names no tool or has arguments that are not an object becomes a
  :class:`BadToolCall`, whose error the model is shown instead of a tool's output.
- **The tool host** (:class:`ToolHost`): the tools' classes are imported, built and called in a
  child process, never in the trainer's, like custom scorers (``reward/manager.py``). Classes
  with verl's ``BaseTool`` methods work without verl installed: ``__init__(config,
  tool_schema)``, async ``create(instance_id, **kwargs)``, ``execute(instance_id, parameters,
  **kwargs) -> (response, reward, metrics)`` (``response`` a ``str`` or anything with ``.text``),
  ``calc_reward`` and ``release``. Every request runs under ``timeout_s``; a request that
  overruns gets a timeout, one that ends the host's process an error, and the host is replaced;
  the calls they held up are served again on the new host, where each live tool instance is
  created again from its ``create`` request (the state it gathered since is lost; an instance
  already released is unknown there, and its calls say so). A tool that raises, returns a wrong
  type, a non-finite reward or an answer that cannot cross the pipe, or gets arguments its
  schema refuses answers with an error (:class:`ToolResult`), never an exception in the
  trainer.
- :class:`CalculatorTool`: the built-in tool of the ``calculator`` task (exact arithmetic on
  the numbers and ``+ - * / ( )`` of an expression; no ``eval``).

``agent/turns.py`` renders what a rollout appends after a turn (the tool responses and the next
assistant header, as token ids of the model's own chat template); ``rollout/multi_turn.py``
samples the turns on either rollout engine, which the rollout phase runs with
``rollout.multi_turn``.
"""

from __future__ import annotations

import ast
import asyncio
import importlib
import importlib.util
import json
import math
import multiprocessing
import os
import pickle
import re
import threading
import time
import traceback
import types
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any, Callable

from verl_core.agent.turns import valid_text
from verl_core.errors import PermanentError


class ToolConfigError(PermanentError, ValueError):
    """A tool config that cannot be used: the message names the file, the entry and the fix."""


# ---------------------------------------------------------------- the config
@dataclass(frozen=True)
class ToolEntry:
    """One tool of the config: its class, its ``config`` (given to the class) and its schema
    (what the chat template shows the model)."""

    class_name: str
    config: dict
    schema: dict

    @property
    def name(self) -> str:
        return self.schema["function"]["name"]


def load_tool_config(path: str) -> list[ToolEntry]:
    """The tools of a verl tool YAML, every entry checked (a wrong one is named with the fix)."""
    import yaml

    try:
        with open(path) as f:
            doc = yaml.safe_load(f)
    except OSError as e:
        raise ToolConfigError(f"tool config {path!r} cannot be read ({e}); "
                              "multi_turn.tool_config_path names a local YAML file") from e
    except yaml.YAMLError as e:
        raise ToolConfigError(f"tool config {path!r} is not valid YAML: {e}") from e
    tools = doc.get("tools") if isinstance(doc, dict) else None
    if not isinstance(tools, list) or not tools:
        raise ToolConfigError(f"tool config {path!r}: expected a top-level 'tools' list with at "
                              "least one entry (verl's layout: tools: [{class_name, config, "
                              "tool_schema}])")
    out, seen = [], {}
    for i, t in enumerate(tools):
        where = f"tool config {path!r}, tools[{i}]"
        if not isinstance(t, dict):
            raise ToolConfigError(f"{where}: expected a mapping with class_name, config and "
                                  f"tool_schema, got {type(t).__name__}")
        cls = t.get("class_name")
        if not isinstance(cls, str) or not cls.strip():
            raise ToolConfigError(f"{where}: class_name must name the tool's class "
                                  "('package.module.Class' or 'path/to/file.py:Class')")
        config = t.get("config") or {}
        if not isinstance(config, dict):
            raise ToolConfigError(f"{where}: config must be a mapping (the class's settings)")
        schema = t.get("tool_schema")
        _check_schema(where, schema)
        name = schema["function"]["name"]
        if name in seen:
            raise ToolConfigError(f"{where}: a second tool named {name!r} (tools[{seen[name]}] "
                                  "has that name); tool names must be unique")
        seen[name] = i
        out.append(ToolEntry(cls.strip(), dict(config), schema))
    return out


BUILTIN_CALCULATOR = "builtin:calculator"
"""``rollout.tool_config_path`` of the built-in calculator (:class:`CalculatorTool`), the
``calculator`` task's tool, with no YAML to write."""


def tool_entries(path: str) -> list[ToolEntry]:
    """The tools ``rollout.tool_config_path`` names: :data:`BUILTIN_CALCULATOR` or a verl tool
    YAML (:func:`load_tool_config`)."""
    if path == BUILTIN_CALCULATOR:
        return [ToolEntry(f"{__name__}.CalculatorTool", {}, CalculatorTool.SCHEMA)]
    return load_tool_config(path)


def _check_schema(where: str, schema: Any) -> None:
    if not isinstance(schema, dict) or schema.get("type") != "function":
        raise ToolConfigError(f"{where}: tool_schema must be an OpenAI function schema: "
                              "{type: function, function: {name, description, parameters}}")
    fn = schema.get("function")
    if not isinstance(fn, dict):
        raise ToolConfigError(f"{where}: tool_schema.function must be a mapping with name, "
                              "description and parameters")
    name = fn.get("name")
    if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_.-]*", name):
        raise ToolConfigError(f"{where}: tool_schema.function.name={name!r} must be a name "
                              "the model can write (letters, digits, _ . -)")
    params = fn.get("parameters", {"type": "object", "properties": {}})
    if not isinstance(params, dict) or params.get("type") != "object":
        raise ToolConfigError(f"{where}: tool_schema.function.parameters must be a JSON schema "
                              "of type object (the call's arguments)")
    import jsonschema

    try:
        jsonschema.Draft202012Validator.check_schema(params)
    except jsonschema.SchemaError as e:
        raise ToolConfigError(f"{where}: tool_schema.function.parameters is not a valid JSON "
                              f"schema: {e.message}") from e


def load_tool_class(class_name: str, methods: tuple[str, ...] = ("create", "execute", "release"),
                    what: str = "tool") -> type:
    """The class ``class_name`` names: ``path/to/file.py:Class`` or a dotted ``module.Class``,
    with the ``methods`` (verl's BaseTool's; ``what``: the kind of class, for messages)."""
    target, sep, attr = class_name.rpartition(":")
    if sep and target.endswith(".py"):
        if not os.path.isfile(target):
            raise ToolConfigError(f"{what} class {class_name!r}: file {target!r} does not exist")
        spec = importlib.util.spec_from_file_location(
            f"verl_tool_{abs(hash(os.path.abspath(target)))}", target)
        module = importlib.util.module_from_spec(spec)
        try:
            spec.loader.exec_module(module)
        except BaseException as e:  # noqa: BLE001 - user code: named, never raised through
            raise ToolConfigError(f"{what} class {class_name!r}: running {target!r} raised "
                                  f"{type(e).__name__}: {e}") from e
    else:
        target, _, attr = class_name.rpartition(".")
        if not target:
            raise ToolConfigError(f"{what} class {class_name!r}: give 'package.module.Class' or "
                                  "'path/to/file.py:Class'")
        try:
            module = importlib.import_module(target)
        except BaseException as e:  # noqa: BLE001 - user code: named, never raised through
            raise ToolConfigError(f"{what} class {class_name!r}: importing module {target!r} "
                                  f"failed ({type(e).__name__}: {e}); check the name, install "
                                  "the package, or give 'path/to/file.py:Class'") from e
    cls = getattr(module, attr, None)
    if not isinstance(cls, type):
        raise ToolConfigError(f"{what} class {class_name!r}: {target!r} has no class {attr!r}")
    missing = [m for m in methods if not callable(getattr(cls, m, None))]
    if missing:
        base = "BaseTool" if what == "tool" else "BaseInteraction"
        raise ToolConfigError(f"{what} class {class_name!r} lacks verl's {base} methods "
                              f"{missing} ({', '.join(methods)})")
    return cls


class ToolSchema(dict):
    """The schema a tool's ``__init__`` gets: the YAML's mapping, also readable as verl's
    ``OpenAIFunctionToolSchema`` is (``schema.function.name``, ``schema.model_dump()``)."""

    def __getattr__(self, key: str):
        try:
            value = self[key]
        except KeyError:
            raise AttributeError(key) from None
        return ToolSchema(value) if isinstance(value, dict) else value

    def model_dump(self, **_) -> dict:
        return json.loads(json.dumps(self))


# ---------------------------------------------------------------- tool calls (hermes)
@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict


@dataclass(frozen=True)
class BadToolCall:
    """A ``<tool_call>`` block that is not a call: ``error`` is what the model is told."""

    text: str
    error: str


_HERMES = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


def _loads_valid(text: str):
    """``json.loads`` with every string made valid text: a ``"\\udcff"`` escape decodes to a lone
    surrogate, which neither the tokenizer nor the stored batch takes (:func:`valid_text`)."""
    return json.loads(valid_text(json.dumps(json.loads(text), ensure_ascii=False)))


def parse_hermes(text: str) -> list[ToolCall | BadToolCall]:
    """The tool calls of one assistant turn, in order (verl's ``HermesToolParser``: a JSON object
    with ``name`` and ``arguments`` between ``<tool_call>`` tags; ``arguments`` may also be a
    JSON string of an object, as some models write it)."""
    calls: list[ToolCall | BadToolCall] = []
    for m in _HERMES.finditer(text):
        raw = m.group(1).strip()
        try:
            obj = _loads_valid(raw)
        except json.JSONDecodeError as e:
            calls.append(BadToolCall(raw, f"the tool call is not valid JSON ({e.msg} at "
                                          f"character {e.pos})"))
            continue
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            calls.append(BadToolCall(raw, 'a tool call is {"name": <tool name>, "arguments": '
                                          "<object>}"))
            continue
        args = obj.get("arguments", {})
        if isinstance(args, str):
            try:
                args = _loads_valid(args) if args.strip() else {}
            except json.JSONDecodeError:
                pass
        if not isinstance(args, dict):
            calls.append(BadToolCall(raw, f"the arguments of {obj['name']!r} must be a JSON "
                                          "object"))
            continue
        calls.append(ToolCall(obj["name"], args))
    return calls


# ---------------------------------------------------------------- the host (child process)
@dataclass(frozen=True)
class ToolResult:
    """What a request to the host gave: ``status`` ``ok`` (``text``, ``reward``, ``metrics``),
    ``error`` (the tool raised, returned a wrong type, or refused its arguments: ``error``) or
    ``timeout``; ``latency_s`` as the host measured it."""

    status: str
    text: str = ""
    reward: float = 0.0
    metrics: dict = field(default_factory=dict)
    error: str = ""
    latency_s: float = 0.0

    def observation(self) -> str:
        """What the model reads back: the tool's output, or the error as verl shows it."""
        if self.status == "ok":
            return self.text
        if self.status == "timeout":
            return f"Error: the tool call did not finish within its {self.error}"
        return f"Error: {self.error}"


def _host_main(conn, entries: list[ToolEntry], running) -> None:
    """The child: build every tool, answer ``("ready", None)`` or ``("load_error", message)``,
    then serve requests ``(req_id, op, tool, instance_id, kwargs, max_chars)`` concurrently on
    one event loop, each answered with ``(req_id, pickled ToolResult)``. ``running`` (a shared
    integer) holds the id of the request whose code the loop is executing, 0 between steps: what
    the trainer reads to tell which call hung or crashed the host."""
    tools = {}
    try:
        for e in entries:
            cls = load_tool_class(e.class_name)
            try:
                tools[e.name] = (cls(e.config, ToolSchema(e.schema)), e)
            except BaseException as exc:  # noqa: BLE001 - user code
                raise ToolConfigError(f"tool class {e.class_name!r} (tool {e.name!r}): building "
                                      f"it raised {type(exc).__name__}: {exc}") from exc
    except BaseException as exc:  # noqa: BLE001 - sent back as text
        conn.send(("load_error", str(exc)))
        return
    conn.send(("ready", None))
    asyncio.run(_serve(conn, tools, running))


async def _serve(conn, tools: dict, running) -> None:
    loop = asyncio.get_running_loop()
    pending: set = set()
    while True:
        msg = await loop.run_in_executor(None, conn.recv)
        if msg is None:
            break
        task = asyncio.create_task(_answer(conn, tools, running, *msg))
        pending.add(task)
        task.add_done_callback(pending.discard)
    if pending:
        await asyncio.wait(pending)


class _Refused(Exception):
    """A tool's answer that is not one (its message is the model's observation)."""


@types.coroutine
def _tracked(coro, running, req_id: int):
    """``await coro`` with ``running.value = req_id`` while each of its steps executes (a
    trampoline: every value ``coro`` yields goes to the event loop and back unchanged)."""
    value, exc = None, None
    while True:
        running.value = req_id
        try:
            yielded = coro.throw(exc) if exc is not None else coro.send(value)
        except StopIteration as stop:
            return stop.value
        finally:
            running.value = 0
        try:
            value, exc = (yield yielded), None
        except BaseException as e:  # noqa: BLE001 - handed to coro, as await would
            value, exc = None, e


def _precut(text: str, max_chars: int | None) -> str:
    """The first and last ``max_chars`` characters of a longer ``text``: all the trainer's
    :func:`~verl_core.agent.turns.truncate_observation` can keep, on any side, so the cut
    observation is the same and a tool's 50 MB answer never crosses the pipe."""
    if max_chars and len(text) > 2 * max_chars:
        return text[:max_chars] + text[len(text) - max_chars:]
    return text


def _pickled(res: ToolResult, name: str) -> bytes:
    try:
        return pickle.dumps(res)
    except Exception as e:  # noqa: BLE001 - a tool's metrics of any type
        return pickle.dumps(ToolResult(
            "error", error=f"{name}: its answer cannot be sent to the trainer ({type(e).__name__}:"
                           f" {e}); return a str (or .text), a float and a dict of plain values",
            latency_s=res.latency_s))


async def _answer(conn, tools: dict, running, req_id: int, op: str, name: str, instance_id: str,
                  kwargs: dict, max_chars: int | None = None) -> None:
    t0 = time.perf_counter()
    try:
        res = await _tracked(_run(tools, op, name, instance_id, kwargs), running, req_id)
    except _Refused as e:
        res = ToolResult("error", error=str(e))
    except BaseException as e:  # noqa: BLE001 - a tool's failure is the model's observation
        res = ToolResult("error", error=f"{name}: {type(e).__name__}: {e}",
                         metrics={"traceback": traceback.format_exc(limit=5)})
    res = ToolResult(res.status, _precut(res.text, max_chars), res.reward, res.metrics,
                     _precut(res.error, max_chars), time.perf_counter() - t0)
    conn.send((req_id, _pickled(res, name)))


def _finite(name: str, what: str, value) -> float:
    """A tool's reward as a finite float; anything else is refused (a NaN would be summed into
    the row's score)."""
    try:
        reward = float(value or 0.0)
    except (TypeError, ValueError):
        raise _Refused(f"{name}: {what}'s reward {value!r} is not a number") from None
    if not math.isfinite(reward):
        raise _Refused(f"{name}: {what}'s reward is {reward}; a reward must be a finite number")
    return reward


async def _maybe_await(value):
    return await value if asyncio.iscoroutine(value) else value


async def _run(tools: dict, op: str, name: str, instance_id: str, kwargs: dict) -> ToolResult:
    if name not in tools:
        return ToolResult("error", error=f"unknown tool {name!r}; the tools are "
                                         f"{sorted(tools)}")
    tool, entry = tools[name]
    if op == "create":
        await _maybe_await(tool.create(instance_id, **kwargs))
        return ToolResult("ok")
    if op == "execute":
        import jsonschema

        params = entry.schema["function"].get("parameters", {"type": "object"})
        try:
            jsonschema.validate(kwargs["parameters"], params)
        except jsonschema.ValidationError as e:
            return ToolResult("error", error=f"{name}: bad arguments: {e.message}")
        extra = {k: v for k, v in kwargs.items() if k != "parameters"}  # execute_kwargs
        out = await _maybe_await(tool.execute(instance_id, kwargs["parameters"], **extra))
        if not (isinstance(out, tuple) and len(out) == 3):
            return ToolResult("error", error=f"{name}: execute returned "
                                             f"{type(out).__name__}, not (response, reward, "
                                             "metrics)")
        response, reward, metrics = out
        text = response if isinstance(response, str) else getattr(response, "text", None)
        if not isinstance(text, str):
            return ToolResult("error", error=f"{name}: execute's response is a "
                                             f"{type(response).__name__}: neither a str nor "
                                             "anything with a .text str")
        return ToolResult("ok", text=str.__str__(text),  # a plain str, never a user's subclass
                          reward=_finite(name, "execute", reward),
                          metrics=dict(metrics) if isinstance(metrics, dict) else {})
    if op == "calc_reward":
        fn = getattr(tool, "calc_reward", None)
        return ToolResult("ok", reward=_finite(name, "calc_reward",
                                               await _maybe_await(fn(instance_id)))
                          if callable(fn) else 0.0)
    if op == "release":
        await _maybe_await(tool.release(instance_id))
        return ToolResult("ok")
    raise ValueError(f"unknown request {op!r}")


def _mp_context():
    methods = multiprocessing.get_all_start_methods()
    return multiprocessing.get_context("forkserver" if "forkserver" in methods else "spawn")


@dataclass(frozen=True)
class Request:
    """One request to the host: ``op`` is ``create`` (``kwargs``: the row's
    ``tools_kwargs[name]['create_kwargs']``), ``execute`` (``kwargs={"parameters": …}``),
    ``calc_reward`` or ``release``."""

    op: str
    tool: str
    instance_id: str
    kwargs: dict = field(default_factory=dict)


class ToolHost:
    """The tools of a run in a child process; :meth:`run` answers a batch of requests
    concurrently (a batch's latency is its slowest call's, not the sum), each within
    ``timeout_s``. Use as a context manager, or call :meth:`close`.

    A call that hangs (blocks the host's event loop past its deadline) or ends the host's
    process (``os._exit``, a segfault) is told apart from the calls it held up: the host marks
    which request's code it is executing. That call alone times out or fails; the host is
    replaced and the other calls are served again on the new one, each with a deadline of its
    own (the rollout's budget still bounds them all). A tool instance the dead host held is
    created again from its ``create`` request before its next call (the state it gathered
    since is lost)."""

    def __init__(self, entries: list[ToolEntry], *, timeout_s: float = 30.0,
                 start_timeout_s: float = 120.0):
        if not entries:
            raise ValueError("a ToolHost needs at least one tool")
        self.entries = list(entries)
        self.names = [e.name for e in entries]
        self.timeout_s = float(timeout_s)
        self.start_timeout_s = float(start_timeout_s)
        self.restarts = 0
        self.on_calls_sent: Callable[[], None] | None = None
        """Called once a batch holding ``execute`` calls is sent, before any answer is read (its
        owner sets it for a training rollout: VERL_FAULTS' ``tool_call`` drill, which this layer
        does not import)."""
        self._proc = None
        self._conn = None
        self._running = None
        self._next_id = 0
        self._created: dict[tuple[str, str], Request] = {}  # live instances: their create
        self._here: set[tuple[str, str]] = set()  # those the current host process holds

    def start(self) -> None:
        """Start the child and build every tool there; a class that cannot be imported or built
        raises :class:`ToolConfigError` naming it (before any rollout). A host that died since
        its last batch is replaced."""
        if self._proc is not None:
            if self._proc.is_alive():
                return
            self._kill()
            self.restarts += 1
        ctx = _mp_context()
        parent, child = ctx.Pipe()
        running = ctx.RawValue("q", 0)
        proc = ctx.Process(target=_host_main, args=(child, self.entries, running), daemon=True)
        proc.start()
        child.close()
        if not parent.poll(self.start_timeout_s):
            proc.kill()
            proc.join()
            raise ToolConfigError(f"the tools {self.names} were not built within "
                                  f"{self.start_timeout_s:g}s (does a class hang in its import "
                                  "or __init__?)")
        try:
            kind, msg = parent.recv()
        except (EOFError, OSError):
            proc.join()
            raise ToolConfigError(f"the tool host died while building the tools {self.names} "
                                  f"(exit code {proc.exitcode})") from None
        if kind != "ready":
            proc.join()
            raise ToolConfigError(msg)
        self._proc, self._conn, self._running = proc, parent, running

    def run(self, requests: list[Request], timeout_s: float | None = None,
            max_chars: int | None = None) -> list[ToolResult]:
        """Send every request at once; each answer, or ``timeout`` for a call not answered
        within its deadline, or ``error`` for a call that ended the host (see the class's
        docstring). ``timeout_s``: a shorter deadline for the whole batch (what is left of a
        rollout's budget; at 0 nothing is sent and every request times out). ``max_chars``: the
        host sends at most the first and last ``max_chars`` characters of an answer."""
        end = None if timeout_s is None else time.monotonic() + timeout_s
        out: list[ToolResult | None] = [None] * len(requests)
        todo = list(range(len(requests)))
        while todo:
            left = None if end is None else end - time.monotonic()
            if left is not None and left <= 0:
                for k in todo:
                    out[k] = ToolResult("timeout", error="rollout's tool_budget_s (spent)")
                break
            limit = self.timeout_s if left is None else min(self.timeout_s, left)
            again = self._recreate([requests[k] for k in todo])
            if again:
                self._round(again, limit, max_chars)
            for k, res in zip(todo, self._round([requests[k] for k in todo], limit, max_chars)):
                out[k] = res
            todo = [k for k in todo if out[k] is None]  # held up by a call that hung or crashed
        return out  # type: ignore[return-value]

    def _recreate(self, requests: list[Request]) -> list[Request]:
        """The ``create`` requests of the live instances ``requests`` use that the current host
        does not hold (it replaced the one that created them)."""
        if self._proc is None or not self._proc.is_alive():
            self._here.clear()
        keys = {(r.tool, r.instance_id) for r in requests if r.op != "create"}
        return [self._created[k] for k in sorted(keys) if k in self._created
                and k not in self._here]

    def _round(self, requests: list[Request], limit: float,
               max_chars: int | None) -> list[ToolResult | None]:
        """One batch on the current host, under ``limit`` seconds: each answer, or None for a
        call that was held up by another call that hung or crashed the host (that call's
        result says which)."""
        self.start()
        out: list[ToolResult | None] = [None] * len(requests)
        ids, broken = {}, []
        msgs = []
        for k, r in enumerate(requests):
            self._next_id += 1
            ids[self._next_id] = k
            msgs.append((self._next_id, r.op, r.tool, r.instance_id, dict(r.kwargs), max_chars))

        def send(conn=self._conn):
            # in a thread of its own: the answers are read while the requests are still being
            # sent, so a batch larger than the pipe's buffers (the host blocked on sending
            # answers nobody reads, this side on sending requests it no longer reads) cannot
            # deadlock
            try:
                for m in msgs:
                    conn.send(m)
            except OSError:  # a broken pipe: the host is gone
                broken.append(True)

        sender = threading.Thread(target=send, name="tool-host-send", daemon=True)
        sender.start()
        died = False
        if self.on_calls_sent is not None and any(r.op == "execute" for r in requests):
            self.on_calls_sent()  # the calls are in flight
        deadline = time.monotonic() + limit
        left = len(requests)
        while left and not died:
            wait = deadline - time.monotonic()
            if wait <= 0 or not self._conn.poll(wait):
                break
            try:
                req_id, data = self._conn.recv()
            except (EOFError, OSError):  # the host's end closed: it died (exit, signal)
                died = True
                break
            k = ids.get(req_id)
            if k is not None and out[k] is None:
                out[k] = self._note(requests[k], _unpickled(data, requests[k]))
                left -= 1
        died = died or bool(broken)
        if not left:
            sender.join()
            return out
        culprit = ids.get(self._culprit())
        code = self._kill()
        sender.join()  # the pipe is closed: a send still blocked fails at once
        self.restarts += 1
        for k, r in enumerate(requests):
            if out[k] is None and (culprit is None or k == culprit):
                out[k] = ToolResult("error", error=_death(r, code)) if died else \
                    ToolResult("timeout", error=f"tool_timeout_s={limit:g}s"
                               if limit == self.timeout_s else
                               f"rollout's tool_budget_s ({limit:g}s left)", latency_s=limit)
        return out

    def _culprit(self) -> int:
        """The id of the request whose code the host is stuck in (or died in), 0 for none: the
        same id read twice 50 ms apart (a call merely stepping at that moment moves on)."""
        first = self._running.value
        if not first:
            return 0
        time.sleep(0.05)
        return first if self._running.value == first else 0

    def _note(self, r: Request, res: ToolResult) -> ToolResult:
        """Keep the ``create`` of each live instance (to create it again on a new host)."""
        key = (r.tool, r.instance_id)
        if r.op == "create" and res.status == "ok":
            self._created[key] = r
            self._here.add(key)
        elif r.op == "release":
            self._created.pop(key, None)
            self._here.discard(key)
        return res

    def _kill(self) -> int | None:
        """End the host; its exit code (negative: the signal that ended it)."""
        code = None
        if self._proc is not None:
            self._proc.kill()
            self._proc.join()
            self._conn.close()
            code = self._proc.exitcode
        self._proc = self._conn = self._running = None
        self._here.clear()
        return code

    def close(self) -> None:
        if self._proc is not None:
            try:
                self._conn.send(None)
                self._proc.join(timeout=5)
            except (OSError, EOFError):
                pass
            self._kill()

    def __enter__(self) -> "ToolHost":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _unpickled(data: bytes, r: Request) -> ToolResult:
    try:
        return pickle.loads(data)
    except Exception as e:  # noqa: BLE001 - e.g. a class only the host can import
        return ToolResult("error", error=f"{r.tool}: its answer cannot be read in the trainer "
                                         f"({type(e).__name__}: {e}); return a str (or .text), "
                                         "a float and a dict of plain values")


def _death(r: Request, code: int | None) -> str:
    import signal

    how = f"killed by {signal.Signals(-code).name}" if code is not None and code < 0 and \
        -code in signal.valid_signals() else f"exit code {code}"
    return (f"{r.tool}: the tool host died ({how}) during this call (instance "
            f"{r.instance_id!r}); a new host serves the other calls. A tool must not end or "
            "crash its process: catch its errors, and run code that can crash (native "
            "extensions, os._exit) in a subprocess of its own")


# ---------------------------------------------------------------- the calculator
class CalculatorTool:
    """Exact arithmetic for the ``calculator`` task, on verl's ``BaseTool`` contract: its one
    argument ``expression`` holds numbers, ``+ - * /`` and parentheses; the answer is the exact
    value (a fraction reduced, an integer when whole). Parsed with ``ast`` and evaluated node by
    node over :class:`fractions.Fraction`: no ``eval``, no names, no calls, no powers."""

    SCHEMA = {"type": "function", "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression exactly (+ - * / and parentheses).",
        "parameters": {"type": "object", "required": ["expression"],
                       "properties": {"expression": {"type": "string",
                                                     "description": "e.g. (1234 + 56) * 7"}}}}}
    MAX_CHARS = 200
    MAX_DIGITS = 40

    def __init__(self, config: dict | None = None, tool_schema: Any = None):
        self.config = config or {}

    async def create(self, instance_id: str | None = None, **kwargs) -> str:
        return instance_id or ""

    async def execute(self, instance_id: str, parameters: dict, **kwargs):
        expr = parameters.get("expression", "")
        try:
            value = self.evaluate(expr)
        except ValueError as e:
            return f"error: {e}", 0.0, {"ok": False}
        return self.render(value), 0.0, {"ok": True}

    async def calc_reward(self, instance_id: str, **kwargs) -> float:
        return 0.0

    async def release(self, instance_id: str, **kwargs) -> None:
        return None

    @classmethod
    def evaluate(cls, expr: str) -> Fraction:
        if not isinstance(expr, str) or not expr.strip():
            raise ValueError("give an expression, e.g. 12 * (3 + 4)")
        if len(expr) > cls.MAX_CHARS:
            raise ValueError(f"the expression is longer than {cls.MAX_CHARS} characters")
        try:
            tree = ast.parse(expr.strip(), mode="eval")
        except SyntaxError:
            raise ValueError(f"cannot parse {expr!r}") from None
        return cls._eval(tree.body)

    @classmethod
    def _eval(cls, node) -> Fraction:
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return Fraction(str(node.value))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.UAdd, ast.USub)):
            v = cls._eval(node.operand)
            return v if isinstance(node.op, ast.UAdd) else -v
        if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Sub, ast.Mult,
                                                                 ast.Div)):
            a, b = cls._eval(node.left), cls._eval(node.right)
            if isinstance(node.op, ast.Div) and b == 0:
                raise ValueError("division by zero")
            v = {ast.Add: a + b, ast.Sub: a - b, ast.Mult: a * b}.get(type(node.op)) \
                if not isinstance(node.op, ast.Div) else a / b
            if max(len(str(abs(v.numerator))), len(str(v.denominator))) > cls.MAX_DIGITS:
                raise ValueError(f"a value has more than {cls.MAX_DIGITS} digits")
            return v
        raise ValueError("only numbers, + - * / and parentheses are allowed")

    @staticmethod
    def render(value: Fraction) -> str:
        return str(value.numerator) if value.denominator == 1 else \
            f"{value.numerator}/{value.denominator}"
