"""An OpenAI-compatible endpoint over the rollout engine, so an agent framework's own client
drives the episodes of a rollout (issue 45, item 3; ``rollout.openai_agent``, docs/agent.md).

During a rollout :class:`OpenAIServer` serves the engine as ``/v1/chat/completions`` and
``/v1/completions``, one base URL per episode (``http://HOST:PORT/episodes/<row>/v1``), and
records every completion token-exactly: the prompt ids it was sampled from, the sampled ids and
their log-probs. The episode's response is ASSEMBLED from those records, never re-tokenised:
request k > 0 must extend request k - 1's conversation (the same earlier messages, then the
assistant message exactly as it was returned), and only the messages after it are rendered by the
chat template and appended as ids (``agent/turns.observation_ids``). A client that rewrites
history (edits an earlier message, changes a returned assistant message, drops turns, changes the
tools) is refused with HTTP 400 naming the message: an episode is one token sequence, which is
what the trainer recomputes log-probs over (no "new segment" is started).

The k-th completion of episode ``row`` samples with seed ``turn_seed(step_seed, row, k)``, so an
episode's tokens depend on the agent's requests only, whatever the concurrency. Generation goes
through one callable, ``generate(prompt_ids, seed, max_new_tokens, params) -> (ids, logprobs)``
(:data:`GenerateFn`; default :func:`engine_generate`: the engine under a lock), so a batcher that
serves concurrent requests in one engine call plugs in unchanged.

What does not belong here: the tool loop (``rollout/multi_turn.py``), the dataset rows.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import importlib
import importlib.util
import inspect
import json
import math
import os
import re
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch

from verl_core.agent.tools import ToolCall, parse_hermes
from verl_core.agent.turns import TemplateError, observation_ids
from verl_core.errors import PermanentError
from verl_core.rollout.base import SamplingParams
from verl_core.rollout.multi_turn import MultiTurnOutput, turn_seed

GenerateFn = Callable[[list[int], int, int, SamplingParams], tuple[list[int], list[float]]]
"""``generate(prompt_ids, seed, max_new_tokens, params) -> (sampled_ids, logprobs)``: one
completion of ``prompt_ids`` (P,) drawn from ``seed``, at most ``max_new_tokens`` ids (stopping
after the first stop id, kept), each id's log-prob under the sampling distribution."""


class AgentFunctionError(PermanentError, ValueError):
    """A ``rollout.openai_agent`` that cannot be used: the message names it and the fix."""


class RequestRefused(Exception):
    """A request the endpoint answers with HTTP ``status`` and OpenAI's error body."""

    def __init__(self, message: str, status: int = 400, param: str | None = None):
        super().__init__(message)
        self.status, self.param = status, param


@dataclass(frozen=True)
class Budgets:
    """What one episode may use (the rollout's budgets)."""

    max_new_tokens: int
    """Response tokens of the whole episode: every completion's sampled ids and every appended
    message's ids (``rollout.max_new_tokens``, verl's ``response_length``)."""
    max_turns: int = 0
    """Completions per episode (``rollout.openai_max_turns``); 0: until the budget is spent."""
    max_prompt_length: int = 0
    """Ids of the episode's first prompt (``data.max_prompt_length``); 0: no limit."""


def engine_generate(engine) -> GenerateFn:
    """The default :data:`GenerateFn`: one ``engine.generate`` call per completion, under a lock
    (the engines are not thread-safe). The row's seed and limit make its ids those any batching
    would give (the engine contract's ``row_seeds``/``row_limits``)."""
    lock = threading.Lock()

    def generate(prompt_ids, seed, max_new_tokens, params):
        ids = torch.tensor([list(prompt_ids)], dtype=torch.long)  # (1, P)
        with lock:
            out = engine.generate(ids, torch.ones_like(ids),
                                  dataclasses.replace(params, max_new_tokens=max_new_tokens),
                                  row_seeds=[seed], row_limits=[max_new_tokens])
        take = int(out.response_mask[0].sum())
        return out.response_ids[0, :take].tolist(), out.logprobs[0, :take].tolist()
    return generate


# ---------------------------------------------------------------- messages
def _text(content) -> str:
    """A message's content as text: a string, None, or OpenAI's list of ``{"type": "text"}``
    parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for p in content:
            if not (isinstance(p, dict) and p.get("type") == "text"):
                raise RequestRefused("only text content parts are served (no images or audio)",
                                     param="messages")
            parts.append(str(p.get("text", "")))
        return "".join(parts)
    raise RequestRefused(f"a message's content must be a string or a list of text parts, got "
                         f"{type(content).__name__}", param="messages")


def _calls_of(msg: dict) -> list[tuple[str, Any]]:
    """An assistant message's tool calls as (name, parsed arguments), for comparison."""
    out = []
    for c in msg.get("tool_calls") or []:
        fn = (c or {}).get("function") or {}
        args = fn.get("arguments")
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except json.JSONDecodeError:
                pass
        out.append((fn.get("name"), args))
    return out


def _same(a: dict, b: dict) -> bool:
    """Two messages are the same turn: role, text and tool calls (ids and formatting aside)."""
    return (a.get("role") == b.get("role") and _text(a.get("content")) == _text(b.get("content"))
            and _calls_of(a) == _calls_of(b))


def _for_template(messages: list[dict]) -> list[dict]:
    """Messages as chat templates read them: text content, tool-call arguments as objects."""
    out = []
    for m in messages:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise RequestRefused("every message is an object with a 'role'", param="messages")
        m2 = {k: v for k, v in m.items() if v is not None}
        m2["content"] = _text(m.get("content"))
        if m.get("tool_calls"):
            m2["tool_calls"] = [{"type": "function", "function": {"name": n, "arguments": a}}
                                for n, a in _calls_of(m)]
        out.append(m2)
    return out


_TOOL_BLOCK = re.compile(r"<tool_call>.*?</tool_call>", re.DOTALL)


# ---------------------------------------------------------------- episodes
@dataclass
class Completion:
    """One served request of an episode: what it asked and what was sampled."""

    kind: str  # "chat" or "completion"
    request: dict  # chat: {"messages", "tools"}; completion: {"prompt"}
    prompt_ids: list[int]  # (P_k,) the ids the completion was sampled from
    appended: list[int]  # the ids this request added after the previous completion (k > 0)
    sampled: list[int]  # the sampled ids (the stop id included)
    logprobs: list[float]  # (len(sampled),) the engine's log-probs of them
    seed: int
    returned: dict  # chat: the assistant message as returned; completion: {"text"}


class Episode:
    """The completions of one episode, in order; its response is assembled from them."""

    def __init__(self, row: int):
        self.row = row
        self.completions: list[Completion] = []
        self.lock = asyncio.Lock()  # the episode's requests, one at a time (event loop side)
        self.guard = threading.Lock()  # closing against recording (the runner's thread side)
        self.closed: str | None = None  # why further requests are refused

    @property
    def used(self) -> int:
        """Response ids so far (appended and sampled)."""
        return sum(len(c.appended) + len(c.sampled) for c in self.completions)

    def assemble(self) -> tuple[list[int], list[int], list[float], list[float], list[dict]]:
        """(prompt ids, response ids, mask: 1 sampled / 0 appended, log-probs, turns)."""
        prompt = self.completions[0].prompt_ids if self.completions else []
        ids, mask, logp, turns = [], [], [], []
        for k, c in enumerate(self.completions):
            if k:
                start = len(ids)
                ids += c.appended
                mask += [0.0] * len(c.appended)
                logp += [0.0] * len(c.appended)
                turns[-1]["appended"] = [start, len(ids)]
            start = len(ids)
            ids += c.sampled
            mask += [1.0] * len(c.sampled)
            logp += list(c.logprobs)
            calls = [{"name": n, "arguments": a} for n, a in _calls_of(c.returned)]
            turns.append({"sampled": [start, len(ids)], "calls": calls, "results": [],
                          "request": c.request})
        return prompt, ids, mask, logp, turns


# ---------------------------------------------------------------- the server
class OpenAIServer:
    """The endpoint for the episodes of one rollout: ``rows``, their indices in the whole batch
    (the seeds' row; an int n: rows 0..n-1); a context manager: it listens from ``__enter__`` to
    ``__exit__`` only (an ephemeral port unless ``port``)."""

    # aiohttp (a dependency of Ray's dashboard, so installed wherever the project is) rather than
    # fastapi+uvicorn: one small app run on an event loop in a thread of the trainer, started and
    # stopped deterministically with AppRunner (the port is closed when __exit__ returns); no
    # server process, no pydantic models to keep in step with OpenAI's schema (the JSON is built
    # below and checked by the real `openai` client in the tests).

    def __init__(self, tokenizer, generate: GenerateFn, *, rows, step_seed: int,
                 params: SamplingParams, budgets: Budgets, stop_ids, host: str = "127.0.0.1",
                 port: int = 0, model_name: str = "policy"):
        self.tok, self.generate = tokenizer, generate
        self.step_seed, self.params, self.budgets = step_seed, params, budgets
        self.stop = set(int(i) for i in stop_ids)
        self.host, self.port, self.model_name = host, port, model_name
        rows = list(range(rows)) if isinstance(rows, int) else [int(r) for r in rows]
        self.episodes = {r: Episode(r) for r in rows}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._runner = None
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=max(1, len(rows)))

    # -------------------------------------------------------------- lifecycle
    def base_url(self, row: int) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/episodes/{row}/v1"

    def __enter__(self) -> "OpenAIServer":
        from aiohttp import web

        app = web.Application(client_max_size=64 * 2**20)
        app.router.add_post("/episodes/{row}/v1/chat/completions", self._chat)
        app.router.add_post("/episodes/{row}/v1/completions", self._completions)
        app.router.add_get("/episodes/{row}/v1/models", self._models)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True,
                                        name="openai-endpoint")
        self._thread.start()

        async def start():
            self._runner = web.AppRunner(app, access_log=None)
            await self._runner.setup()
            site = web.TCPSite(self._runner, self.host, self.port)
            await site.start()
            return self._runner.addresses[0][1]
        try:
            self.port = asyncio.run_coroutine_threadsafe(start(), self._loop).result(60)
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc) -> None:
        if self._loop is None:
            return
        for e in self.episodes.values():
            e.closed = e.closed or "the rollout is over"
        if self._runner is not None:
            asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(60)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(60)
        self._loop.close()
        self._loop = None
        self._pool.shutdown(wait=False, cancel_futures=True)

    def close_episode(self, row: int, why: str, *, drop: bool = False) -> None:
        """Refuse the episode's further requests (its agent failed); ``drop``: forget what it
        recorded too (an agent given up at its deadline: what it had sampled by then depends on
        timing, so it is not kept)."""
        ep = self.episodes[row]
        with ep.guard:
            ep.closed = why
            if drop:
                ep.completions.clear()

    def replay(self, turns: list[list[dict]]) -> None:
        """Serve each episode's stored requests (``turns``, as :meth:`output` gives them, one
        list per episode in order) again, without the agent: the same seeds, prompts and
        limits, so the episodes sample what they sampled when recorded."""
        async def episode(ep: Episode, stored: list[dict]) -> None:
            for t in stored:
                req = dict(t["request"])
                async with ep.lock:
                    await self._complete(ep, "chat" if "messages" in req else "completion", req)

        async def every():
            await asyncio.gather(*(episode(ep, t) for ep, t in zip(self.episodes.values(),
                                                                    turns)))
        asyncio.run_coroutine_threadsafe(every(), self._loop).result()

    # -------------------------------------------------------------- the output
    def output(self, pad_token_id: int, fallback_prompts: list[list[int]] | None = None):
        """``(prompts, out)``: each episode's first prompt ids (``fallback_prompts[row]`` for an
        episode that made no request) and the episodes' responses in the
        :class:`~verl_core.rollout.multi_turn.MultiTurnOutput` shape, in the order of ``rows``;
        ``turns`` keeps, per
        completion, the request (messages and tools, or prompt) and the spans."""
        prompts, resp, mask, logp, turns = [], [], [], [], []
        for j, e in enumerate(self.episodes.values()):
            p, i, m, lp, t = e.assemble()
            prompts.append(p or (fallback_prompts[j] if fallback_prompts else []))
            resp.append(i), mask.append(m), logp.append(lp), turns.append(t)
        T = max(1, max(len(r) for r in resp))
        pad = lambda xs, v: [x + [v] * (T - len(x)) for x in xs]  # noqa: E731
        out = MultiTurnOutput(
            response_ids=torch.tensor(pad(resp, pad_token_id), dtype=torch.long),
            response_mask=torch.tensor(pad(mask, 0.0), dtype=torch.float32),
            attention_mask=torch.tensor(pad([[1.0] * len(r) for r in resp], 0.0),
                                        dtype=torch.float32),
            logprobs=torch.tensor(pad(logp, 0.0), dtype=torch.float32),
            turns=turns, tool_rewards=[[] for _ in resp])
        return prompts, out

    # -------------------------------------------------------------- handlers
    def _episode(self, request) -> Episode:
        raw = request.match_info["row"]
        if not raw.isdigit() or int(raw) not in self.episodes:
            raise RequestRefused(f"no episode {raw!r} on this endpoint (its episodes: "
                                 f"{sorted(self.episodes)[:8]}...)", status=404)
        return self.episodes[int(raw)]

    async def _serve(self, request, kind: str):
        from aiohttp import web
        try:
            ep = self._episode(request)
            try:
                body = await request.json()
            except (json.JSONDecodeError, UnicodeDecodeError):
                raise RequestRefused("the request body is not JSON") from None
            if not isinstance(body, dict):
                raise RequestRefused("the request body must be a JSON object")
            async with ep.lock:  # an episode's requests are one sequence: served in turn
                return web.json_response(await self._complete(ep, kind, body))
        except RequestRefused as e:
            return web.json_response({"error": {"message": str(e), "type":
                                                "invalid_request_error", "param": e.param,
                                                "code": None}}, status=e.status)

    async def _chat(self, request):
        return await self._serve(request, "chat")

    async def _completions(self, request):
        return await self._serve(request, "completion")

    async def _models(self, request):
        from aiohttp import web
        return web.json_response({"object": "list", "data": [
            {"id": self.model_name, "object": "model", "created": 0, "owned_by": "verl-core"}]})

    def _check_params(self, body: dict) -> bool:
        """Refuse what cannot be served exactly; returns whether log-probs are asked for."""
        p = self.params
        for key, ours in (("temperature", p.temperature), ("top_p", p.top_p)):
            got = body.get(key)
            if got is not None and not math.isclose(float(got), ours, abs_tol=1e-9):
                raise RequestRefused(
                    f"{key}={got}: this rollout samples with {key}={ours} (the rollout's setting: "
                    f"the trainer recomputes log-probs with it); leave {key} out or send {ours}",
                    param=key)
        if body.get("n", 1) != 1:
            raise RequestRefused("n must be 1: each request of an episode is one completion "
                                 "(run several episodes for several samples)", param="n")
        if body.get("stream"):
            raise RequestRefused("stream=true is not served; send stream=false", param="stream")
        if body.get("stop"):
            raise RequestRefused("stop sequences are not served: a completion ends at the "
                                 "model's stop tokens (cut it in the agent instead)",
                                 param="stop")
        for key in ("presence_penalty", "frequency_penalty"):
            if body.get(key):
                raise RequestRefused(f"{key} is not served (it changes the sampling "
                                     "distribution the trainer recomputes)", param=key)
        if body.get("logit_bias"):
            raise RequestRefused("logit_bias is not served", param="logit_bias")
        if body.get("tool_choice") not in (None, "auto"):
            raise RequestRefused("tool_choice: only 'auto' is served (the model decides)",
                                 param="tool_choice")
        top = body.get("top_logprobs")
        if top:
            raise RequestRefused("top_logprobs is not served (only the sampled ids' log-probs)",
                                 param="top_logprobs")
        lp = body.get("logprobs")
        if lp is None or isinstance(lp, bool):
            return bool(lp)
        return True  # the text endpoint's integer: the sampled ids' log-probs (no alternatives)

    def _limit(self, ep: Episode, appended: int, body: dict) -> int:
        """The completion's ``max_new_tokens``: the request's ``max_tokens`` (or
        ``max_completion_tokens``) cut to what is left of the episode's budget; refused when the
        turn limit is reached or nothing is left."""
        b, k = self.budgets, len(ep.completions)
        if b.max_turns and k >= b.max_turns:
            raise RequestRefused(f"episode {ep.row} has made its {b.max_turns} completions "
                                 "(rollout.openai_max_turns): the episode is over")
        left = b.max_new_tokens - ep.used - appended
        if left <= 0:
            raise RequestRefused(
                f"episode {ep.row}: the response budget of {b.max_new_tokens} tokens "
                f"(rollout.max_new_tokens, sampled and appended ids together) is spent: "
                f"{ep.used} used, this request appends {appended}; the episode is over",
                param="messages")
        asked = body.get("max_completion_tokens", body.get("max_tokens"))
        if asked is not None and (not isinstance(asked, int) or asked < 1):
            raise RequestRefused(f"max_tokens={asked!r} must be a positive integer",
                                 param="max_tokens")
        return min(left, asked) if asked is not None else left

    async def _complete(self, ep: Episode, kind: str, body: dict) -> dict:
        if ep.closed:
            raise RequestRefused(f"episode {ep.row} is closed: {ep.closed}", status=409)
        want_logprobs = self._check_params(body)
        k = len(ep.completions)
        if k and ep.completions[0].kind != kind:
            began = "chat/completions" if kind != "chat" else "completions"
            raise RequestRefused(f"episode {ep.row} began with /v1/{began}; one episode uses "
                                 "one of the two endpoints")
        if kind == "chat":
            request, prompt_ids, appended = self._chat_prompt(ep, body)
        else:
            request, prompt_ids, appended = self._completion_prompt(ep, body)
        if not k and self.budgets.max_prompt_length and \
                len(prompt_ids) > self.budgets.max_prompt_length:
            raise RequestRefused(f"episode {ep.row}: the prompt has {len(prompt_ids)} tokens, "
                                 f"more than data.max_prompt_length="
                                 f"{self.budgets.max_prompt_length}", param="messages")
        limit = self._limit(ep, len(appended), body)
        request["max_tokens"] = limit  # what the completion was sampled with (a replay's)
        seed = turn_seed(self.step_seed, ep.row, k)
        loop = asyncio.get_running_loop()
        ids, logp = await loop.run_in_executor(
            self._pool, self.generate, prompt_ids, seed, limit, self.params)
        ids, logp = [int(i) for i in ids], [float(x) for x in logp]
        ended = bool(ids) and ids[-1] in self.stop
        body_ids = ids[:-1] if ended else ids
        if kind == "chat":
            text = self.tok.decode(body_ids, skip_special_tokens=False)
            calls = [c for c in parse_hermes(text) if isinstance(c, ToolCall)]
            content = _TOOL_BLOCK.sub("", text).strip() if calls else text
            returned = {"role": "assistant", "content": content or None, "tool_calls": [
                {"id": f"call_{ep.row}_{k}_{j}", "type": "function",
                 "function": {"name": c.name, "arguments": json.dumps(c.arguments)}}
                for j, c in enumerate(calls)] or None}
        else:
            returned = {"text": self.tok.decode(ids, skip_special_tokens=False)}
        with ep.guard:
            if ep.closed:  # the agent was given up while this completion ran: not recorded
                raise RequestRefused(f"episode {ep.row} is closed: {ep.closed}", status=409)
            ep.completions.append(Completion(kind, request, list(prompt_ids), list(appended),
                                             ids, logp, seed, returned))
        finish = "length" if not ended else \
            ("tool_calls" if kind == "chat" and returned["tool_calls"] else "stop")
        usage = {"prompt_tokens": len(prompt_ids), "completion_tokens": len(ids),
                 "total_tokens": len(prompt_ids) + len(ids)}
        tokens = [self.tok.decode([i], skip_special_tokens=False) for i in ids]
        rid = f"{ep.row}-{k}"
        if kind == "chat":
            choice = {"index": 0, "message": returned, "finish_reason": finish,
                      "logprobs": {"content": [
                          {"token": t, "logprob": lp, "bytes": list(t.encode("utf-8")),
                           "top_logprobs": []} for t, lp in zip(tokens, logp)]}
                      if want_logprobs else None}
            return {"id": f"chatcmpl-{rid}", "object": "chat.completion",
                    "created": int(time.time()), "model": self.model_name,
                    "choices": [choice], "usage": usage}
        offsets, at = [], 0
        for t in tokens:
            offsets.append(at)
            at += len(t)
        choice = {"index": 0, "text": returned["text"], "finish_reason": finish,
                  "logprobs": {"tokens": tokens, "token_logprobs": logp, "top_logprobs": None,
                               "text_offset": offsets} if want_logprobs else None}
        return {"id": f"cmpl-{rid}", "object": "text_completion", "created": int(time.time()),
                "model": self.model_name, "choices": [choice], "usage": usage}

    def _chat_prompt(self, ep: Episode, body: dict):
        msgs, tools = body.get("messages"), body.get("tools") or None
        if not isinstance(msgs, list) or not msgs:
            raise RequestRefused("messages must be a non-empty list", param="messages")
        if not getattr(self.tok, "chat_template", None):
            raise RequestRefused("the model's tokenizer has no chat template: use "
                                 "/v1/completions with the prompt text")
        request = {"messages": msgs, "tools": tools}
        if not ep.completions:
            text = self.tok.apply_chat_template(_for_template(msgs), tools=tools, tokenize=False,
                                                add_generation_prompt=True)
            return request, self.tok(text, add_special_tokens=False)["input_ids"], []
        prev = ep.completions[-1]
        before = prev.request["messages"]
        if tools != prev.request["tools"]:
            raise RequestRefused(f"episode {ep.row}: the tools differ from the episode's earlier "
                                 "requests; the chat template shows them in the prompt already "
                                 "sampled from, so they cannot change within an episode",
                                 param="tools")
        if len(msgs) < len(before) + 1:
            raise RequestRefused(
                f"episode {ep.row}: request {len(ep.completions)} has {len(msgs)} messages; it "
                f"must repeat the {len(before)} messages of the previous request and the "
                "assistant message returned to it, then add new messages (an episode is one "
                "token sequence: history is never rewritten)", param="messages")
        for i, (a, b) in enumerate(zip(msgs, before)):
            if not _same(a, b):
                raise RequestRefused(f"episode {ep.row}: message {i} ({a.get('role')!r}) differs "
                                     "from the one sent before; history cannot be rewritten "
                                     "within an episode (start a new episode instead)",
                                     param=f"messages[{i}]")
        i = len(before)
        if not _same(msgs[i], prev.returned):
            raise RequestRefused(
                f"episode {ep.row}: message {i} must be the assistant message the endpoint "
                f"returned (content {prev.returned['content']!r}, "
                f"{len(prev.returned['tool_calls'] or [])} tool call(s)) exactly; it was "
                f"{msgs[i].get('role')!r} with content {_text(msgs[i].get('content'))[:200]!r}. "
                "The trainer learns from the sampled ids, so the text the agent keeps must be "
                "the text that was sampled", param=f"messages[{i}]")
        new = msgs[i + 1:]
        for j, m in enumerate(new, start=i + 1):
            if m.get("role") not in ("tool", "user"):
                raise RequestRefused(f"episode {ep.row}: message {j} is a {m.get('role')!r} "
                                     "message; after a completion only 'tool' and 'user' "
                                     "messages can be added (the model samples every assistant "
                                     "turn; a system message mid-episode is not appended)",
                                     param=f"messages[{j}]")
        if not prev.sampled or prev.sampled[-1] not in self.stop:
            raise RequestRefused(f"episode {ep.row}: the previous completion stopped at its "
                                 "max_tokens without an end-of-turn token; the conversation "
                                 "cannot go on token-exactly (ask for more max_tokens)",
                                 param="messages")
        eot = self.tok.convert_ids_to_tokens(prev.sampled[-1])
        try:
            appended = observation_ids(self.tok, _for_template(new), end_of_turn=eot,
                                       tools=tools)
        except TemplateError as e:
            raise RequestRefused(f"episode {ep.row}: {e}") from None
        return request, prev.prompt_ids + prev.sampled + appended, appended

    def _completion_prompt(self, ep: Episode, body: dict):
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and not isinstance(prompt[0], int):
            prompt = prompt[0]  # a batch of one prompt
        as_ids = isinstance(prompt, list) and all(isinstance(i, int) and not isinstance(i, bool)
                                                  for i in prompt)
        if not (isinstance(prompt, str) or as_ids) or not prompt:
            raise RequestRefused("prompt must be one non-empty string or one list of token ids "
                                 "(n=1, one prompt per request)", param="prompt")
        request = {"prompt": prompt}
        if not ep.completions:
            ids = list(prompt) if as_ids else \
                self.tok(prompt, add_special_tokens=False)["input_ids"]
            return request, ids, []
        prev = ep.completions[-1]
        if as_ids:
            head = prev.prompt_ids + prev.sampled
            if prompt[:len(head)] != head:
                raise RequestRefused(f"episode {ep.row}: the prompt's ids must start with the "
                                     "previous prompt's ids and its completion's ids",
                                     param="prompt")
            appended = list(prompt[len(head):])
        else:
            before = prev.request["prompt"]
            if not isinstance(before, str):
                raise RequestRefused(f"episode {ep.row}: began with token ids; go on with ids",
                                     param="prompt")
            head = before + prev.returned["text"]
            if not prompt.startswith(head):
                raise RequestRefused(f"episode {ep.row}: the prompt must start with the previous "
                                     "prompt and the completion's text exactly (history cannot "
                                     "be rewritten)", param="prompt")
            rest = prompt[len(head):]
            appended = self.tok(rest, add_special_tokens=False)["input_ids"] if rest else []
        return request, prev.prompt_ids + prev.sampled + appended, appended


# ---------------------------------------------------------------- the agent function
def load_agent(spec: str) -> Callable:
    """The function ``spec`` names: ``path/to/file.py:function`` or a dotted
    ``module.function``; refused naming it when it cannot be loaded or is not callable."""
    target, sep, attr = spec.rpartition(":")
    if sep and target.endswith(".py"):
        if not os.path.isfile(target):
            raise AgentFunctionError(f"rollout.openai_agent={spec!r}: file {target!r} does not "
                                     "exist")
        mod_spec = importlib.util.spec_from_file_location(
            f"verl_agent_{abs(hash(os.path.abspath(target)))}", target)
        module = importlib.util.module_from_spec(mod_spec)
        try:
            mod_spec.loader.exec_module(module)
        except BaseException as e:  # noqa: BLE001 - user code: named, never raised through
            raise AgentFunctionError(f"rollout.openai_agent={spec!r}: running {target!r} raised "
                                     f"{type(e).__name__}: {e}") from e
    else:
        target, _, attr = spec.rpartition(".")
        if not target:
            raise AgentFunctionError(f"rollout.openai_agent={spec!r}: give "
                                     "'path/to/file.py:function' or 'package.module.function'")
        try:
            module = importlib.import_module(target)
        except BaseException as e:  # noqa: BLE001 - user code: named, never raised through
            raise AgentFunctionError(f"rollout.openai_agent={spec!r}: importing {target!r} "
                                     f"failed ({type(e).__name__}: {e})") from e
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise AgentFunctionError(f"rollout.openai_agent={spec!r}: {target!r} has no function "
                                 f"{attr!r}")
    return fn


@dataclass(frozen=True)
class EpisodeResult:
    reward: float | None  # the agent's own reward (None: it returned none)
    error: str | None  # why the episode failed (it raised, hung, or returned a non-number)


def _call(agent: Callable, base_url: str, row: dict):
    got = agent(base_url, row)
    if inspect.isawaitable(got):
        got = asyncio.run(_awaited(got))
    return got


async def _awaited(aw):
    return await aw


def run_episodes(agent: Callable, server: OpenAIServer, rows: list[dict],
                 timeout_s: float) -> list[EpisodeResult]:
    """Each row's episode: ``agent(server.base_url(r), rows[j])`` for the server's j-th episode
    ``r`` (async functions too), all
    rows concurrently, each in a thread of its own, each given ``timeout_s`` from the start.
    An agent that raises, hangs past its timeout or returns anything but a finite number or
    None is a failed episode (its endpoint then refuses further requests; a timed-out one's
    completions are dropped, a raised one's kept: they are the same in every run); never
    raised."""
    results: list[EpisodeResult | None] = [None] * len(rows)
    ids = list(server.episodes)
    if len(ids) != len(rows):
        raise ValueError(f"{len(rows)} rows for {len(ids)} episodes")

    def body(i: int) -> None:
        try:
            got = _call(agent, server.base_url(ids[i]), rows[i])
        except BaseException as e:  # noqa: BLE001 - user code: counted, never raised through
            results[i] = EpisodeResult(None, f"the agent raised {type(e).__name__}: {e}"[:500])
            return
        if got is not None and (isinstance(got, bool) or not isinstance(got, (int, float))
                                or not math.isfinite(got)):
            results[i] = EpisodeResult(None, f"the agent returned {got!r}; a finite number or "
                                             "None is its reward")
            return
        results[i] = EpisodeResult(None if got is None else float(got), None)

    threads = [threading.Thread(target=body, args=(i,), daemon=True, name=f"episode-{i}")
               for i in range(len(rows))]
    end = time.monotonic() + timeout_s
    for t in threads:
        t.start()
    for i, t in enumerate(threads):
        t.join(max(0.0, end - time.monotonic()))
        if t.is_alive() or results[i] is None:
            why = f"the agent ran past rollout.openai_agent_timeout_s={timeout_s}"
            server.close_episode(ids[i], why, drop=True)
            results[i] = EpisodeResult(None, why)
        elif results[i].error:
            server.close_episode(ids[i], results[i].error)
    return results


def join_agent_rewards(score: torch.Tensor, infos: list[dict]) -> torch.Tensor:
    """The score (N,) with each agent episode's outcome joined: a failed episode
    (``extra_info["agent_error"]``) scores 0; an agent's own reward
    (``extra_info["agent_reward"]``) is added to the scorer's. Rows of other rollouts keep
    theirs."""
    out = score.clone()
    for i, info in enumerate(infos):
        info = info or {}
        if info.get("agent_error"):
            out[i] = 0.0
        elif info.get("agent_reward") is not None:
            out[i] = out[i] + float(info["agent_reward"])
    return out


def agent_rollout(engine, tokenizer, prompts: list[list[int]], rows: list, params: SamplingParams,
                  rc, max_prompt_length: int, generate: GenerateFn | None = None,
                  rows_index: list[int] | None = None):
    """The rollout of ``rollout.openai_agent``: one episode per row (``rows`` (N,) the dataset
    rows, ``prompts`` (N,) their encoded prompts), each driven by the agent function against its
    own base URL; ``rows_index`` (N,): each row's index in the whole batch (its seeds; default
    0..N-1). Returns ``(prompts, out, infos, metrics)``: each episode's first prompt ids,
    the :class:`MultiTurnOutput`, the rows' ``extra_info`` with ``agent_reward`` /
    ``agent_error``, and ``agent/errors`` (failed episodes), ``agent/reward_mean``."""
    agent = load_agent(rc.openai_agent)
    budgets = Budgets(max_new_tokens=params.max_new_tokens, max_turns=rc.openai_max_turns,
                      max_prompt_length=max_prompt_length)
    from verl_core.data.dataset import render_prompt
    payload = [{"index": r.index, "messages": r.chat, "prompt": render_prompt(r, tokenizer),
                "ground_truth": r.ground_truth, "data_source": r.data_source,
                "extra_info": dict(r.extra_info or {})} for r in rows]
    with engine.held(), OpenAIServer(tokenizer, generate or engine_generate(engine),
                                     rows=rows_index if rows_index is not None else len(rows),
                                     step_seed=params.seed, params=params,
                                     budgets=budgets, stop_ids=engine.eos_token_ids,
                                     host=rc.openai_host) as server:
        results = run_episodes(agent, server, payload, rc.openai_agent_timeout_s)
        first, out = server.output(engine.pad_token_id, prompts)
    infos = [{**(r.extra_info or {}), "num_turns": len(t), "agent_reward": res.reward,
              "agent_error": res.error} for r, t, res in zip(rows, out.turns, results)]
    rewards = [res.reward for res in results if res.reward is not None]
    metrics = {"agent/errors": float(sum(res.error is not None for res in results)),
               "agent/reward_mean": sum(rewards) / len(rewards) if rewards else 0.0,
               "num_turns/mean": sum(len(t) for t in out.turns) / max(1, len(out.turns))}
    return first, out, infos, metrics
