"""The multi-turn sampler's limits and verl's per-row tool arguments (rollout/multi_turn.py):
``max_user_turns``, ``max_parallel_calls``, ``extra_info.tools_kwargs`` (create_kwargs,
execute_kwargs) and the rollout's tool-time budget, with the scripted policy of
``tests.standins`` and a real tool host running a user's tool class from a file."""
import pytest
import yaml

from tests.standins import hf_engine, qwen_tokenizer, scripted_chat
from verl_core.agent.tools import ToolHost, load_tool_config
from verl_core.rollout import SamplingParams
from verl_core.rollout.multi_turn import generate_turns

ECHO = '''
class EchoTool:
    """Answers with what it was created and called with (verl's BaseTool methods)."""

    def __init__(self, config, tool_schema):
        self.made = {}

    async def create(self, instance_id, **kwargs):
        self.made[instance_id] = kwargs
        return instance_id

    async def execute(self, instance_id, parameters, **kwargs):
        return (f"said={parameters['text']} made={sorted(self.made[instance_id].items())} "
                f"extra={sorted(kwargs.items())}", 0.5, {})

    async def calc_reward(self, instance_id, **kwargs):
        return 1.0

    async def release(self, instance_id, **kwargs):
        self.made.pop(instance_id)
'''
SCHEMA = {"type": "function", "function": {
    "name": "echo", "description": "Echo.",
    "parameters": {"type": "object", "properties": {"text": {"type": "string"}},
                   "required": ["text"]}}}
TOOLS = [SCHEMA]


def _call(text: str) -> str:
    return '<tool_call>{"name": "echo", "arguments": {"text": "%s"}}</tool_call>' % text


@pytest.fixture(scope="module")
def host(tmp_path_factory):
    folder = tmp_path_factory.mktemp("echo")
    (folder / "echo.py").write_text(ECHO)
    (folder / "tools.yaml").write_text(yaml.safe_dump({"tools": [{
        "class_name": f"{folder / 'echo.py'}:EchoTool", "tool_schema": SCHEMA}]}))
    with ToolHost(load_tool_config(str(folder / "tools.yaml")), timeout_s=30.0) as h:
        yield h


def _run(host, turns_of_rows, **kw):
    tok = qwen_tokenizer()
    prompts, model, _ = scripted_chat(tok, turns_of_rows, TOOLS)
    return generate_turns(hf_engine(model, tok), tok, prompts,
                          SamplingParams(temperature=1.0, max_new_tokens=400, seed=1),
                          host=host, tools=TOOLS, instance_prefix="lim", **kw)


def test_tools_kwargs_reach_create_and_execute_and_rewards_are_kept_per_call(host):
    out = _run(host, [[_call("a"), _call("b"), "done"], [_call("c"), "done"]],
               tools_kwargs=[{"echo": {"create_kwargs": {"secret": 7},
                                       "execute_kwargs": {"mode": "x"}}}, None])
    first = out.turns[0][0]["results"][0]["observation"]
    assert first == "said=a made=[('secret', 7)] extra=[('mode', 'x')]"
    assert out.turns[0][1]["results"][0]["observation"].startswith("said=b made=[('secret', 7)]")
    assert out.turns[1][0]["results"][0]["observation"] == "said=c made=[] extra=[]"
    # each call's step reward, then the instance's calc_reward
    assert out.tool_rewards == [[0.5, 0.5, 1.0], [0.5, 1.0]]
    # every real token is attended to; the loss mask has the observations' holes
    real = out.attention_mask.bool()
    assert bool((out.response_mask.bool() <= real).all())
    assert int(real[0].sum()) > int(out.response_mask[0].sum())


def test_max_user_turns_stops_after_that_many_tool_responses(host):
    out = _run(host, [[_call("a"), _call("b"), _call("c"), "done"]], max_user_turns=1)
    turns = out.turns[0]
    assert len(turns) == 2 and len(turns[0]["results"]) == 1
    assert turns[1]["results"] == [] and "appended" not in turns[1]  # the second call never ran


def test_max_parallel_calls_runs_the_first_calls_of_a_turn(host):
    out = _run(host, [[_call("a") + _call("b"), "done"]], max_parallel_calls=1)
    assert [r["observation"][:6] for r in out.turns[0][0]["results"]] == ["said=a"]
    both = _run(host, [[_call("a") + _call("b"), "done"]], max_parallel_calls=0)
    assert [r["observation"][:6] for r in both.turns[0][0]["results"]] == ["said=a", "said=b"]


def test_a_spent_tool_budget_times_calls_out_at_once_without_restarting_the_host(host):
    restarts = host.restarts
    out = _run(host, [[_call("a"), "done"]], budget_s=0.0)
    [result] = out.turns[0][0]["results"]
    assert result["status"] == "timeout" and "tool_budget_s" in result["observation"]
    assert host.restarts == restarts
    assert len(out.turns[0]) == 2  # the model read the timeout and answered
