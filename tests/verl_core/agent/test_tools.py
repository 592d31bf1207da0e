"""Tools on verl's contract (verl_core/agent/tools.py): the tool YAML, hermes calls, and the host
process that runs a user's tool class (verl's BaseTool methods, verl not installed) under
deadlines, with every bad-tool case an error the model reads, never an exception here."""
import json
import textwrap
import time
from fractions import Fraction

import pytest

from verl_core.agent.tools import (BadToolCall, CalculatorTool, Request, ToolCall,
                                   ToolConfigError, ToolHost, load_tool_config, parse_hermes)

SCHEMA = """
      type: function
      function:
        name: {name}
        description: {name} things
        parameters:
          type: object
          required: [x]
          properties:
            x: {{type: integer}}
"""

# a user's tool file, as verl users write them (async BaseTool methods; execute returns an object
# with .text, as verl's ToolResponse); each tool misbehaves in one way
USER_TOOLS = textwrap.dedent('''
    import asyncio, time

    class Reply:
        def __init__(self, text):
            self.text = text

    class Base:
        def __init__(self, config, tool_schema):
            self.config, self.name = config, tool_schema.function.name
            self.state = {}

        async def create(self, instance_id=None, ground_truth=None, **kwargs):
            self.state[instance_id] = ground_truth
            return instance_id, Reply("")

        async def calc_reward(self, instance_id, **kwargs):
            return 1.0 if self.state.get(instance_id) == "7" else 0.0

        async def release(self, instance_id, **kwargs):
            self.state.pop(instance_id, None)

    class Echo(Base):
        async def execute(self, instance_id, parameters, **kwargs):
            await asyncio.sleep(self.config.get("sleep", 0))
            return Reply(f"{self.name}: x={parameters['x']} gt={self.state[instance_id]}"), 0.5, {}

    class Raises(Base):
        async def execute(self, instance_id, parameters, **kwargs):
            raise RuntimeError("the sandbox is down")

    class Hangs(Base):
        async def execute(self, instance_id, parameters, **kwargs):
            time.sleep(600)  # blocks the host's event loop: only the deadline ends it

    class WrongType(Base):
        async def execute(self, instance_id, parameters, **kwargs):
            return 42
''')


def _yaml(tmp_path, tools: list[tuple[str, str]], name="tools.yaml") -> str:
    body = "tools:\n" + "".join(
        f"  - class_name: {cls}\n    config: {{}}\n    tool_schema:{SCHEMA.format(name=n)}"
        for cls, n in tools)
    p = tmp_path / name
    p.write_text(body)
    return str(p)


@pytest.fixture(scope="module")
def user_file(tmp_path_factory):
    p = tmp_path_factory.mktemp("tools") / "my_tools.py"
    p.write_text(USER_TOOLS)
    return str(p)


@pytest.fixture(scope="module")
def host(user_file, tmp_path_factory):
    path = _yaml(tmp_path_factory.mktemp("cfg"), [
        (f"{user_file}:Echo", "echo"), (f"{user_file}:Raises", "raises"),
        (f"{user_file}:WrongType", "wrong_type"), (f"{user_file}:Hangs", "hangs")])
    with ToolHost(load_tool_config(path), timeout_s=5.0) as h:
        yield h


# ---------------------------------------------------------------- hermes
def test_hermes_calls_are_parsed_in_order_and_bad_ones_are_named():
    text = ('I will compute. <tool_call>\n{"name": "calculator", "arguments": {"expression": '
            '"12*7"}}\n</tool_call> and <tool_call>{"name": "echo", "arguments": "{\\"x\\": 3}"}'
            '</tool_call><tool_call>{"name": "echo", "arguments": {"x": 1</tool_call>'
            '<tool_call>["echo"]</tool_call><tool_call>{"name": "echo", "arguments": [1]}'
            '</tool_call>')
    calls = parse_hermes(text)
    assert calls[:2] == [ToolCall("calculator", {"expression": "12*7"}), ToolCall("echo", {"x": 3})]
    assert [type(c) for c in calls[2:]] == [BadToolCall] * 3
    assert "not valid JSON" in calls[2].error and '{"name"' in calls[3].error
    assert "must be a JSON object" in calls[4].error
    assert parse_hermes("no call here, just 84") == []


# ---------------------------------------------------------------- the YAML
def test_a_verl_tool_yaml_loads(tmp_path, user_file):
    [e] = load_tool_config(_yaml(tmp_path, [(f"{user_file}:Echo", "echo")]))
    assert (e.name, e.class_name, e.config) == ("echo", f"{user_file}:Echo", {})
    assert e.schema["function"]["parameters"]["required"] == ["x"]


@pytest.mark.parametrize("body,match", [
    ("nope: []", r"top-level 'tools' list"),
    ("tools: [3]", r"tools\[0\]: expected a mapping"),
    ("tools:\n  - config: {}", r"tools\[0\]: class_name must name"),
    ("tools:\n  - class_name: a.B\n    tool_schema: {type: object}", r"OpenAI function schema"),
    ("tools:\n  - class_name: a.B\n    tool_schema: {type: function, function: {name: 'a b'}}",
     r"name='a b' must be a name"),
    ("tools:\n  - class_name: a.B\n    tool_schema:\n      type: function\n      function:\n"
     "        name: f\n        parameters: {type: object, properties: {x: {type: 3}}}",
     r"not a valid JSON schema"),
    ("tools: [", r"not valid YAML"),
])
def test_a_bad_tool_yaml_is_named_with_the_fix(tmp_path, body, match):
    p = tmp_path / "t.yaml"
    p.write_text(body)
    with pytest.raises(ToolConfigError, match=match) as e:
        load_tool_config(str(p))
    assert str(p) in str(e.value)


def test_two_tools_of_one_name_and_a_missing_file_are_refused(tmp_path, user_file):
    with pytest.raises(ToolConfigError, match=r"tools\[1\]: a second tool named 'echo'"):
        load_tool_config(_yaml(tmp_path, [(f"{user_file}:Echo", "echo")] * 2))
    with pytest.raises(ToolConfigError, match="cannot be read"):
        load_tool_config(str(tmp_path / "absent.yaml"))


# ---------------------------------------------------------------- the host
def test_a_users_tool_class_runs_in_the_host_with_its_state(host):
    assert host._proc.pid != __import__("os").getpid()  # never in this process
    [c] = host.run([Request("create", "echo", "row-1", {"ground_truth": "7"})])
    assert c.status == "ok"
    [r] = host.run([Request("execute", "echo", "row-1", {"parameters": {"x": 3}})])
    assert (r.status, r.text, r.reward) == ("ok", "echo: x=3 gt=7", 0.5)
    assert r.observation() == "echo: x=3 gt=7"
    [w] = host.run([Request("calc_reward", "echo", "row-1")])
    assert w.reward == 1.0
    assert host.run([Request("release", "echo", "row-1")])[0].status == "ok"


@pytest.mark.parametrize("name,params,match", [
    ("raises", {"x": 1}, r"raises: RuntimeError: the sandbox is down"),
    ("wrong_type", {"x": 1}, r"wrong_type: execute returned int, not \(response, reward"),
    ("echo", {"x": "three"}, r"echo: bad arguments: 'three' is not of type 'integer'"),
    ("echo", {}, r"echo: bad arguments: 'x' is a required property"),
    ("nope", {"x": 1}, r"unknown tool 'nope'; the tools are \['echo', 'hangs', 'raises'"),
])
def test_each_bad_call_is_an_error_the_model_reads(host, name, params, match):
    host.run([Request("create", "echo", "row-2", {"ground_truth": "1"})])
    [r] = host.run([Request("execute", name, "row-2", {"parameters": params})])
    assert r.status == "error" and r.observation().startswith("Error: ")
    assert __import__("re").search(match, r.error), r.error


def test_calls_of_a_batch_run_concurrently(user_file, tmp_path):
    """Four calls that each wait 1 s answer in about 1 s, not 4: a batch's tool latency is its
    longest call (the host serves them on one event loop)."""
    path = tmp_path / "slow.yaml"
    path.write_text(f"tools:\n  - class_name: {user_file}:Echo\n    config: {{sleep: 1.0}}\n"
                    f"    tool_schema:{SCHEMA.format(name='slow')}")
    with ToolHost(load_tool_config(str(path)), timeout_s=30.0) as h:
        h.run([Request("create", "slow", f"r{i}") for i in range(4)])
        t0 = time.monotonic()
        res = h.run([Request("execute", "slow", f"r{i}", {"parameters": {"x": i}})
                     for i in range(4)])
        took = time.monotonic() - t0
    assert [r.text for r in res] == [f"slow: x={i} gt=None" for i in range(4)]
    assert all(0.9 <= r.latency_s for r in res) and took < 3.0, took  # 4 s if sequential


def test_a_hanging_tool_times_out_and_the_host_is_replaced(host):
    before = host.restarts
    pid = host._proc.pid
    t0 = time.monotonic()
    [r] = host.run([Request("execute", "hangs", "row-3", {"parameters": {"x": 1}})])
    assert r.status == "timeout" and time.monotonic() - t0 < host.timeout_s + 5
    assert "tool_timeout_s=5s" in r.observation()
    assert host.restarts == before + 1
    # the next call gets a new host; the state of the old one is gone, and the error says which
    [c] = host.run([Request("execute", "echo", "row-1", {"parameters": {"x": 2}})])
    assert host._proc.pid != pid
    assert c.status == "error" and "KeyError" in c.error


def test_a_class_that_cannot_be_imported_or_built_is_refused_at_start(tmp_path, user_file):
    broken = tmp_path / "broken.py"
    broken.write_text("raise ImportError('no sandbox client installed')\n")
    with pytest.raises(ToolConfigError, match=r"broken.py.*raised ImportError: no sandbox"):
        ToolHost(load_tool_config(_yaml(tmp_path, [(f"{broken}:Tool", "t")]))).start()
    bad_init = tmp_path / "bad_init.py"
    bad_init.write_text("class Tool:\n    def __init__(self, config, schema):\n"
                        "        raise ValueError('needs config.url')\n"
                        "    create = execute = release = None\n")
    with pytest.raises(ToolConfigError, match=r"lacks verl's BaseTool methods"):
        ToolHost(load_tool_config(_yaml(tmp_path, [(f"{bad_init}:Tool", "t")], "b.yaml"))).start()
    bad_init.write_text("class Tool:\n    def __init__(self, config, schema):\n"
                        "        raise ValueError('needs config.url')\n"
                        "    async def create(self, i): pass\n"
                        "    async def execute(self, i, p): pass\n"
                        "    async def release(self, i): pass\n")
    with pytest.raises(ToolConfigError, match=r"bad_init.py:Tool' \(tool 't'\): building it "
                                              r"raised ValueError: needs config.url"):
        ToolHost(load_tool_config(_yaml(tmp_path, [(f"{bad_init}:Tool", "t")], "c.yaml"))).start()
    with pytest.raises(ToolConfigError, match=r"importing module 'no_such_pkg'"):
        ToolHost(load_tool_config(_yaml(tmp_path, [("no_such_pkg.Tool", "t")], "d.yaml"))).start()


# ---------------------------------------------------------------- the calculator
@pytest.mark.parametrize("expr,value", [("1234 * 5678", "7006652"), ("(1 + 2) / 3", "1"),
                                        ("7/2", "7/2"), ("-3 - -4", "1"), ("0.1 + 0.2", "3/10"),
                                        ("99999 * 99999 * 99999", str(99999 ** 3))])
def test_the_calculator_is_exact(expr, value):
    assert CalculatorTool.render(CalculatorTool.evaluate(expr)) == value


@pytest.mark.parametrize("expr,match", [
    ("__import__('os').system('true')", "only numbers"), ("2 ** 10", "only numbers"),
    ("x + 1", "only numbers"), ("1 / 0", "division by zero"), ("1 +", "cannot parse"),
    ("9" * 30 + " * " + "9" * 30, "more than 40 digits"), ("1+" * 150 + "1", "longer than 200"),
    ("", "give an expression"),
])
def test_the_calculator_refuses_what_is_not_arithmetic(expr, match):
    with pytest.raises(ValueError, match=match):
        CalculatorTool.evaluate(expr)


def test_the_calculator_runs_in_the_host_by_its_dotted_name(tmp_path):
    import yaml

    path = tmp_path / "calc.yaml"
    path.write_text(yaml.safe_dump({"tools": [{
        "class_name": "verl_core.agent.tools.CalculatorTool", "config": {},
        "tool_schema": CalculatorTool.SCHEMA}]}))
    with ToolHost(load_tool_config(str(path))) as h:
        ok, bad = h.run([Request("execute", "calculator", "r", {"parameters": {"expression": e}})
                         for e in ("(1234 + 56) * 7", "1/0")])
    assert (ok.status, ok.text) == ("ok", "9030")
    assert (bad.status, bad.text) == ("ok", "error: division by zero")  # the tool's own answer
    assert Fraction(9030) == CalculatorTool.evaluate("(1234 + 56) * 7")


# ---------------------------------------------------------------- issue 40: tools that misbehave
# each tool breaks one rule of the contract; the rows of the well-behaved tools must go on
BAD_TOOLS = textwrap.dedent('''
    import math, os, signal, threading

    class Dies(Base):
        async def execute(self, instance_id, parameters, **kwargs):
            if self.config["how"] == "exit":
                os._exit(3)
            os.kill(os.getpid(), signal.SIGSEGV)

    class Surrogate(Base):
        async def execute(self, instance_id, parameters, **kwargs):
            return "caf\\udcff bytes", 0.0, {}   # what surrogateescape leaves of bad bytes

    class NotFinite(Base):
        async def execute(self, instance_id, parameters, **kwargs):
            return "fine", math.nan, {}

        async def calc_reward(self, instance_id, **kwargs):
            return math.inf

    class Unpicklable(Base):
        async def execute(self, instance_id, parameters, **kwargs):
            return "fine", 0.0, {"lock": threading.Lock()}

    import sys, types
    if "host_only" not in sys.modules:  # a module only the host can import (once per host)
        sys.modules["host_only"] = types.ModuleType("host_only")
        exec("class HostOnly: pass", sys.modules["host_only"].__dict__)
    host_only = sys.modules["host_only"]

    class Unreadable(Base):
        async def execute(self, instance_id, parameters, **kwargs):
            return "fine", 0.0, {"obj": host_only.HostOnly()}  # pickled there, not read here

    class Huge(Base):
        async def execute(self, instance_id, parameters, **kwargs):
            return "0123456789 " * (50_000_000 // 11), 0.0, {}  # 50 MB
''')


@pytest.fixture(scope="module")
def bad_host(tmp_path_factory):
    d = tmp_path_factory.mktemp("bad")
    (d / "bad_tools.py").write_text(USER_TOOLS + BAD_TOOLS)
    f = d / "bad_tools.py"
    body = "tools:\n" + "".join(
        f"  - class_name: {f}:{cls}\n    config: {cfg}\n    tool_schema:{SCHEMA.format(name=n)}"
        for cls, n, cfg in [("Echo", "echo", "{}"), ("Hangs", "hangs", "{}"),
                            ("Dies", "exits", "{how: exit}"), ("Dies", "segv", "{how: segv}"),
                            ("Surrogate", "surrogate", "{}"), ("NotFinite", "nan", "{}"),
                            ("Unpicklable", "unpicklable", "{}"),
                            ("Unreadable", "unreadable", "{}"), ("Huge", "huge", "{}")])
    (d / "bad.yaml").write_text(body)
    with ToolHost(load_tool_config(str(d / "bad.yaml")), timeout_s=5.0) as h:
        yield h


def _bad_among_good(h, bad: str, good: int = 15):
    """``good`` echo rows (each created with its own ground truth) and one call of ``bad``,
    sent first (as a batch of one rollout turn): the results, the host's restarts, seconds."""
    h.run([Request("create", "echo", f"g{i}", {"ground_truth": str(i)}) for i in range(good)])
    restarts, t0 = h.restarts, time.monotonic()
    res = h.run([Request("execute", bad, "b", {"parameters": {"x": 1}})] +
                [Request("execute", "echo", f"g{i}", {"parameters": {"x": i}})
                 for i in range(good)])
    took = time.monotonic() - t0
    h.run([Request("release", "echo", f"g{i}") for i in range(good)])
    return res, h.restarts - restarts, took


@pytest.mark.parametrize("tool,how", [("exits", "exit code 3"), ("segv", "killed by SIGSEGV")])
def test_a_host_that_dies_mid_call_fails_that_call_and_the_other_rows_go_on(bad_host, tool, how):
    res, restarts, took = _bad_among_good(bad_host, tool)
    assert res[0].status == "error", res[0]
    assert f"{tool}: the tool host died ({how}) during this call (instance 'b')" in res[0].error
    # the others were served again on the new host, their instances created again there
    assert [(r.status, r.text) for r in res[1:]] == [("ok", f"echo: x={i} gt={i}")
                                                     for i in range(15)]
    assert restarts == 1 and took < bad_host.timeout_s  # found at once, not by the deadline
    [r] = bad_host.run([Request("execute", "echo", "g0", {"parameters": {"x": 0}})])
    assert r.status == "error" and "KeyError" in r.error  # g0 was released: no instance


def test_a_hanging_call_times_out_alone_and_the_calls_it_held_up_succeed(bad_host):
    res, restarts, took = _bad_among_good(bad_host, "hangs")
    # the hanging call blocks the host's event loop, so the others never ran on that host
    assert res[0].status == "timeout" and "tool_timeout_s=5s" in res[0].observation()
    assert [(r.status, r.text) for r in res[1:]] == [("ok", f"echo: x={i} gt={i}")
                                                     for i in range(15)]
    assert restarts == 1 and took < 2 * bad_host.timeout_s  # one deadline, then the others


@pytest.mark.parametrize("tool,match", [
    ("nan", r"nan: execute's reward is nan; a reward must be a finite number"),
    ("unpicklable", r"unpicklable: its answer cannot be sent to the trainer \(TypeError: "
                    r"cannot pickle '_thread.lock' object\)"),
    ("unreadable", r"unreadable: its answer cannot be read in the trainer"),
])
def test_a_non_finite_reward_or_an_answer_that_cannot_cross_is_an_error_at_once(bad_host, tool,
                                                                             match):
    restarts, t0 = bad_host.restarts, time.monotonic()
    [r] = bad_host.run([Request("execute", tool, "n", {"parameters": {"x": 1}})])
    assert r.status == "error" and r.reward == 0.0 and __import__("re").search(match, r.error), r
    assert time.monotonic() - t0 < 2.0 and bad_host.restarts == restarts  # no deadline, no restart
    [c] = bad_host.run([Request("calc_reward", "nan", "n")])
    assert c.status == "error" and "calc_reward's reward is inf" in c.error


def test_an_answer_with_lone_surrogates_is_made_valid_text(bad_host):
    from tests.standins import qwen_tokenizer
    from verl_core.agent.turns import truncate_observation

    [r] = bad_host.run([Request("execute", "surrogate", "s", {"parameters": {"x": 1}})])
    assert r.text == "caf\udcff bytes"  # as the tool returned it
    tok = qwen_tokenizer()
    text = truncate_observation(r.observation(), tok, 64)  # the tokenizer refused it before
    assert text == "caf\ufffd bytes" and text.encode("utf-8")


# the trainer's side of a 50 MB answer, in a process of its own (its peak RSS is its own)
HUGE = """
import json, resource, sys
from tests.standins import qwen_tokenizer
from verl_core.agent.tools import Request, ToolHost, load_tool_config
from verl_core.agent.turns import response_char_bound, truncate_observation

def peak_mb():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024

tok, N = qwen_tokenizer(), 256
with ToolHost(load_tool_config(sys.argv[1]), timeout_s=120) as h:
    def call(tool):  # as rollout/multi_turn.py runs a call and cuts what the model reads
        [r] = h.run([Request("execute", tool, "r", {"parameters": {"x": 1}})],
                    max_chars=response_char_bound(N))
        return r, truncate_observation(r.observation(), tok, N)
    call("echo")  # the same path once, small, so what follows measures the answer alone
    before = peak_mb()
    r, seen = call("huge")
    host_side = peak_mb() - before
    big = "0123456789 " * (50_000_000 // 11)  # and the trainer's cut alone, given 50 MB
    before = peak_mb()
    alone = truncate_observation(big, tok, N)
    trainer_side = peak_mb() - before
print(json.dumps({"status": r.status, "sent": len(r.text), "ids": len(tok(seen.replace(
    "...(truncated)", ""), add_special_tokens=False)["input_ids"]), "tail": seen[-14:],
    "same": alone == seen, "host_side_mb": host_side, "trainer_side_mb": trainer_side}))
"""


def test_a_50_mb_answer_is_cut_before_it_crosses_the_pipe_or_is_tokenised(bad_host, tmp_path):
    import json
    import os
    import subprocess
    import sys

    (tmp_path / "huge.py").write_text(HUGE)
    cfg = bad_host.entries  # the same tools, in a host of the subprocess
    import yaml
    (tmp_path / "t.yaml").write_text(yaml.safe_dump({"tools": [
        {"class_name": e.class_name, "config": e.config, "tool_schema": e.schema}
        for e in cfg if e.name in ("echo", "huge")]}))
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    # a cap far above what the cut needs; tokenising the 50 MB whole took 18 GB
    limit = "import resource; resource.setrlimit(resource.RLIMIT_AS, (8 << 30, 8 << 30)); "
    t0 = time.monotonic()
    done = subprocess.run([sys.executable, "-c", limit + f"exec(open({str(tmp_path / 'huge.py')!r})"
                           ".read())", str(tmp_path / "t.yaml")], cwd=repo, capture_output=True,
                          text=True, timeout=300, env={**os.environ, "PYTHONPATH": repo})
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got["status"] == "ok" and got["same"] and got["tail"] == "...(truncated)"
    assert got["ids"] <= 256
    # the host sends the first and last 256 x 32 characters: 16 KB, not 50 MB; the trainer
    # tokenises 8 KB of them. Either side's growth is noise next to the answer (50 MB; its
    # pickle and its ids would be 100s of MB): 5 MB is 1/10 of the answer
    assert got["sent"] == 2 * 256 * 32
    assert got["host_side_mb"] < 5 and got["trainer_side_mb"] < 5, got
    assert time.monotonic() - t0 < 120


def test_a_call_with_an_escaped_lone_surrogate_is_parsed_as_valid_text():
    # a model can write "\udcff" in a call's JSON: it must not reach the tokenizer or the batch
    (call,) = parse_hermes('<tool_call>{"name": "calc\\udcff", "arguments": '
                           '"{\\"expr\\": \\"1+\\\\udcff\\"}"}</tool_call>')
    assert call.name == "calc\ufffd" and call.arguments == {"expr": "1+\ufffd"}
    json.dumps(call.arguments, ensure_ascii=False).encode("utf-8")  # encodable
