"""Custom agent loops on verl's AgentLoopBase contract (issue 45, item 1), on the tiny model:
a user's loop given by ``file.py:Class`` trains, rows choose their loop by ``agent_name``, a
crashing, a hanging and a lying loop are contained (row scored 0, counted), and a row's tokens
do not depend on the batch it was sampled in. Nothing is mocked: the loops drive the real engine
through the real batcher."""
import dataclasses
import textwrap

import pytest
import torch

from tests.presets import TINY, tiny_run
from verl_core.agent.loops import AgentLoopError, loop_kwargs, run_agent_loops
from verl_core.assets import prepare_assets
from verl_core.data.batch import batch_to_parquet_bytes
from verl_core.rollout import SamplingParams
from verl_core.trainer import RLTrainer

LOOPS = textwrap.dedent('''
    import asyncio, os, time
    from verl.experimental.agent_loop import AgentLoopBase, AgentLoopOutput, register

    OBS = " ok "

    class TwoSamples(AgentLoopBase):
        """Samples, appends a fixed observation, samples again."""
        def __init__(self, *args, obs=OBS, **kwargs):
            super().__init__(*args, **kwargs)
            self.obs = obs

        async def run(self, sampling_params, **kwargs):
            prompt = kwargs["prompt_ids"]
            first = await self.server_manager.generate(
                request_id="a", prompt_ids=prompt,
                sampling_params={**sampling_params, "max_tokens": 3})
            obs = self.tokenizer.encode(self.obs, add_special_tokens=False)
            second = await self.server_manager.generate(
                request_id="b", prompt_ids=prompt + first.token_ids + obs,
                sampling_params=sampling_params)
            assert len(first.log_probs) == len(first.token_ids)
            mark = os.environ.get("LOOP_MARK")  # the crash test: SIGKILLed mid-episode here
            if mark and not os.path.exists(mark):
                open(mark, "w").close()
                time.sleep(60)
            resp = first.token_ids + obs + second.token_ids
            mask = [1] * len(first.token_ids) + [0] * len(obs) + [1] * len(second.token_ids)
            return AgentLoopOutput(prompt_ids=prompt, response_ids=resp, response_mask=mask,
                                   num_turns=3, extra_fields={"first_len": len(first.token_ids)})

    class ToolUser(AgentLoopBase):
        """Calls the run's calculator tool (in the tool host), reads its answer, samples."""
        async def run(self, sampling_params, **kwargs):
            p = kwargs["prompt_ids"]
            calc = self.tools["calculator"]
            iid = await calc.create()
            resp, reward, _ = await calc.execute(iid, {"expression": "6*7"})
            await calc.release(iid)
            obs = self.tokenizer.encode(resp.text, add_special_tokens=False)
            out = await self.server_manager.generate(request_id="a", prompt_ids=p + obs,
                                                     sampling_params=sampling_params)
            return AgentLoopOutput(prompt_ids=p, response_ids=obs + out.token_ids,
                                   response_mask=[0] * len(obs) + [1] * len(out.token_ids),
                                   extra_fields={"tool_text": resp.text})

    @register("crashes")
    class Crashes(AgentLoopBase):
        async def run(self, sampling_params, **kwargs):
            await self.server_manager.generate(request_id="a", prompt_ids=kwargs["prompt_ids"],
                                               sampling_params=sampling_params)
            raise RuntimeError("boom")

    @register("hangs")
    class Hangs(AgentLoopBase):
        async def run(self, sampling_params, **kwargs):
            time.sleep(3600)  # sync: blocks its own thread, never the rollout

    @register("lies")
    class Lies(AgentLoopBase):
        async def run(self, sampling_params, **kwargs):
            p = kwargs["prompt_ids"]
            out = await self.server_manager.generate(request_id="a", prompt_ids=p,
                                                     sampling_params=sampling_params)
            forged = [(t + 1) % 10 for t in out.token_ids]  # not what the engine sampled
            return AgentLoopOutput(prompt_ids=p, response_ids=forged,
                                   response_mask=[1] * len(forged))
''')


@pytest.fixture(scope="module")
def loops_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("loops") / "my_loops.py"
    path.write_text(LOOPS)
    return str(path)


@pytest.fixture(scope="module")
def prepared(loops_file, tmp_path_factory):
    cfg = tiny_run(**{"rollout.agent_loop": f"{loops_file}:TwoSamples",
                      "rollout.agent_loop_timeout_s": 2.0})
    return cfg, prepare_assets(cfg, str(tmp_path_factory.mktemp("a")), log=lambda *_: None)


@pytest.fixture(scope="module")
def trainer(prepared):
    t = RLTrainer(*prepared)
    yield t
    t.close()


@pytest.fixture(scope="module")
def rolled(trainer):
    return (trainer, *trainer.rollout(1))


def test_a_user_loop_by_path_gives_its_masks_and_the_engines_log_probs(rolled):
    trainer, batch, metrics = rolled
    _assert_two_samples(trainer, batch, metrics)
    again = trainer.rollout(1)[0]  # per (step, row) seeds: the same stored bytes again
    assert batch_to_parquet_bytes(again) == batch_to_parquet_bytes(batch)


def test_two_workers_roll_out_the_batch_of_one(prepared, rolled, tmp_path):
    from tests.verl_core.test_agent_rl import _assert_two_workers_roll_out_the_batch_of_one

    _assert_two_workers_roll_out_the_batch_of_one(*prepared, *rolled, tmp_path)


@pytest.mark.vllm
def test_on_vllm_a_user_loop_gives_its_masks_and_the_engines_log_probs(prepared):
    cfg = tiny_run(**{"rollout.agent_loop": cfg_loop(prepared), "rollout.engine": "vllm"})
    t = RLTrainer(cfg, prepared[1])
    try:
        assert type(t.behaviour.engine).__name__ == "VLLMEngine"
        _assert_two_samples(t, *t.rollout(1))
    finally:
        t.close()


def cfg_loop(prepared) -> str:
    return prepared[0].rollout.agent_loop


def _assert_two_samples(trainer, batch, metrics):
    tok, obs = trainer.tokenizer, trainer.tokenizer.encode(" ok ", add_special_tokens=False)
    assert metrics["agent_loop/errors"] == 0 and metrics["agent_loop/timeouts"] == 0
    for i, row in enumerate(batch.turns):
        assert row["agent"]["status"] == "ok", row["agent"]
        k = row["agent"]["extra_fields"]["first_len"]
        assert 1 <= k <= 3
        real = int(batch.response_attention_mask[i].sum())
        ids = batch.response_ids[i, :real].tolist()
        mask = batch.response_mask[i, :real].tolist()
        assert ids[k:k + len(obs)] == obs[:real - k]  # the observation, as the loop appended it
        assert mask == ([1.0] * k + [0.0] * len(obs) + [1.0] * real)[:real]
        lp = batch.response_logprobs[i, :real]
        assert (lp[torch.tensor(mask) == 0] == 0).all() and (lp[:k] < 0).all()
    # the loop's extra_fields reach the scorer with verl's num_turns
    assert all("first_len" in info for info in batch.extra_info)
    # the trainer's log-probs of the sampled tokens are the engine's (up to rounding)
    from tests.verl_core.test_agent_rl import _rounding_bound
    from verl_core.training.forward import batched_logprobs

    logp = batched_logprobs(trainer.actor.model, batch, trainer.cfg.rollout.temperature, 8)
    sampled = batch.response_mask.bool()
    diff = (logp - batch.response_logprobs)[sampled].abs().max().item()
    assert diff <= _rounding_bound(trainer, batch), diff


def test_rows_choose_their_loop_and_failures_are_contained_and_batching_changes_nothing(
        trainer, loops_file, caplog):
    b = trainer.behaviour
    rows = [trainer.prompts.train_rows[i] for i in range(6)]
    names = [f"{loops_file}:TwoSamples", "single_turn_agent", "crashes", "hangs", "lies",
             f"{loops_file}:TwoSamples"]
    rows = [dataclasses.replace(r, extra_info={**r.extra_info, "agent_name": n})
            for r, n in zip(rows, names)]
    ids, mask = trainer.prompts.train_ids[:6], trainer.prompts.train_mask[:6]
    params = SamplingParams(temperature=1.0, max_new_tokens=trainer.cfg.rollout.max_new_tokens,
                            seed=7)
    with caplog.at_level("WARNING"):
        out = b.generate_turns(ids, mask, params, list(range(6)), rows, "rollout")
    status = [a["status"] for a in out.agents]
    assert status == ["ok", "ok", "error", "timeout", "error", "ok"], out.agents
    assert "boom" in out.agents[2]["error"] and "malformed" in out.agents[4]["error"]
    assert sum("scored 0" in r.message for r in caplog.records) == 1  # once per batch
    for i in (2, 3, 4):  # failed: an empty response (one EOS, not trained on), scored 0
        assert out.response_mask[i].sum() == 0 and out.agents[i]["reward_score"] == 0.0
    assert out.agents[1]["name"] == "single_turn_agent" and len(out.turns[1]) == 1
    # each good row alone, at its index: the same tokens bit for bit (the log-probs up to the
    # float rounding of a forward over another batch shape: the engine contract's own)
    for i in (0, 1, 5):
        one = b.generate_turns(ids[i:i + 1], mask[i:i + 1], params, [i], rows[i:i + 1],
                               "rollout")
        real = int(one.attention_mask[0].sum())
        assert torch.equal(one.response_ids[0, :real], out.response_ids[i, :real])
        torch.testing.assert_close(one.logprobs[0, :real], out.logprobs[i, :real],
                                   rtol=0, atol=1e-5)
        assert torch.equal(one.response_mask[0, :real], out.response_mask[i, :real])
    # rows 0 and 5 share the loop but not the seed
    assert not torch.equal(out.response_ids[0], out.response_ids[5]) or \
        ids[0].tolist() != ids[5].tolist()


def test_user_loops_call_the_run_tools_beside_rows_of_the_built_in_tool_loop(loops_file,
                                                                             tmp_path):
    cfg = tiny_run(**{"data.synthetic_task": "calculator", "model.warmup_sft_steps": 5,
                      "model.warmup_mixed_steps": 0})
    t = RLTrainer(cfg, prepare_assets(cfg, str(tmp_path / "calc"), log=lambda *_: None))
    try:
        p = t.prompts
        names = ["tool_agent", f"{loops_file}:ToolUser", "tool_agent", f"{loops_file}:ToolUser"]
        rows = [dataclasses.replace(r, extra_info={**r.extra_info, "agent_name": n})
                for r, n in zip(p.train_rows[:4], names)]
        params = SamplingParams(temperature=1.0, max_new_tokens=cfg.rollout.max_new_tokens,
                                seed=5)
        out = t.behaviour.generate_turns(p.train_ids[:4], p.train_mask[:4], params,
                                         list(range(4)), rows, "rollout")
        assert [a["status"] for a in out.agents] == ["ok"] * 4, out.agents
        obs = t.tokenizer.encode("42", add_special_tokens=False)
        for i in (1, 3):
            assert out.agents[i]["extra_fields"] == {"tool_text": "42"}
            assert out.response_ids[i, :len(obs)].tolist() == obs
            assert out.response_mask[i, :len(obs)].sum() == 0
        # the tool loop's rows are those a batch of tool-loop rows alone samples
        alone = t.behaviour.generate_turns(p.train_ids[:4:2], p.train_mask[:4:2], params,
                                           [0, 2], [r for r in p.train_rows[:4:2]], "rollout")
        for j, i in enumerate((0, 2)):
            real = int(alone.attention_mask[j].sum())
            assert torch.equal(alone.response_ids[j, :real], out.response_ids[i, :real])
            assert out.turns[i] == alone.turns[j]
    finally:
        t.close()


def test_a_loop_named_in_verls_agent_loop_config_gets_its_keywords(trainer, loops_file,
                                                                    tmp_path):
    config = tmp_path / "loops.yaml"
    config.write_text(f"- name: shouts\n  _target_: {loops_file}:TwoSamples\n  obs: ' OK! '\n")
    tok, p = trainer.tokenizer, trainer.prompts
    rows = p.train_rows[:2]
    out = run_agent_loops(
        trainer.behaviour.engine, tok, [p.train_ids[i][p.train_mask[i].bool()].tolist()
                                        for i in range(2)],
        SamplingParams(temperature=1.0, max_new_tokens=12, seed=3), rows=[0, 1],
        names=["shouts"] * 2, config_path=str(config),
        row_kwargs=[loop_kwargs(r) for r in rows], tool_turns=None)
    obs = tok.encode(" OK! ", add_special_tokens=False)
    for i in range(2):
        k = out.agents[i]["extra_fields"]["first_len"]
        assert out.response_ids[i, k:k + len(obs)].tolist() == obs, out.agents[i]


def test_a_loop_that_names_nothing_is_refused_before_any_work(tmp_path, loops_file):
    for spec, says in ((f"{tmp_path}/nope.py:X", "does not exist"),
                       (f"{loops_file}:Missing", "has no class"),
                       ("no_such_loop", "not a registered name"),
                       ("tool_agent", "rollout.multi_turn=True")):
        cfg = tiny_run(**{"rollout.agent_loop": spec})
        with pytest.raises(AgentLoopError, match=says):
            prepare_assets(cfg, str(tmp_path / "w"), log=lambda *_: None)


def test_a_loop_with_a_greedy_baseline_or_partial_rollouts_is_refused():
    from verl_core.config import ConfigError

    with pytest.raises(ConfigError, match="cannot score an agent loop's episode"):
        tiny_run("remax", **{"rollout.agent_loop": "x.py:Y"})
    with pytest.raises(ConfigError, match="not offered with agent loops"):
        tiny_run(**{"rollout.agent_loop": "x.py:Y", "rollout.max_staleness": 2,
                    "rollout.partial_rollout": True, "algorithm.rollout_is": "token"})


def test_an_agent_name_column_reaches_the_rows(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from verl_core.data.dataset import load_prompt_rows

    path = tmp_path / "d.parquet"
    pq.write_table(pa.table({
        "data_source": ["x", "x"], "prompt": [[{"role": "user", "content": "hi"}]] * 2,
        "reward_model": [{"style": "rule", "ground_truth": "1"}] * 2,
        "agent_name": ["my_agent", None]}), path)
    rows = load_prompt_rows([str(path)])
    assert rows[0].extra_info["agent_name"] == "my_agent" and "agent_name" not in rows[1].extra_info
    assert loop_kwargs(rows[0])["agent_name"] == "my_agent"


def test_a_user_loop_trains_two_steps(loops_file, tmp_path):
    from verl_core.train import train

    cfg = tiny_run(**{"rollout.agent_loop": f"{loops_file}:TwoSamples", "total_steps": 2})
    got = train(cfg, str(tmp_path / "run"), log=lambda *_: None)
    steps = got["history"]
    assert len(steps) == 2, steps
    assert all(s["agent_loop/errors"] == 0 and s["agent_loop/timeouts"] == 0 for s in steps)
    assert all(s["num_turns/mean"] == 2 for s in steps)  # two sampled spans per row
    assert got["final_model"]


@pytest.mark.parametrize("engine", ["hf", pytest.param("vllm", marks=pytest.mark.vllm)])
def test_sigkilled_mid_episode_the_run_resumes_to_the_same_weights(loops_file, tmp_path, engine):
    import subprocess

    from tests.crash import REPO, kill_at_marker, train_command, weights_sha
    from verl_core.train import train

    over = {**TINY, "rollout.agent_loop": f"{loops_file}:TwoSamples", "total_steps": 2,
            "rollout.engine": engine}
    reference = train(tiny_run(**over), str(tmp_path / "ref"), log=lambda *_: None)
    mark = tmp_path / "mid-episode"
    cmd, env = train_command(tmp_path / "work", over)
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True, env={**env, "LOOP_MARK": str(mark)})
    kill_at_marker(proc, mark, "an agent loop's second generate call", poll_s=0.05)
    done = subprocess.run(cmd + ["--summary-json", str(tmp_path / "s.json")], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    import json
    got = json.loads((tmp_path / "s.json").read_text())
    assert weights_sha(got["final_model"]) == weights_sha(reference["final_model"])
