"""Multi-turn rollouts with tool calls (verl_core/rollout/multi_turn.py): the real sampler
(``generate_with_cache``), the real tool host and the calculator, on the Qwen2.5 stand-in's chat
template. The policy is a scripted causal LM (``tests.standins.ScriptedLM``: a torch module whose
next-token distribution puts all its mass on the next token of its script for the current turn),
so what it samples is known and every span of the response can be checked exactly."""
import math

import pytest
import torch
import yaml

from tests.standins import hf_engine, qwen_tokenizer, scripted_chat
from verl_core.agent.tools import CalculatorTool, ToolHost, load_tool_config
from verl_core.agent.turns import observation_ids
from verl_core.rollout import SamplingParams
from verl_core.rollout.multi_turn import generate_turns, turn_metrics

TOOLS = [CalculatorTool.SCHEMA]
CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "%s"}}\n</tool_call>'


@pytest.fixture(scope="module")
def host(tmp_path_factory):
    path = tmp_path_factory.mktemp("tools") / "calc.yaml"
    path.write_text(yaml.safe_dump({"tools": [{
        "class_name": "verl_core.agent.tools.CalculatorTool", "tool_schema": TOOLS[0]}]}))
    with ToolHost(load_tool_config(str(path)), timeout_s=30.0) as h:
        yield h


def _run(tok, host, turns_of_rows, budget=400, **kw):
    prompts, model, scripts = scripted_chat(tok, turns_of_rows, TOOLS)
    out = generate_turns(hf_engine(model, tok), tok, prompts,
                         SamplingParams(temperature=1.0, max_new_tokens=budget, seed=3),
                         host=host, tools=TOOLS, instance_prefix="t", **kw)
    return out, scripts


def test_a_tool_call_turn_then_an_answer_token_in_token_out(host):
    tok = qwen_tokenizer()
    out, scripts = _run(tok, host, [[CALL % "1234 * 5678", "#### 7006652"], ["#### 7000000"]])
    obs = observation_ids(tok, [{"role": "tool", "content": "7006652"}], end_of_turn="<|im_end|>",
                          tools=TOOLS)
    ids, m = out.response_ids[0], out.response_mask[0]
    a, b = len(scripts[0][0]), len(obs)
    # the response is the sampled ids of turn 1, the template's ids of the tool response and the
    # next header, and the sampled ids of turn 2, in that order; nothing else
    assert ids[:a + b + len(scripts[0][1])].tolist() == scripts[0][0] + obs + scripts[0][1]
    assert m.tolist()[:a + b + len(scripts[0][1])] == [1.0] * a + [0.0] * b + \
        [1.0] * len(scripts[0][1])
    assert not m[a + b + len(scripts[0][1]):].any()
    lp = out.logprobs[0]
    assert bool((lp[m == 0] == 0).all()) and bool((lp[m == 1].abs() < 1e-6).all())
    [t1, t2] = out.turns[0]
    assert t1["calls"] == [{"name": "calculator", "arguments": {"expression": "1234 * 5678"}}]
    assert t1["results"][0]["status"] == "ok" and t1["results"][0]["observation"] == "7006652"
    assert t1["sampled"] == [0, a] and t1["appended"] == [a, a + b] and t2["calls"] == []
    # the other row answered at once: one turn, no tool
    assert len(out.turns[1]) == 1 and out.response_ids[1, :len(scripts[1][0])].tolist() == \
        scripts[1][0]
    assert out.tool_rewards == [[0.0, 0.0], []]  # the call's step reward, calc_reward; no tool


def test_a_bad_call_is_shown_to_the_model_and_the_turn_limit_holds(host):
    tok = qwen_tokenizer()
    bad = '<tool_call>{"name": "calculator", "arguments": {"expression": 12</tool_call>'
    out, scripts = _run(tok, host, [[bad, CALL % "1 / 0", CALL % "2 + 2", "#### 4"]],
                        max_assistant_turns=3)
    t = out.turns[0]
    assert len(t) == 3  # the third turn's call is not run: the limit ends the rollout
    assert t[0]["results"][0]["status"] == "error" and "not valid JSON" in \
        t[0]["results"][0]["observation"]
    assert t[1]["results"][0]["observation"] == "error: division by zero"  # the tool's answer
    assert t[2]["calls"] == [] and "appended" not in t[2]
    m = out.response_mask[0]
    assert int(m.sum()) == sum(len(s) for s in scripts[0][:3])
    got = turn_metrics(out)
    # each result's measured wall time (0 for the call that did not parse): metrics only
    bad_s, ran_s = out.tool_latency_s
    assert bad_s == 0.0 < ran_s and "latency_s" not in t[1]["results"][0]
    assert (got.pop("tool_calls/latency_s_max"), got.pop("tool_calls/latency_s_mean")) == \
        (ran_s, ran_s / 2)
    appended = sum(turn["appended"][1] - turn["appended"][0] for turn in t[:2])
    assert got == {"num_turns/min": 3.0, "num_turns/max": 3.0, "num_turns/mean": 3.0,
                   "tool_calls/mean": 2.0, "tool_calls/errors": 1.0, "tool_calls/timeouts": 0.0,
                   "response/observation_fraction": appended / (appended + int(m.sum()))}


def test_the_budget_counts_sampled_and_appended_tokens(host):
    """verl's response_length bounds the whole response: a tool response that does not fit is
    cut and the rollout ends; a turn cut by the budget (no end-of-turn token) runs no call."""
    tok = qwen_tokenizer()
    turns = [CALL % "1234 * 5678", "#### 7006652"]
    a = len(tok(turns[0], add_special_tokens=False)["input_ids"]) + 1  # + <|im_end|>
    b = len(observation_ids(tok, [{"role": "tool", "content": "7006652"}],
                            end_of_turn="<|im_end|>", tools=TOOLS))
    out, _ = _run(tok, host, [turns], budget=a + b // 2)
    m = out.response_mask[0]
    assert out.response_ids.shape[1] == a + b // 2 and int(m.sum()) == a
    assert out.turns[0][0]["appended"] == [a, a + b // 2] and len(out.turns[0]) == 1
    out, _ = _run(tok, host, [turns], budget=a - 5)
    assert out.response_ids.shape[1] == a - 5 and int(out.response_mask[0].sum()) == a - 5
    assert out.turns[0] == [{"sampled": [0, a - 5], "calls": [], "results": []}]
    assert math.isclose(float(out.logprobs[0].sum()), 0.0, abs_tol=1e-3)


def test_a_rows_tokens_depend_on_its_index_not_on_the_other_rows(host):
    """The real tiny model at temperature 1 (one turn each: it writes no tool calls): rows 2..3
    generated alone, as a worker's share, draw what they draw among all four rows."""
    from verl_core.models import build_tiny_model

    model, tok = build_tiny_model(seed=0)
    prompts = [tok(q)["input_ids"] for q in ("12+7=", "3-1=", "29+30=", "40+2=")]
    kw = dict(host=host)
    params = SamplingParams(temperature=1.0, max_new_tokens=6, seed=11)
    engine = hf_engine(model, tok)
    whole = generate_turns(engine, tok, prompts, params, **kw)
    part = generate_turns(engine, tok, prompts[2:], params, rows=[2, 3], **kw)
    T = part.response_ids.shape[1]
    assert torch.equal(part.response_ids, whole.response_ids[2:, :T])
    assert not whole.response_ids[2:, T:].ne(tok.pad_token_id).any()
    other = generate_turns(engine, tok, prompts, SamplingParams(temperature=1.0, max_new_tokens=6,
                                                               seed=12), **kw)
    assert not torch.equal(other.response_ids, whole.response_ids)


def test_two_runs_of_a_rollout_store_the_same_batch_bytes(host):
    """Issue 40: what a multi-turn batch stores is a function of the seed and the tools' answers;
    the calls' measured wall times (which differ run to run) are metrics only. The stored bytes
    (and so the batch's content hash, its name in the store) are the same for two runs."""
    from verl_core.data.batch import Batch, batch_to_parquet_bytes
    from verl_core.store import sha256_hex

    tok = qwen_tokenizer()
    rows = [[CALL % "1234 * 5678", "#### 7006652"], [CALL % "(1 + 2) / 3", CALL % "7/2", "#### 1"]]

    def stored() -> str:  # the batch as the rollout phase stores it (RLTrainer.sample)
        out, _ = _run(tok, host, rows)
        n = len(rows)
        batch = Batch(prompt_ids=torch.zeros((n, 1), dtype=torch.long),
                      prompt_mask=torch.ones((n, 1), dtype=torch.long),
                      response_ids=out.response_ids, response_mask=out.response_mask,
                      response_logprobs=out.logprobs, group=torch.arange(n), uid=["0", "1"],
                      ground_truth=["7006652", "1"], data_source=["calculator"] * n,
                      extra_info=[{}] * n, response_attention_mask=out.attention_mask,
                      turns=out.stored_turns())
        assert len(out.tool_latency_s) == 3  # measured, kept beside the batch
        return sha256_hex([batch_to_parquet_bytes(batch)])

    assert stored() == stored()
