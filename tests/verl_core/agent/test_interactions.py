"""Simulated users (verl's interactions, issue 45): the scripted policy of
``tests.standins.ScriptedLM`` plays against real interaction classes in the real host process
(``verl_core/agent/interactions.py``), so every span of the response is known; then the guess
task trains 2 steps end to end on the tiny model."""
import textwrap

import pytest
import yaml

from tests.presets import TINY, tiny_run
from tests.standins import hf_engine, qwen_tokenizer, scripted_chat
from verl_core.agent.interactions import interaction_entries, load_interaction_config
from verl_core.agent.tools import CalculatorTool, ToolConfigError, ToolEntry, ToolHost
from verl_core.agent.turns import observation_ids
from verl_core.reward.manager import RewardScorer
from verl_core.reward.scoring import turn_extra_info
from verl_core.rollout import SamplingParams
from verl_core.rollout.multi_turn import Interactions, generate_turns, turn_metrics

QUESTION = "Guess my number, 1-7."


def _play(tok, host, turns_of_rows, kwargs, budget=300, **kw):
    prompts, model, scripts = scripted_chat(tok, turns_of_rows, None, question=QUESTION)
    messages = [[{"role": "system", "content": f"row {r}"}, {"role": "user", "content": QUESTION}]
                for r in range(len(turns_of_rows))]
    out = generate_turns(hf_engine(model, tok), tok, prompts,
                         SamplingParams(temperature=1.0, max_new_tokens=budget, seed=3),
                         host=None, tools=None, instance_prefix="t",
                         interactions=Interactions(host, kwargs, messages), **kw)
    return out, scripts


@pytest.fixture(scope="module")
def guess_host():
    entries = interaction_entries("builtin:guess")
    with ToolHost([e.tool_entry() for e in entries], timeout_s=30.0) as h:
        yield h


def _guess(target):
    return {"name": "guess", "target": target, "low": 1, "high": 7}


def test_the_users_turns_are_masked_and_its_turn_scores_are_the_reward(guess_host):
    tok = qwen_tokenizer()
    out, scripts = _play(tok, guess_host, [["4", "6", "5"], ["4"], ["1", "2", "3", "4"]],
                         [_guess(5), _guess(4), _guess(7)], max_assistant_turns=4)
    said = [["higher", "lower", "correct"], ["correct"], ["higher", "higher", "higher"]]
    for r in range(3):
        ids, m, lp = out.response_ids[r], out.response_mask[r], out.logprobs[r]
        want, mask = [], []
        for k, turn in enumerate(out.turns[r]):
            want += scripts[r][k]
            mask += [1.0] * len(scripts[r][k])
            assert turn["sampled"] == [len(want) - len(scripts[r][k]), len(want)]
            if k < len(said[r]):  # the user's message and the next header: template ids, 0
                obs = observation_ids(tok, [{"role": "user", "content": said[r][k]}],
                                      end_of_turn="<|im_end|>")
                assert turn["user"]["text"] == said[r][k] and turn["user"]["status"] == "ok"
                assert turn["appended"] == [len(want), len(want) + len(obs)]
                want += obs
                mask += [0.0] * len(obs)
        n = len(want)
        assert ids[:n].tolist() == want and m[:n].tolist() == mask and not m[n:].any()
        assert bool((lp[m == 0] == 0).all())
    # found: the user ends the episode (turn score 1 at "correct"); not found in 4 turns: the
    # limit ends it, and the last turn gets no answer (verl checks the limits first)
    assert [len(t) for t in out.turns] == [3, 1, 4] and "user" not in out.turns[2][-1]
    assert out.turn_scores == [[0.0, 0.0, 1.0], [1.0], [0.0, 0.0, 0.0]]
    stored = out.stored_turns()
    assert [s["turn_scores"] for s in stored] == out.turn_scores
    infos = turn_extra_info([{}, {}, {}], stored)
    res = RewardScorer.from_config(tiny_run().reward).score(
        ["synthetic/guess"] * 3, ["correct"] * 3, ["5", "4", "7"], infos)
    # the guess scorer's reward is the user's turn scores (the text "correct" counts nothing)
    assert list(res.scores) == [1.0, 1.0, 0.0]
    got = turn_metrics(out)
    assert got["interaction/errors"] == 0.0 and got["interaction/turns_mean"] == 7 / 3
    assert got["interaction/terminated_fraction"] == pytest.approx(2 / 3)


def test_without_interactions_the_stored_turns_keep_their_keys():
    tok = qwen_tokenizer()
    prompts, model, _ = scripted_chat(tok, [["4"]], [CalculatorTool.SCHEMA], question=QUESTION)
    entry = ToolEntry("verl_core.agent.tools.CalculatorTool", {}, CalculatorTool.SCHEMA)
    with ToolHost([entry]) as h:
        out = generate_turns(hf_engine(model, tok), tok, prompts,
                             SamplingParams(temperature=1.0, max_new_tokens=50, seed=3), host=h,
                             tools=[CalculatorTool.SCHEMA], instance_prefix="t")
    assert out.turn_scores is None and [set(s) for s in out.stored_turns()] == [
        {"turns", "tool_rewards"}]
    assert not any(k.startswith("interaction/") for k in turn_metrics(out))


BAD = textwrap.dedent('''
    import os, time

    class Flaky:
        def __init__(self, config):
            self.config = config

        async def start_interaction(self, instance_id, **kwargs):
            if kwargs["mode"] == "start":
                raise RuntimeError("cannot start")

        async def generate_response(self, instance_id, messages, mode, **kwargs):
            if mode == "raise":
                raise ValueError("boom")
            if mode == "hang":
                time.sleep(60)  # blocks the host's event loop
            if mode == "exit":
                os._exit(3)
            if mode == "tuple":
                return "not a tuple"
            if mode == "nan":
                return False, "x", float("nan"), {}
            return False, "again", 0.5, {}
    ''')


def test_a_crashing_hanging_or_wrong_user_ends_its_episode_only(tmp_path):
    (tmp_path / "flaky.py").write_text(BAD)
    cfg = tmp_path / "users.yaml"
    cfg.write_text(yaml.safe_dump({"interaction": [{
        "name": "flaky", "class_name": f"{tmp_path}/flaky.py:Flaky", "config": {}}]}))
    entries = load_interaction_config(str(cfg))
    modes = ["raise", "hang", "exit", "tuple", "nan", "start", "ok"]
    tok = qwen_tokenizer()
    with ToolHost([e.tool_entry() for e in entries], timeout_s=3.0) as host:
        out, _ = _play(tok, host, [["1", "2"]] * len(modes),
                       [{"name": "flaky", "mode": m} for m in modes], max_assistant_turns=2)
    users = [t[0]["user"] for t in out.turns]
    assert [u["status"] for u in users] == ["error", "timeout", "error", "error", "error",
                                            "error", "ok"]
    assert "boom" in users[0]["error"] and "not (should_terminate_sequence" in users[3]["error"]
    assert "finite" in users[4]["error"] and "cannot start" in users[5]["error"]
    # each failed episode ended after its first turn, nothing appended; the good row went on
    assert [len(t) for t in out.turns] == [1] * 6 + [2]
    assert all("appended" not in t[0] for t in out.turns[:6])
    assert out.turn_scores == [[]] * 6 + [[0.5]]
    assert turn_metrics(out)["interaction/errors"] == 6.0


def test_a_bad_interaction_config_or_row_is_refused_naming_it(tmp_path):
    cfg = tmp_path / "users.yaml"
    cfg.write_text("interaction: [{class_name: no.such.Module}]\n")
    [e] = load_interaction_config(str(cfg))
    assert e.name == "module"  # verl's default name: the class's, lowercased
    with pytest.raises(ToolConfigError, match="interaction class 'no.such.Module'"):
        with ToolHost([e.tool_entry()]):
            pass
    cfg.write_text("tools: []\n")
    with pytest.raises(ToolConfigError, match="top-level 'interaction' list"):
        load_interaction_config(str(cfg))
    from verl_core.agent.interactions import row_interaction

    with pytest.raises(ToolConfigError, match=r"row 3: interaction 'x' is not in"):
        row_interaction({"name": "x"}, ["guess"], 3)


def test_the_guess_task_trains_two_steps(tmp_path):
    from verl_core.train import train

    cfg = tiny_run(**{**TINY, "data.synthetic_task": "guess", "model.warmup_sft_steps": 20,
                       "total_steps": 2})
    summary = train(cfg, str(tmp_path), log=lambda *_: None)
    steps = summary["history"]
    assert len(steps) == 2
    for m in steps:
        assert m["interaction/errors"] == 0.0 and m["interaction/turns_mean"] > 0
        assert 0.0 <= m["reward/mean"] <= 1.0


def test_the_llm_user_is_the_engine_seeded_per_row_and_turn_and_masked():
    from verl_core.agent.interactions import LLM_USER_DEFAULTS
    from verl_core.data.prompts import UserHost
    from verl_core.models.tiny import build_tiny_model
    from verl_core.models.tokenizer import CHAR_CHAT_TEMPLATE
    from verl_core.rollout.multi_turn import turn_seed

    model, tok = build_tiny_model(seed=1, chat_template=CHAR_CHAT_TEMPLATE)

    def eos_bias(_module, _inputs, logits):  # an untrained model that ends its turns soon
        logits[..., tok.eos_token_id] += 4.0
        return logits

    model.lm_head.register_forward_hook(eos_bias)
    cfg = {**LLM_USER_DEFAULTS, "system_prompt": "be a user:", "max_tokens": 6,
           "stop_phrase": ""}
    users = UserHost([], {"llm_user": cfg}, 30.0)
    chat = [{"role": "user", "content": "hi"}]
    prompts = [tok(tok.apply_chat_template(chat, tokenize=False), add_special_tokens=False)
               ["input_ids"]] * 3
    engine = hf_engine(model, tok)

    def play():
        return generate_turns(
            engine, tok, prompts, SamplingParams(temperature=1.0, max_new_tokens=60, seed=5),
            host=None, tools=None, rows=[0, 1, 2], instance_prefix="t", max_assistant_turns=2,
            interactions=Interactions(users, [{"name": "llm_user"}] * 3, [chat] * 3))

    out = play()
    for r in range(3):
        first = out.turns[r][0]
        if "user" not in first:  # the first turn spent the budget or was cut: nothing to check
            continue
        a, b = first["appended"]
        assert not out.response_mask[r, a:b].any() and not out.logprobs[r, a:b].any()
        # the user's message is what the engine samples from the swapped conversation with
        # the row's own seed of that turn
        sampled = tok.decode(out.response_ids[r, slice(*first["sampled"])].tolist(),
                             skip_special_tokens=True)
        swapped = [{"role": "system", "content": "be a user:"},
                   {"role": "assistant", "content": "hi"}, {"role": "user", "content": sampled}]
        ids = tok(tok.apply_chat_template(swapped, tokenize=False), add_special_tokens=False)[
            "input_ids"]
        again = engine.generate(*_pad(ids, tok), SamplingParams(temperature=1.0, max_new_tokens=6,
                                                                seed=5),
                                row_seeds=[turn_seed(5, r, -1)])
        take = int(again.response_mask[0].sum())
        assert first["user"]["text"] == tok.decode(again.response_ids[0, :take].tolist(),
                                                   skip_special_tokens=True).strip()
        assert first["user"]["score"] is None
    assert any("user" in t[0] for t in out.turns)
    assert play().response_ids.tolist() == out.response_ids.tolist()  # seeded: the same again
    assert out.turn_scores == [[], [], []]


def _pad(ids, tok):
    import torch

    return torch.tensor([ids]), torch.ones((1, len(ids)), dtype=torch.long)
