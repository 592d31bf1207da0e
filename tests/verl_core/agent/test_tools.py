"""Tools on verl's contract (verl_core/agent/tools.py): the tool YAML, hermes calls, and the host
process that runs a user's tool class (verl's BaseTool methods, verl not installed) under
deadlines, with every bad-tool case an error the model reads, never an exception here."""
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
