"""Tool calls of a batch run concurrently (issue 25, "Agentic RL: multi-turn tool rollouts").

A batch of 64 rows, each making exactly two tool calls (turn 1: a call, turn 2: a call, turn 3:
the answer, no call), rolled out by the real multi-turn sampler
(``rollout/multi_turn.generate_turns``: the ``hf`` engine's ``generate_with_cache``, the tool
host's child process, the Qwen2.5 stand-in's chat template). The policy is
``tests.standins.ScriptedLM``, which writes each row's script token for token, so every row calls
the tool twice and both configurations sample the same tokens. The tool is a class on verl's
``BaseTool`` contract, written to a temp folder and named in a verl tool YAML as
``file.py:SleepTool``; it sleeps ``delay_s`` and answers the same text in both configurations:

- ``instant``: ``delay_s`` = 0;
- ``100 ms``: ``delay_s`` = 0.1.

Same model, prompts, seed and replies, so the two batches are token-for-token equal (asserted, as
are the 2 x 64 = 128 calls). One untimed warm-up each, then ``--repeats`` timed rollouts,
alternating the configurations so that load from other jobs hits both alike. Reported per
configuration: the median rollout wall time (min..max), the median time spent inside
``ToolHost.run`` (the five host round trips of a rollout: create, two turns of calls,
calc_reward, release), and the calls' latencies as the host measured them, summed (what running
them one after another would cost: 128 x 0.1 s = 12.8 s). Then the added time (100 ms - instant,
medians; the goal is <= 0.4 s), with the median of each repeat's back-to-back difference and the
difference of the time in the host (both less exposed to other jobs' load), against the ideal,
the longest chain of calls in a row: 2 x 0.1 s.

    python bench/agent.py                  # 64 rows, 5 timed repeats
    python bench/agent.py --repeats 3
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import torch
import yaml

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from tests.standins import hf_engine, qwen_tokenizer, scripted_chat  # noqa: E402
from verl_core.agent.tools import ToolHost, load_tool_config  # noqa: E402
from verl_core.rollout import SamplingParams  # noqa: E402
from verl_core.rollout.multi_turn import generate_turns  # noqa: E402

DELAY_S, GOAL_S, REPLY = 0.1, 0.4, "Natalia sold 72 clips in all."
CONFIGS = {"instant": 0.0, "100 ms": DELAY_S}

TOOL_FILE = '''
import asyncio


class SleepTool:
    """verl's BaseTool contract: ``execute`` sleeps ``config["delay_s"]`` (an I/O-bound tool: a
    search, a sandbox), then answers ``config["reply"]``."""

    def __init__(self, config, tool_schema):
        self.delay_s, self.reply = float(config["delay_s"]), str(config["reply"])

    async def create(self, instance_id, **kwargs):
        return instance_id

    async def execute(self, instance_id, parameters, **kwargs):
        await asyncio.sleep(self.delay_s)
        return self.reply, 0.0, {}

    async def calc_reward(self, instance_id, **kwargs):
        return 0.0

    async def release(self, instance_id, **kwargs):
        pass
'''
SCHEMA = {"type": "function", "function": {
    "name": "lookup", "description": "Look up a fact.",
    "parameters": {"type": "object", "properties": {"query": {"type": "string"}},
                   "required": ["query"]}}}
CALL = '<tool_call>\n{"name": "lookup", "arguments": {"query": "%s"}}\n</tool_call>'
TURNS = [CALL % "clips in April", CALL % "clips in May", "#### 72"]  # two calls, then the answer


def tool_config(folder: str, delay_s: float) -> str:
    """A verl tool YAML naming ``SleepTool`` by file; returns its path."""
    path = os.path.join(folder, f"sleep_{delay_s:g}.yaml")
    with open(path, "w") as f:
        yaml.safe_dump({"tools": [{"class_name": os.path.join(folder, "sleep_tool.py:SleepTool"),
                                   "config": {"delay_s": delay_s, "reply": REPLY},
                                   "tool_schema": SCHEMA}]}, f)
    return path


def timed_host(host: ToolHost) -> list[float]:
    """Wrap ``host.run`` so each call adds its wall time to the returned one-element list."""
    spent, run = [0.0], host.run

    def timed(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return run(*args, **kwargs)
        finally:
            spent[0] += time.perf_counter() - t0

    host.run = timed
    return spent


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()

    tok = qwen_tokenizer()
    prompts, model, scripts = scripted_chat(tok, [TURNS] * args.rows, [SCHEMA],
                                            question="How many clips did Natalia sell?")
    budget = sum(len(s) for s in scripts[0]) + 200  # the scripts and two tool responses fit
    params = SamplingParams(temperature=1.0, max_new_tokens=budget, seed=0)
    calls = 2 * args.rows
    engine = hf_engine(model, tok)

    with tempfile.TemporaryDirectory() as folder:
        with open(os.path.join(folder, "sleep_tool.py"), "w") as f:
            f.write(TOOL_FILE)
        hosts = {name: ToolHost(load_tool_config(tool_config(folder, d)), timeout_s=30.0)
                 for name, d in CONFIGS.items()}
        spent = {name: timed_host(h) for name, h in hosts.items()}
        wall = {name: [] for name in CONFIGS}
        in_host = {name: [] for name in CONFIGS}
        first, made = {}, {}
        try:
            for h in hosts.values():
                h.start()  # the child and its tool built before any timing
            for k in range(args.repeats + 1):  # k = 0: the warm-up, not timed
                for name, host in hosts.items():
                    spent[name][0] = 0.0
                    t0 = time.perf_counter()
                    out = generate_turns(engine, tok, prompts, params, host=host,
                                         tools=[SCHEMA], instance_prefix="bench")
                    dt = time.perf_counter() - t0
                    results = [r for t in out.turns for turn in t for r in turn["results"]]
                    assert len(results) == calls and all(len(t) == 3 for t in out.turns), \
                        f"{name}: {len(results)} tool calls, expected {calls}"
                    assert all(r["status"] == "ok" and r["observation"] == REPLY
                               for r in results), f"{name}: a tool call failed"
                    first.setdefault(name, out)
                    made[name] = len(results)
                    # every rollout, whichever the delay, is token-for-token the same batch
                    ref = first["instant"]  # the first rollout of all
                    for a, b in ((out.response_ids, ref.response_ids),
                                 (out.response_mask, ref.response_mask),
                                 (out.logprobs, ref.logprobs)):
                        assert torch.equal(a, b), f"{name}: the batch differs"
                    if k:
                        wall[name].append(dt)
                        in_host[name].append(spent[name][0])
        finally:
            for h in hosts.values():
                h.close()
    latency = {name: sum(r["latency_s"] for t in out.turns for turn in t
                         for r in turn["results"]) for name, out in first.items()}

    med = {name: statistics.median(v) for name, v in wall.items()}
    host_med = {name: statistics.median(v) for name, v in in_host.items()}
    tokens = int(first["instant"].response_mask.sum())
    print(f"{args.rows} rows x 2 tool calls, {tokens:,} sampled tokens per rollout; "
          f"{torch.get_num_threads()} torch threads, load average "
          f"{os.getloadavg()[0]:.1f}; median of {args.repeats} after a warm-up\n")
    print("| configuration | delay per call | tool calls | rollout s (min..max) | "
          "in the tool host s | calls' latencies summed s |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, d in CONFIGS.items():
        print(f"| {name} | {d:g} s | {made[name]} | {med[name]:.3f} ({min(wall[name]):.3f}.."
              f"{max(wall[name]):.3f}) | {host_med[name]:.3f} | {latency[name]:.2f} |")
    added = med["100 ms"] - med["instant"]
    # each repeat's pair ran back to back: their difference is less exposed to drifting load
    paired = statistics.median(b - a for a, b in zip(wall["instant"], wall["100 ms"]))
    ideal = 2 * DELAY_S
    print(f"\nadded time (100 ms - instant, medians): {added:.3f} s; goal <= {GOAL_S} s: "
          f"{'met' if added <= GOAL_S else 'NOT met'} (median of the paired differences: "
          f"{paired:.3f} s; in the tool host: {host_med['100 ms'] - host_med['instant']:.3f} s)")
    print(f"ideal (the longest chain of calls, 2 x {DELAY_S:g} s): {ideal:.1f} s; "
          f"added / ideal: {added / ideal:.2f}")
    print(f"sequential (every call's delay, {calls} x {DELAY_S:g} s): {calls * DELAY_S:.1f} s")


if __name__ == "__main__":
    main()
