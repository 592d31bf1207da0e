"""The OpenAI-compatible endpoint (verl_core/agent/openai_server.py) driven by the real `openai`
client: a 3-turn tool episode on a scripted policy (what it samples is known), seeds on a random
tiny Qwen2, budgets and history checks, the port's lifetime, the episode runner's containment,
and a 2-step training run with ``rollout.openai_agent``."""
import json
import socket
import threading
import time

import openai
import pytest
import torch
from openai import OpenAI

from tests.standins import hf_engine, qwen_folder, qwen_tokenizer, scripted_chat
from verl_core.agent.openai_server import (Budgets, OpenAIServer, engine_generate,
                                           join_agent_rewards, run_episodes)
from verl_core.agent.tools import CalculatorTool
from verl_core.agent.turns import observation_ids
from verl_core.rollout import SamplingParams
from verl_core.rollout.multi_turn import turn_seed

TOOLS = [CalculatorTool.SCHEMA]
CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "%s"}}\n</tool_call>'
QUESTION = "What is 1234 * 5678 + 1?"


class Recording:
    """The engine, with every ``generate`` call's sampled ids and log-probs kept (what the
    engine itself returned, to compare the endpoint's assembly with)."""

    def __init__(self, engine):
        self.engine, self.calls = engine, []
        self.eos_token_ids, self.pad_token_id = engine.eos_token_ids, engine.pad_token_id

    def generate(self, ids, mask, params, **kw):
        out = self.engine.generate(ids, mask, params, **kw)
        take = int(out.response_mask[0].sum())
        self.calls.append((ids[0].tolist(), out.response_ids[0, :take].tolist(),
                           out.logprobs[0, :take].tolist(), kw["row_seeds"][0]))
        return out

    def held(self):
        return self.engine.held()


def _calc(expression: str) -> str:
    a, op, b = expression.split()
    return str(int(a) * int(b) if op == "*" else int(a) + int(b))


def tool_agent(base_url: str, row: dict) -> float:
    """An agent as a framework writes one: the OpenAI client, tool calls answered by itself."""
    client = OpenAI(base_url=base_url, api_key="unused", max_retries=0)
    msgs = [{"role": "system", "content": f"row {row['row']}"},
            {"role": "user", "content": QUESTION}]
    for _ in range(5):
        r = client.chat.completions.create(model="policy", messages=msgs, tools=TOOLS,
                                           logprobs=True, temperature=1.0)
        m = r.choices[0].message
        msgs.append(m.model_dump(exclude_none=True))
        if not m.tool_calls:
            return 1.0 if m.content.strip() == "#### 7006653" else 0.0
        for c in m.tool_calls:
            msgs.append({"role": "tool", "tool_call_id": c.id,
                         "content": _calc(json.loads(c.function.arguments)["expression"])})
    return 0.0


def _server(tok, engine, rows=1, budget=400, **kw):
    return OpenAIServer(tok, engine_generate(engine), rows=rows, step_seed=11,
                        params=SamplingParams(temperature=1.0, max_new_tokens=budget),
                        budgets=Budgets(max_new_tokens=budget, **kw),
                        stop_ids=engine.eos_token_ids)


def test_a_three_turn_tool_episode_is_assembled_from_the_engines_own_samples():
    tok = qwen_tokenizer()
    script = [CALL % "1234 * 5678", CALL % "7006652 + 1", "#### 7006653"]
    prompts, model, scripts = scripted_chat(tok, [script], TOOLS, question=QUESTION)
    engine = Recording(hf_engine(model, tok))
    with _server(tok, engine) as server:
        [res] = run_episodes(tool_agent, server, [{"row": 0}], timeout_s=60)
        first, out = server.output(tok.pad_token_id)
    assert res.error is None and res.reward == 1.0  # the client parsed the answer's text
    assert first == [prompts[0]] == [engine.calls[0][0]]  # the template's prompt, as read
    assert len(engine.calls) == 3 and [c[3] for c in engine.calls] == \
        [turn_seed(11, 0, k) for k in range(3)]
    assert [c[1] for c in engine.calls] == scripts[0]  # the scripted policy sampled its script
    # the response: sample 1, the tool's answer as the template appends it, sample 2, ..., each
    # sample the engine's own ids and log-probs (1 on the mask), the appended ids at 0
    obs = [observation_ids(tok, [{"role": "tool", "content": a}], end_of_turn="<|im_end|>",
                           tools=TOOLS) for a in ("7006652", "7006653")]
    want = engine.calls[0][1] + obs[0] + engine.calls[1][1] + obs[1] + engine.calls[2][1]
    n = len(want)
    assert out.response_ids[0, :n].tolist() == want
    assert out.response_mask[0].tolist() == [1.0] * len(scripts[0][0]) + [0.0] * len(obs[0]) + \
        [1.0] * len(scripts[0][1]) + [0.0] * len(obs[1]) + [1.0] * len(scripts[0][2])
    sampled_logp = [x for c in engine.calls for x in c[2]]
    assert out.logprobs[0][out.response_mask[0] == 1].tolist() == sampled_logp
    assert not out.logprobs[0][out.response_mask[0] == 0].any()
    # each later prompt is the earlier prompt, its completion and the appended ids, exactly
    assert engine.calls[1][0] == prompts[0] + scripts[0][0] + obs[0]
    # the stored record: per completion its request and spans (what resume reads, not the agent)
    t = out.turns[0]
    a, b = len(scripts[0][0]), len(scripts[0][0]) + len(obs[0])
    c = b + len(scripts[0][1])
    assert [x["sampled"] for x in t] == [[0, a], [b, c], [c + len(obs[1]), n]]
    assert t[0]["calls"] == [{"name": "calculator", "arguments": {"expression": "1234 * 5678"}}]
    assert t[0]["appended"] == [len(scripts[0][0]), len(scripts[0][0]) + len(obs[0])]
    assert t[2]["request"]["messages"][-1] == {"role": "tool", "tool_call_id": "call_0_1_0",
                                               "content": "7006653"}
    json.dumps(out.stored_turns())  # the batch stores it
    # the stored requests alone sample the episode again: no agent is called
    with _server(tok, engine) as again:
        again.replay(out.turns)
        _, replayed = again.output(tok.pad_token_id)
    assert len(engine.calls) == 6 and torch.equal(replayed.response_ids, out.response_ids)
    assert torch.equal(replayed.logprobs, out.logprobs) and replayed.turns == out.turns


@pytest.fixture(scope="module")
def random_qwen(tmp_path_factory):
    from transformers import AutoModelForCausalLM
    folder = qwen_folder(tmp_path_factory.mktemp("qwen"))
    tok = qwen_tokenizer()
    return tok, hf_engine(AutoModelForCausalLM.from_pretrained(folder).eval(), tok)


def completion_agent(base_url: str, row: dict):
    """Three completions on the text endpoint, each prompt the last one + its completion + a
    line the agent adds (a random model rarely stops: no end-of-turn is needed here)."""
    client = OpenAI(base_url=base_url, api_key="unused", max_retries=0)
    prompt, got = f"<|im_start|>user\nrow {row['row']}<|im_end|>\n<|im_start|>assistant\n", []
    for k in range(3):
        r = client.completions.create(model="policy", prompt=prompt, max_tokens=5, logprobs=1)
        got.append(r.choices[0].logprobs.token_logprobs)
        prompt += r.choices[0].text + f"\nobservation {k}\n"
    return None


def _episodes(tok, engine, rows, sequential: bool):
    with _server(tok, engine, rows=rows, budget=60) as server:
        if sequential:
            for r in range(rows):
                assert run_episodes(completion_agent, _one(server, r), [{"row": r}], 60)[0].error \
                    is None
        else:
            assert all(x.error is None for x in run_episodes(
                completion_agent, server, [{"row": r} for r in range(rows)], 60))
        return server.output(tok.pad_token_id)


def _one(server, r):
    """A view of ``server`` with episode ``r`` only (the runner drives every episode it has)."""
    view = object.__new__(OpenAIServer)
    view.__dict__.update(server.__dict__)
    view.episodes = {r: server.episodes[r]}
    return view


def test_seeds_make_an_episode_the_same_whatever_the_concurrency(random_qwen):
    tok, engine = random_qwen
    a_prompts, a = _episodes(tok, engine, 3, sequential=True)
    b_prompts, b = _episodes(tok, engine, 3, sequential=False)
    assert a_prompts == b_prompts and torch.equal(a.response_ids, b.response_ids)
    assert torch.equal(a.response_mask, b.response_mask) and torch.equal(a.logprobs, b.logprobs)
    assert [len(t) for t in a.turns] == [3, 3, 3]
    # completion k of row r is the engine's draw from turn_seed(11, r, k) on the assembled ids
    r, k = 2, 1
    span = a.turns[r][k]["sampled"]
    prefix = a_prompts[r] + a.response_ids[r, :span[0]].tolist()
    ids = torch.tensor([prefix])
    direct = engine.generate(ids, torch.ones_like(ids), SamplingParams(temperature=1.0,
                             max_new_tokens=5), row_seeds=[turn_seed(11, r, k)], row_limits=[5])
    assert direct.response_ids[0, :span[1] - span[0]].tolist() == \
        a.response_ids[r, span[0]:span[1]].tolist()
    # rows differ (their seeds and prompts do)
    assert a.response_ids[0].tolist() != a.response_ids[1].tolist()


def test_budgets_history_and_parameters_are_refused_with_the_reason(random_qwen):
    tok, engine = random_qwen
    prompt = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    with _server(tok, engine, rows=2, budget=12, max_turns=3, max_prompt_length=40) as server:
        c = OpenAI(base_url=server.base_url(0), api_key="unused", max_retries=0)
        r = c.completions.create(model="policy", prompt=prompt, max_tokens=8)
        with pytest.raises(openai.BadRequestError, match="must start with the previous prompt"):
            c.completions.create(model="policy", prompt="rewritten " + prompt, max_tokens=2)
        with pytest.raises(openai.BadRequestError, match="temperature=0.5: this rollout samples"):
            c.completions.create(model="policy", prompt=prompt + r.choices[0].text,
                                 temperature=0.5)
        # 8 sampled + the appended line leave less than nothing of the 12-token budget
        with pytest.raises(openai.BadRequestError, match="response budget of 12 tokens"):
            c.completions.create(model="policy", prompt=prompt + r.choices[0].text +
                                 "\nsome long observation text here\n")
        c1 = OpenAI(base_url=server.base_url(1), api_key="unused", max_retries=0)
        with pytest.raises(openai.BadRequestError, match="more than data.max_prompt_length=40"):
            c1.completions.create(model="policy", prompt=prompt * 4)
        with pytest.raises(openai.BadRequestError, match="n must be 1"):
            c1.completions.create(model="policy", prompt=prompt, n=2)
        with pytest.raises(openai.NotFoundError, match="no episode '7'"):
            OpenAI(base_url=server.base_url(7), api_key="u", max_retries=0).completions.create(
                model="policy", prompt=prompt)
    with _server(tok, engine, rows=1, budget=40, max_turns=2) as server:
        c = OpenAI(base_url=server.base_url(0), api_key="unused", max_retries=0)
        text = prompt
        for _ in range(2):
            text += c.completions.create(model="policy", prompt=text, max_tokens=2).choices[0].text
        with pytest.raises(openai.BadRequestError, match="made its 2 completions"):
            c.completions.create(model="policy", prompt=text)


def test_a_rewritten_assistant_turn_is_refused_naming_it():
    tok = qwen_tokenizer()
    prompts, model, _ = scripted_chat(tok, [[CALL % "1 * 2", "#### 2"]], TOOLS, question="q")
    with _server(tok, hf_engine(model, tok)) as server:
        c = OpenAI(base_url=server.base_url(0), api_key="unused", max_retries=0)
        msgs = [{"role": "system", "content": "row 0"}, {"role": "user", "content": "q"}]
        m = c.chat.completions.create(model="policy", messages=msgs, tools=TOOLS).choices[0]
        assert m.finish_reason == "tool_calls" and m.message.tool_calls[0].function.name == \
            "calculator"
        edited = [*msgs, {"role": "assistant", "content": "I will not call the tool"},
                  {"role": "tool", "content": "2"}]
        with pytest.raises(openai.BadRequestError, match="message 2 must be the assistant "
                                                         "message the endpoint returned"):
            c.chat.completions.create(model="policy", messages=edited, tools=TOOLS)
        with pytest.raises(openai.BadRequestError, match="tools differ"):
            c.chat.completions.create(model="policy", messages=msgs, tools=[])


def test_the_port_is_closed_after_the_rollout(random_qwen):
    tok, engine = random_qwen
    with _server(tok, engine) as server:
        port = server.port
        assert port > 0 and server.base_url(0) == f"http://127.0.0.1:{port}/episodes/0/v1"
        socket.create_connection(("127.0.0.1", port), timeout=5).close()
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", port), timeout=5)


def test_crashing_hanging_and_wrong_agents_are_contained(random_qwen):
    tok, engine = random_qwen
    release, late = threading.Event(), []

    def agent(base_url, row):
        if row["row"] == 0:
            raise RuntimeError("the agent's bug")
        if row["row"] == 1:
            c = OpenAI(base_url=base_url, api_key="u", max_retries=0)
            c.completions.create(model="policy", prompt="hi", max_tokens=2)
            release.wait(30)  # hangs past the timeout, then tries another request
            try:
                c.completions.create(model="policy", prompt=[1, 2, 3])
            except openai.ConflictError as e:
                late.append(str(e))
        if row["row"] == 2:
            return "a string"
        return 0.25

    async def async_agent(base_url, row):
        return 0.5

    with _server(tok, engine, rows=4) as server:
        t0 = time.monotonic()
        res = run_episodes(agent, server, [{"row": r} for r in range(4)], timeout_s=2)
        assert time.monotonic() - t0 < 25  # the 30 s hang was not waited for (timeout 2 s)
        assert "RuntimeError: the agent's bug" in res[0].error
        assert "openai_agent_timeout_s=2" in res[1].error
        assert "returned 'a string'" in res[2].error
        assert res[3] == type(res[3])(0.25, None)
        # the timed-out episode keeps nothing (what it sampled by the deadline is timing's)
        assert server.episodes[1].completions == []
        release.set()  # its late request is refused: the episode is closed
        for _ in range(50):
            if late:
                break
            time.sleep(0.1)
        assert "episode 1 is closed" in late[0] and server.episodes[1].completions == []
        assert [x.reward for x in run_episodes(async_agent, _one(server, 3), [{}], 5)] == [0.5]
    score = join_agent_rewards(torch.tensor([1.0, 1.0, 0.5]),
                               [{"agent_error": "x"}, {"agent_error": None, "agent_reward": 0.25},
                                {}])
    assert score.tolist() == [0.0, 1.25, 0.5]  # failed: 0; the agent's reward added; others kept


AGENT_FILE = '''
from openai import OpenAI

def agent(base_url, row):
    if row["index"] % 4 == 3:
        raise ValueError("this row's agent crashes")
    client = OpenAI(base_url=base_url, api_key="unused", max_retries=0)
    prompt = row["prompt"]
    for k in range(2):
        r = client.completions.create(model="policy", prompt=prompt, max_tokens=3)
        prompt += r.choices[0].text + "="
    return 0.5
'''


def test_a_two_step_training_run_with_an_agent_function(tmp_path):
    from tests.presets import tiny_run
    from verl_core.train import train
    path = tmp_path / "my_agent.py"
    path.write_text(AGENT_FILE)
    cfg = tiny_run(**{"total_steps": 2, "rollout.openai_agent": f"{path}:agent",
                      "rollout.max_new_tokens": 12, "eval_every": 0})
    summary = train(cfg, str(tmp_path / "run"), log=lambda *_: None)
    h = summary["history"]
    assert len(h) == 2
    # 8 prompts x 4 samples: rows 3, 7, ... (every 4th dataset index) crash and score 0
    assert all(m["agent/errors"] >= 1 for m in h) and all(m["agent/reward_mean"] == 0.5
                                                          for m in h)
    assert all(m["num_turns/mean"] > 1.0 for m in h)


def test_a_wrong_agent_is_refused_before_any_work(tmp_path):
    from tests.presets import tiny_run
    from verl_core.agent.openai_server import AgentFunctionError
    from verl_core.assets import prepare_assets
    from verl_core.config import ConfigError
    with pytest.raises(ConfigError, match="set rollout.multi_turn=False"):
        tiny_run(**{"rollout.openai_agent": "a.py:f", "data.synthetic_task": "calculator"})
    with pytest.raises(ConfigError, match="it is not an agent loop"):
        tiny_run(**{"rollout.openai_agent": "a.py:f", "rollout.agent_loop": "single_turn_agent"})
    (tmp_path / "agents.py").write_text("def other(base_url, row):\n    return None\n")
    for spec, match in ((f"{tmp_path}/missing.py:agent", "does not exist"),
                        (f"{tmp_path}/agents.py:agent", "has no function 'agent'"),
                        ("no_such_package.agent", "importing 'no_such_package' failed")):
        logged: list[str] = []
        with pytest.raises(AgentFunctionError, match=match):
            prepare_assets(tiny_run(**{"rollout.openai_agent": spec}), str(tmp_path / "w"),
                           log=logged.append)
        # refused before the warm start: it logged nothing and wrote no model
        assert not any(line.startswith("warm start") for line in logged), logged
        assert not (tmp_path / "w" / "model").exists()


@pytest.mark.vllm
def test_the_endpoint_on_vllm_assembles_the_engines_samples(tmp_path):
    """The same episodes on vLLM (its CPU backend in .venv-vllm): the assembled response is the
    engine's own sampled ids and log-probs, and two runs (sequential, concurrent) agree."""
    from verl_core.rollout import make_engine
    folder = qwen_folder(tmp_path / "qwen")
    tok = qwen_tokenizer()
    eng = Recording(make_engine(
        "vllm", model_path=str(folder), eos_token_ids=[tok.eos_token_id],
        pad_token_id=tok.pad_token_id, dtype="float32", gpu_memory_utilization=0.3,
        cpu_kv_cache_gib=0.25, enforce_eager=True, free_cache_engine=False, max_model_len=256,
        seed=0))
    try:
        a_prompts, a = _episodes(tok, eng, 2, sequential=True)
        calls = list(eng.calls)
        b_prompts, b = _episodes(tok, eng, 2, sequential=False)
    finally:
        eng.engine.close()
    assert a_prompts == b_prompts and torch.equal(a.response_ids, b.response_ids)
    for r in range(2):  # row r's completions, in order: the engine's ids and log-probs exactly
        mine = [c for c in calls if c[3] in {turn_seed(11, r, k) for k in range(3)}]
        m = a.response_mask[r] == 1
        assert a.response_ids[r][m].tolist() == [i for c in mine for i in c[1]]
        assert a.logprobs[r][m].tolist() == [x for c in mine for x in c[2]]


def test_a_rerun_rollout_phase_stores_the_same_batch_bytes(tmp_path):
    """What a resume relies on: the agent's rollout phase run again (a fresh trainer, as after a
    SIGKILL) gives the same batch, byte for byte, though its episodes run concurrently."""
    from tests.presets import tiny_run
    from verl_core.assets import prepare_assets
    from verl_core.data.batch import batch_to_parquet_bytes
    from verl_core.trainer import RLTrainer
    path = tmp_path / "my_agent.py"
    path.write_text(AGENT_FILE)
    cfg = tiny_run(**{"rollout.openai_agent": f"{path}:agent", "rollout.max_new_tokens": 12})
    assets = prepare_assets(cfg, str(tmp_path / "w"), log=lambda *_: None)
    got = []
    for _ in range(2):
        trainer = RLTrainer(cfg, assets)
        try:
            batch, metrics = trainer.rollout(1)
        finally:
            trainer.close()
        got.append(batch_to_parquet_bytes(batch))
    assert metrics["agent/errors"] == 8.0  # dataset rows 3, 7, ... crash: 2 of 8 prompts x 4
    assert got[0] == got[1] and batch.turns[0]["turns"][0]["request"]["prompt"]


HANGING_AGENT_FILE = '''
import os
import time

from openai import OpenAI


def agent(base_url, row):
    client = OpenAI(base_url=base_url, api_key="unused", max_retries=0)
    prompt = row["prompt"]
    for k in range(2):
        r = client.completions.create(model="policy", prompt=prompt, max_tokens=3)
        prompt += r.choices[0].text + "="
        when, marker = os.environ.get("HANG_AFTER"), os.environ.get("HANG_MARKER")
        if k == 0 and when and os.path.exists(when):  # a step after the first checkpoint
            try:  # one episode of the run: the first to get here
                os.close(os.open(marker, os.O_CREAT | os.O_EXCL))
            except FileExistsError:
                continue
            time.sleep(600)  # mid-episode: one completion recorded, the next never asked
    return 0.5
'''


def test_a_sigkill_mid_episode_then_the_same_command_ends_with_the_undisturbed_weights(tmp_path):
    """The plain loop with an agent function, SIGKILLed (its process group) while an episode of
    a step after the first checkpoint waits between two completions; the same command again
    resumes and ends with the weights of the undisturbed run, bit for bit."""
    import json
    import subprocess

    from tests.crash import REPO, kill_at_marker, train_command, weights_sha
    from tests.presets import TINY, tiny_run
    from verl_core.train import train
    path = tmp_path / "my_agent.py"
    path.write_text(HANGING_AGENT_FILE)
    over = {**TINY, "total_steps": 3, "rollout.openai_agent": f"{path}:agent",
            "rollout.max_new_tokens": 12, "checkpoint.checkpoint_interval": 1,
            "val_before_train": False}
    ref = train(tiny_run(**over), str(tmp_path / "ref"), log=lambda *_: None)
    work, marker = tmp_path / "work", tmp_path / "mid-episode"
    cmd, env = train_command(work, over, HANG_AFTER=work / "latest.json", HANG_MARKER=marker)
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True, env=env)
    kill_at_marker(proc, marker, "an episode after the first checkpoint")
    done = subprocess.run(cmd + ["--summary-json", str(tmp_path / "s.json")], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    assert "resuming from the checkpoint of step" in done.stdout
    got = json.loads((tmp_path / "s.json").read_text())
    assert weights_sha(got["final_model"]) == weights_sha(ref["final_model"])
