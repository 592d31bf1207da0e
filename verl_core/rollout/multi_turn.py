"""Multi-turn rollouts with tool calls, token-in/token-out (issue 25; on either rollout engine,
``hf`` or ``vllm``, run by the rollout phase with ``rollout.multi_turn``, whose batch stores the
turns).

Per row: sample an assistant turn; if it has tool calls (hermes, ``agent/tools.parse_hermes``),
run them in the tool host (every row's calls of a turn in one concurrent batch), append the tool
responses and the next assistant header as the chat template's ids (``agent/turns.py``), and
sample again; stop at a turn without a call, at ``max_assistant_turns`` or ``max_user_turns``
(tool-response turns, as verl counts them), or when the response budget
(``params.max_new_tokens``, all turns and tool responses together: verl's ``response_length``)
is spent. The sampled ids are kept exactly as sampled; ``response_mask`` is
1 on them and 0 on the appended ids, whose log-probs are 0.

Rows at different turns generate together (one engine call per turn), each from its own seed,
a hash of (seed, row, turn) (the engine's ``row_seeds``): a row's tokens depend neither on which other rows are still going nor on how the rows are
split across workers (``rows``: each row's index in the whole batch).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import time
from dataclasses import dataclass, field

import torch

from verl_core.agent.tools import BadToolCall, Request, ToolHost, ToolResult, parse_hermes
from verl_core.agent.turns import observation_ids, response_char_bound, truncate_observation
from verl_core.rollout.base import RolloutEngine, SamplingParams


@dataclass(frozen=True)
class MultiTurnOutput:
    response_ids: torch.Tensor  # (N, T) long: sampled and appended ids, right-padded
    response_mask: torch.Tensor  # (N, T) float32: 1 on sampled ids (EOS included), else 0
    attention_mask: torch.Tensor  # (N, T) float32: 1 on every real id (sampled and appended)
    logprobs: torch.Tensor  # (N, T) float32: log p of each sampled id, 0 elsewhere
    turns: list[list[dict]]
    """Per row, per assistant turn: ``sampled`` and ``appended`` (start, end) spans of the
    response, ``calls`` (name and arguments, or the parse error) and ``results`` (status, the
    observation the model read, reward): what the store keeps so no tool is ever called again
    for this rollout. Nothing measured is kept here: two runs store the same bytes."""
    tool_rewards: list[list[float]]
    """Per row: each call's step reward, in order, then each tool instance's ``calc_reward``
    (what the scorer reads as ``extra_info["tool_rewards"]``, as verl's reward managers)."""
    turn_scores: list[list[float]] | None = None
    """With interactions (``rollout.interaction_config_path``): per row, the simulated user's
    turn scores in order (verl's ``turn_scores``: a ``None`` score is not kept); None without."""
    tool_latency_s: list[float] = field(default_factory=list)
    """Each call's wall time as the tool host measured it, in call order: metrics only
    (:func:`turn_metrics`), never stored (it differs from run to run)."""

    def stored_turns(self) -> list[dict]:
        """Per row, what a batch stores (``Batch.turns``): ``{"turns": …, "tool_rewards": …}``
        (and ``turn_scores`` with interactions)."""
        if self.turn_scores is None:
            return [{"turns": t, "tool_rewards": r} for t, r in zip(self.turns, self.tool_rewards)]
        return [{"turns": t, "tool_rewards": r, "turn_scores": s}
                for t, r, s in zip(self.turns, self.tool_rewards, self.turn_scores)]


def concat_turn_outputs(parts: list[MultiTurnOutput], pad_token_id: int) -> MultiTurnOutput:
    """The rows of ``parts`` in order (W > 1: the workers' blocks), right-padded to the
    widest."""
    T = max(p.response_ids.shape[1] for p in parts)

    def cat(name, value):
        return torch.cat([torch.nn.functional.pad(getattr(p, name),
                                                  (0, T - getattr(p, name).shape[1]),
                                                  value=value) for p in parts])
    return MultiTurnOutput(
        response_ids=cat("response_ids", pad_token_id), response_mask=cat("response_mask", 0.0),
        attention_mask=cat("attention_mask", 0.0), logprobs=cat("logprobs", 0.0),
        turns=[t for p in parts for t in p.turns],
        tool_rewards=[r for p in parts for r in p.tool_rewards],
        turn_scores=None if parts[0].turn_scores is None
        else [s for p in parts for s in p.turn_scores],
        tool_latency_s=[s for p in parts for s in p.tool_latency_s])


def turn_metrics(out: MultiTurnOutput) -> dict[str, float]:
    """verl's ``num_turns/min|max|mean`` (assistant turns per response), and per response the
    tool calls made (``tool_calls/mean``), those that failed (``tool_calls/errors``: the tool
    raised or refused its call, or the call did not parse) or timed out
    (``tool_calls/timeouts``), the calls' wall times (``tool_calls/latency_s_mean|max``);
    ``response/observation_fraction``: the share of the responses' tokens that were appended,
    not sampled."""
    n = max(1, len(out.turns))
    turns = [len(t) for t in out.turns] or [0]
    results = [r for t in out.turns for turn in t for r in turn["results"]]
    appended = sum(e - s for t in out.turns for turn in t for s, e in [turn.get("appended",
                                                                                (0, 0))])
    sampled = float(out.response_mask.sum())
    return {"num_turns/min": float(min(turns)), "num_turns/max": float(max(turns)),
            "num_turns/mean": sum(turns) / n,
            "tool_calls/mean": len(results) / n,
            "tool_calls/errors": float(sum(r["status"] == "error" for r in results)),
            "tool_calls/timeouts": float(sum(r["status"] == "timeout" for r in results)),
            "tool_calls/latency_s_mean": sum(out.tool_latency_s) / max(1, len(out.tool_latency_s)),
            "tool_calls/latency_s_max": max(out.tool_latency_s, default=0.0),
            "response/observation_fraction": appended / max(1.0, appended + sampled),
            **(_interaction_metrics(out, n) if out.turn_scores is not None else {})}


def _interaction_metrics(out: MultiTurnOutput, n: int) -> dict[str, float]:
    """``interaction/turns_mean`` (user turns per response), ``interaction/errors`` (calls that
    raised, returned something else than verl's 4-tuple, timed out or killed the host: each
    ended its episode), ``interaction/terminated_fraction`` (episodes the user ended),
    ``interaction/turn_score_mean`` (the sum of a response's turn scores, averaged)."""
    users = [turn["user"] for t in out.turns for turn in t if "user" in turn]
    ended = sum(any(turn.get("user", {}).get("terminate") for turn in t) for t in out.turns)
    return {"interaction/turns_mean": len(users) / n,
            "interaction/errors": float(sum(u["status"] != "ok" for u in users)),
            "interaction/terminated_fraction": ended / n,
            "interaction/turn_score_mean": sum(sum(s) for s in out.turn_scores) / n}


def turn_seed(seed: int, row: int, turn: int) -> int:
    """The seed of row ``row``'s draws in assistant turn ``turn`` (a 63-bit hash): the row's
    index in the whole batch, not in a worker's block, and not which other rows still run."""
    digest = hashlib.blake2b(f"{seed}:{row}:{turn}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


def _left_pad(seqs: list[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    P = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), P), pad, dtype=torch.long)
    mask = torch.zeros((len(seqs), P), dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, P - len(s):] = torch.tensor(s, dtype=torch.long)
        mask[i, P - len(s):] = 1
    return ids, mask


class _Deadline:
    """The rollout's budget for tool calls (``rollout.tool_budget_s``): each turn's calls run
    under the tool timeout or what is left of the budget, whichever is less; once it is spent,
    calls time out at once."""

    def __init__(self, budget_s: float | None):
        self.end = None if budget_s is None else time.monotonic() + budget_s

    def left(self) -> float | None:
        return None if self.end is None else max(0.0, self.end - time.monotonic())


def turn_limits(rc) -> dict:
    """:func:`generate_turns`' limits from the ``rollout`` section (one place for the rollout
    phase, the evaluation and the warm start's probe)."""
    return dict(max_assistant_turns=rc.max_assistant_turns, max_user_turns=rc.max_user_turns,
                max_parallel_calls=rc.max_parallel_calls,
                max_tool_response_length=rc.max_tool_response_length,
                truncate_side=rc.tool_response_truncate_side, budget_s=rc.tool_budget_s)


@dataclass
class Interactions:
    """The simulated users of a rollout (``agent/interactions.py``): the host serving them
    (a :class:`ToolHost`), and per row its ``interaction_kwargs`` (verl's
    ``extra_info["interaction_kwargs"]``; ``name`` picks the interaction) and its prompt's
    messages (what ``generate_response`` reads, with the turns since)."""

    host: ToolHost
    kwargs: list[dict]
    messages: list[list[dict]]


def row_interactions(prompts, rows_data: list) -> Interactions | None:
    """The :class:`Interactions` of dataset rows ``rows_data`` (their
    ``extra_info.interaction_kwargs`` and prompt messages), served by ``prompts.interaction_host``
    (``data/prompts.py``); None without simulated users."""
    host = getattr(prompts, "interaction_host", None)
    if host is None:
        return None
    return Interactions(host, [dict((r.extra_info or {})["interaction_kwargs"]) for r in rows_data],
                        [[{"role": role, "content": content} for role, content in r.messages]
                         for r in rows_data])


@torch.no_grad()
def generate_turns(engine: RolloutEngine, tokenizer, prompts: list[list[int]],
                   params: SamplingParams, *, host: ToolHost, tools: list[dict] | None = None,
                   rows: list[int] | None = None, max_assistant_turns: int = 5,
                   max_user_turns: int = 0, max_parallel_calls: int = 0,
                   max_tool_response_length: int = 256, truncate_side: str = "left",
                   tools_kwargs: list[dict] | None = None, budget_s: float | None = None,
                   instance_prefix: str = "", turn_context=None,
                   interactions: Interactions | None = None) -> MultiTurnOutput:
    """Multi-turn rollouts of the ``prompts`` (each a list of token ids, chat template applied,
    generation prompt included) sampled by ``engine`` (``hf`` or ``vllm``; its EOS set ends a
    turn, its pad id pads the output). ``tools``: the schemas the template shows (the prompts
    were rendered with them). ``max_assistant_turns`` / ``max_user_turns`` /
    ``max_parallel_calls`` (the calls of a turn that run): 0 is no limit. ``tools_kwargs``: per
    row, verl's ``extra_info["tools_kwargs"]`` (``{tool: {"create_kwargs": {...},
    "execute_kwargs": {...}}}``). ``budget_s``: the tool calls' wall-time budget
    (:class:`_Deadline`). ``instance_prefix`` makes the tool instances of this rollout unique
    (the step's seed and phase). ``turn_context(k)``: a context manager the engine call of turn
    k runs in (a partial rollout's weights of that turn: ``parts/behaviour.py``).
    ``interactions``: the simulated users (:class:`Interactions`); after a turn without a tool
    call the row's user answers (``generate_response``) and its message is appended as the
    template's ids, masked like a tool's response, until it ends the episode or a limit does.
    ``host`` may be None when there are no tools (then nothing is parsed as a call)."""
    with engine.held():
        return _generate_turns(engine, tokenizer, prompts, params, host=host, tools=tools,
                               rows=rows, max_assistant_turns=max_assistant_turns,
                               max_user_turns=max_user_turns,
                               max_parallel_calls=max_parallel_calls,
                               max_tool_response_length=max_tool_response_length,
                               truncate_side=truncate_side, tools_kwargs=tools_kwargs,
                               budget_s=budget_s, instance_prefix=instance_prefix,
                               turn_context=turn_context, interactions=interactions)


def _generate_turns(engine, tokenizer, prompts, params, *, host, tools, rows,
                    max_assistant_turns, max_user_turns, max_parallel_calls,
                    max_tool_response_length, truncate_side, tools_kwargs, budget_s,
                    instance_prefix, turn_context=None, interactions=None) -> MultiTurnOutput:
    n, budget = len(prompts), params.max_new_tokens
    rows = list(range(n)) if rows is None else list(rows)
    kwargs_of = [dict(k or {}) for k in tools_kwargs] if tools_kwargs is not None else [{}] * n
    stop, pad_id = set(engine.eos_token_ids), engine.pad_token_id
    resp: list[list[int]] = [[] for _ in range(n)]
    mask: list[list[float]] = [[] for _ in range(n)]
    logp: list[list[float]] = [[] for _ in range(n)]
    turns: list[list[dict]] = [[] for _ in range(n)]
    rewards: list[list[float]] = [[] for _ in range(n)]
    latencies: list[float] = []
    created: set[tuple[int, str]] = set()
    started: set[tuple[int, str]] = set()  # the rows' interactions, once started
    scores: list[list[float]] = [[] for _ in range(n)]
    history = [list(m) for m in interactions.messages] if interactions is not None else None
    done = [False] * n
    deadline = _Deadline(budget_s)
    last = max_assistant_turns or budget  # every turn samples at least one token
    for k in range(last):
        active = [i for i in range(n) if not done[i]]
        if not active:
            break
        ids, m = _left_pad([prompts[i] + resp[i] for i in active], pad_id)
        # each row samples what is left of its budget, from its own (row, turn) seed
        with turn_context(k) if turn_context is not None else contextlib.nullcontext():
            out = engine.generate(ids, m, params,
                                  row_seeds=[turn_seed(params.seed, rows[i], k) for i in active],
                                  row_limits=[budget - len(resp[i]) for i in active])
        calls_of: dict[int, list] = {}
        users: list[int] = []  # rows whose simulated user answers this turn
        for j, i in enumerate(active):
            take = int(out.response_mask[j].sum())
            sampled = out.response_ids[j, :take].tolist()
            start = len(resp[i])
            resp[i] += sampled
            mask[i] += [1.0] * take
            logp[i] += out.logprobs[j, :take].tolist()
            turns[i].append({"sampled": [start, len(resp[i])], "calls": [], "results": []})
            ended = take > 0 and sampled[-1] in stop
            calls = parse_hermes(tokenizer.decode(sampled, skip_special_tokens=False)) \
                if ended and host is not None else []
            if max_parallel_calls:
                calls = calls[:max_parallel_calls]
            if history is not None:
                history[i].append({"role": "assistant",
                                   "content": tokenizer.decode(sampled, skip_special_tokens=True)})
            if (not (calls or history is not None and ended) or k == last - 1
                    or len(resp[i]) >= budget or max_user_turns and k >= max_user_turns):
                done[i] = True
                continue
            if calls:
                calls_of[i] = calls
            else:
                users.append(i)
        if users:
            llm = getattr(interactions.host, "llm", None) or {}
            hosted = [i for i in users if interactions.kwargs[i]["name"] not in llm]
            if hosted:
                _user_turns(interactions, hosted, rows, instance_prefix, started, history,
                            turns, scores, params.seed, k, deadline)
            if len(hosted) < len(users):
                with turn_context(k) if turn_context is not None else contextlib.nullcontext():
                    _llm_user_turns(engine, tokenizer, llm, interactions,
                                    [i for i in users if i not in hosted], rows, history, turns,
                                    params.seed, k)
            for i in users:
                user = turns[i][-1]["user"]
                if user["status"] != "ok":  # the user failed: the episode ends here
                    done[i] = True
                    continue
                _append(tokenizer, [{"role": "user", "content": user["text"]}], tools, resp,
                        mask, logp, turns[i][-1], i, budget)
                if user["terminate"] or len(resp[i]) >= budget:
                    done[i] = True
        if not calls_of:
            continue
        results = _run_calls(host, calls_of, rows, instance_prefix, created, kwargs_of,
                             deadline, response_char_bound(max_tool_response_length))
        for i, calls in calls_of.items():
            turn = turns[i][-1]
            texts = []
            for c, r in zip(calls, results[i]):
                text = truncate_observation(r.observation(), tokenizer,
                                            max_tool_response_length, truncate_side)
                turn["calls"].append({"error": c.error, "text": c.text}
                                     if isinstance(c, BadToolCall)
                                     else {"name": c.name, "arguments": c.arguments})
                turn["results"].append({"status": r.status, "observation": text,
                                        "reward": r.reward})
                latencies.append(r.latency_s)
                rewards[i].append(r.reward)
                texts.append({"role": "tool", "content": text})
            if history is not None:
                history[i].extend(texts)
            if _append(tokenizer, texts, tools, resp, mask, logp, turn, i, budget):
                done[i] = True  # no room left to answer: the budget is spent
    if host is not None:
        _release(host, created, instance_prefix, rewards, rows)
    if interactions is not None and started:
        _finalize(interactions.host, started, instance_prefix, rows)
    T = max(1, max(len(r) for r in resp))
    pad = lambda xs, v: [x + [v] * (T - len(x)) for x in xs]  # noqa: E731
    return MultiTurnOutput(
        response_ids=torch.tensor(pad(resp, pad_id), dtype=torch.long),
        response_mask=torch.tensor(pad(mask, 0.0), dtype=torch.float32),
        attention_mask=torch.tensor(pad([[1.0] * len(r) for r in resp], 0.0),
                                    dtype=torch.float32),
        logprobs=torch.tensor(pad(logp, 0.0), dtype=torch.float32),
        turns=turns, tool_rewards=rewards, tool_latency_s=latencies,
        turn_scores=scores if interactions is not None else None)


def _append(tokenizer, messages, tools, resp, mask, logp, turn, i, budget) -> bool:
    """Append ``messages`` (tool or user) and the next assistant header to row ``i`` as the
    template's ids, masked, log-probs 0, cut to what is left of the budget; the turn's
    ``appended`` span. True when no room is left to answer."""
    eot = tokenizer.convert_ids_to_tokens(resp[i][-1])
    appended = observation_ids(tokenizer, messages, end_of_turn=eot, tools=tools)
    room = budget - len(resp[i])
    start = len(resp[i])
    resp[i] += appended[:room]
    mask[i] += [0.0] * min(room, len(appended))
    logp[i] += [0.0] * min(room, len(appended))
    turn["appended"] = [start, len(resp[i])]
    return len(appended) >= room


def _user_turns(it: Interactions, users: list[int], rows: list[int], prefix: str, started: set,
                history: list[list[dict]], turns: list[list[dict]], scores: list[list[float]],
                seed: int, k: int, deadline: _Deadline) -> None:
    """Every listed row's simulated user answers turn ``k`` (one concurrent batch; an
    interaction a row meets for the first time is started first, with the row's
    ``interaction_kwargs``, as verl's ``start_interaction``): ``turns[i][-1]["user"]`` gets the
    answer (``status``, ``text``, ``terminate``, ``score``, or the ``error``), and a score joins
    ``scores[i]``. The call's ``random`` is seeded by (``seed``, row, turn)."""
    fresh = [(i, it.kwargs[i]["name"]) for i in users if (i, it.kwargs[i]["name"]) not in started]
    failed: dict[int, str] = {}
    if fresh:
        got = it.host.run([Request("create", name, _instance(prefix, rows[i], name),
                                   dict(it.kwargs[i]))
                           for i, name in fresh], timeout_s=deadline.left())
        for (i, name), r in zip(fresh, got):
            started.add((i, name))
            if r.status != "ok":
                failed[i] = r.observation()
    ask = [i for i in users if i not in failed]
    got = it.host.run([Request("execute", it.kwargs[i]["name"],
                               _instance(prefix, rows[i], it.kwargs[i]["name"]),
                               {"parameters": {"messages": history[i],
                                               "kwargs": it.kwargs[i],
                                               "seed": turn_seed(seed, rows[i], k)}})
                       for i in ask], timeout_s=deadline.left()) if ask else []
    for i in users:
        if i in failed:
            turns[i][-1]["user"] = {"status": "error", "error": failed[i]}
    for i, r in zip(ask, got):
        if r.status != "ok":
            turns[i][-1]["user"] = {"status": r.status, "error": r.observation()}
            continue
        ans = json.loads(r.text)
        turns[i][-1]["user"] = {"status": "ok", "text": ans["response"],
                                "terminate": ans["terminate"], "score": ans["score"]}
        if ans["score"] is not None:
            scores[i].append(ans["score"])
        history[i].append({"role": "user", "content": ans["response"]})


def _llm_user_turns(engine, tokenizer, llm: dict[str, dict], it: Interactions, users: list[int],
                    rows: list[int], history: list[list[dict]], turns: list[list[dict]],
                    seed: int, k: int) -> None:
    """The LLM users' turn ``k`` (``builtin:llm_user``): the rollout engine, with the user's
    system prompt and the conversation so far with the roles swapped (the assistant's turns
    are its user messages; the prompt's system message and tool messages are left out), samples
    the user's message, each row from its own seed (a hash of ``seed``, the row and the turn,
    apart from the policy's), one engine call per interaction. Never trained on: the message
    is appended masked, as any user's. Its turns score nothing (``None``); the episode ends
    when the message holds the ``stop_phrase``."""
    swap = {"user": "assistant", "assistant": "user"}
    for name in sorted({it.kwargs[i]["name"] for i in users}):
        cfg = llm[name]
        mine = [i for i in users if it.kwargs[i]["name"] == name]
        chats = [[{"role": "system", "content": cfg["system_prompt"]}]
                 + [{"role": swap[m["role"]], "content": m["content"]} for m in history[i]
                    if m["role"] in swap] for i in mine]
        ids = [tokenizer(tokenizer.apply_chat_template(c, tokenize=False,
                                                       add_generation_prompt=True),
                         add_special_tokens=False)["input_ids"] for c in chats]
        pid, pm = _left_pad(ids, engine.pad_token_id)
        out = engine.generate(pid, pm, SamplingParams(temperature=float(cfg["temperature"]),
                                                      max_new_tokens=int(cfg["max_tokens"]),
                                                      seed=seed),
                              row_seeds=[turn_seed(seed, rows[i], -1 - k) for i in mine])
        for j, i in enumerate(mine):
            take = int(out.response_mask[j].sum())
            text = tokenizer.decode(out.response_ids[j, :take].tolist(),
                                    skip_special_tokens=True).strip()
            turns[i][-1]["user"] = {"status": "ok", "text": text,
                                    "terminate": bool(cfg["stop_phrase"])
                                    and cfg["stop_phrase"] in text, "score": None}
            history[i].append({"role": "user", "content": text})


def _finalize(host: ToolHost, started: set, prefix: str, rows: list[int]) -> None:
    """verl's ``finalize_interaction`` of every interaction the rollout started (a failure
    here changes nothing stored)."""
    host.run([Request("release", name, _instance(prefix, rows[i], name))
              for i, name in sorted(started)])


def _instance(prefix: str, row: int, tool: str) -> str:
    return f"{prefix}:{row}:{tool}"


def _tool_kwargs(kwargs_of: list[dict], i: int, tool: str, key: str) -> dict:
    """verl's ``extra_info["tools_kwargs"][tool][key]`` of row ``i`` (``create_kwargs`` or
    ``execute_kwargs``), {} when absent."""
    got = (kwargs_of[i].get(tool) or {}).get(key) or {}
    return dict(got) if isinstance(got, dict) else {}


def _run_calls(host: ToolHost, calls_of: dict[int, list], rows: list[int], prefix: str,
               created: set, kwargs_of: list[dict], deadline: _Deadline,
               max_chars: int) -> dict[int, list[ToolResult]]:
    """Every row's calls of this turn, in two concurrent batches: the tool instances a row
    calls for the first time are created, then every call runs. A parse error is its own
    result (nothing runs). ``max_chars``: what the host sends of an answer, at most."""
    fresh = sorted({(i, c.name) for i, calls in calls_of.items() for c in calls
                    if not isinstance(c, BadToolCall) and c.name in host.names} - created)
    if fresh:
        host.run([Request("create", name, _instance(prefix, rows[i], name),
                          _tool_kwargs(kwargs_of, i, name, "create_kwargs"))
                  for i, name in fresh], timeout_s=deadline.left())
        created.update(fresh)
    todo = [(i, c) for i, calls in calls_of.items() for c in calls
            if not isinstance(c, BadToolCall)]
    answers = iter(host.run([Request("execute", c.name, _instance(prefix, rows[i], c.name),
                                     {"parameters": c.arguments,
                                      **_tool_kwargs(kwargs_of, i, c.name, "execute_kwargs")})
                             for i, c in todo], timeout_s=deadline.left(),
                            max_chars=max_chars))
    return {i: [ToolResult("error", error=c.error) if isinstance(c, BadToolCall)
                else next(answers) for c in calls] for i, calls in calls_of.items()}


def _release(host: ToolHost, created: set, prefix: str, rewards: list[list[float]],
             rows: list[int]) -> None:
    if not created:
        return
    order = sorted(created)
    got = host.run([Request("calc_reward", name, _instance(prefix, rows[i], name))
                    for i, name in order])
    for (i, _), r in zip(order, got):
        rewards[i].append(r.reward if r.status == "ok" else 0.0)
    host.run([Request("release", name, _instance(prefix, rows[i], name)) for i, name in order])
