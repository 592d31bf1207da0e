"""Every command in the fenced ``bash``/``sh`` blocks of README.md and docs/*.md, taken as its front
door takes it, so a doc command with a wrong option, an unknown config key or a value the config
refuses fails here and not in a newcomer's shell (issue 38).

How a block is read: ``\\`` continuations joined, ``&&``/``;``/``|`` split, ``#`` comments dropped,
``NAME=value`` lines kept as shell variables for the rest of the page (docs/models.md's ``$D``),
a leading ``NAME=value`` of a command as its environment. Then, by program (with or without the
``.venv/bin/`` prefix, which every python/pyflyte/ray/tensorboard command must carry: the README
never activates the venv):

- ``python -m verl_core.train …``: parsed by the plain loop's own parser
  (``build_parser().parse_intermixed_args``) and built into its validated config as its ``main()``
  does (``verl_keys.parse_cli``, ``entry_options``, ``run_config``), then the permanent checks
  that run before any work (``validation.check_run_inputs``: model folder, data files, batch
  against rows, ``VERL_FAULTS``);
- ``pyflyte run workflows/<file>.py <entity> …``: every option must be an input of that workflow
  or launch plan and convert to its type; the config inputs are built as the workflow's
  ``configure`` task builds them (``tasks.prepare.build_config``) and checked the same way;
- ``python -m verl_core.checkpoint …``: parsed by its ``parser()``;
- ``python -c CODE``: compiled, its imported names resolved; docs/models.md's stand-in builder is
  run (the commands after it use its files);
- anything else (helm, kubectl, docker, ``pyflyte register``, a Ray head, the viewers): must be
  listed in ``NOT_RUN`` with the reason it is not run here, or the test fails.

Folders and files a user brings (``/models/…``, ``/tmp/byom/…`` and the relative ``gsm8k/…``)
get stand-ins in a temporary folder, which is also the current folder: Qwen- and Llama-style
model folders from tests/standins.py by name, GSM8K-style parquet in verl's row layout.

Then the README's plain-loop commands that need no such files RUN, shrunk, each in a subprocess
from a temporary folder: "shrunk" means ``--steps 1`` and tests/presets.py's ``TINY`` sizes
appended as ``--set key=value`` (the command's own setting of a ``TINY`` key, ours or verl's, is
dropped so the tiny sizes win), ``--store`` a temporary store and a ``--run-name`` per command,
and one ``VERL_ASSET_CACHE`` for the module so the warm start runs once and is reused. Each must
exit 0 and print its ``step 1/1`` line (marked ``slow``: 10-20 s each). The validated-only
commands say why they are not run (``not_run_reason``). The whole file takes well under two
minutes on a 2-core machine.
"""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import datetime
import importlib
import io
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from tests.presets import TINY

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SHELLS = {"bash", "sh", "shell"}
VENV_PROGRAMS = {"python", "python3", "pyflyte", "ray", "tensorboard"}
"""Programs `bash .ci/install` puts in the venv: a doc command names them by their venv path."""
USER_ROOTS = ("/models/", "/tmp/byom/")
"""Absolute folders the docs' commands take from the user; mapped into the stand-in folder."""
NOT_RUN = {
    "bash": "the install and CI scripts themselves (.ci/*): CI runs them; here the script must exist",
    "ray": "starts a Ray head node that outlives the command",
    "tensorboard": "a viewer: serves until stopped",
    "mlflow": "a viewer from the full mlflow package, installed wherever you browse",
    "helm": "deploys onto a Kubernetes cluster",
    "kubectl": "deploys onto a Kubernetes cluster",
    "flytectl": "talks to a Flyte cluster",
    "docker": "builds and pushes images",
}
"""Programs the test does not run or validate beyond their name, and why."""


# ---------------------------------------------------------------- reading the blocks
@dataclasses.dataclass
class Command:
    doc: str  # README.md, docs/models.md
    line: int  # the line its first word is on
    text: str  # as written, continuations joined
    words: list[str]  # after the page's variables, its environment prefix removed
    env: dict[str, str]

    @property
    def id(self) -> str:
        return f"{self.doc}:{self.line}"

    @property
    def program(self) -> str:
        return os.path.basename(self.words[0])


def shell_blocks(text: str) -> list[tuple[int, str]]:
    """``(line of the block's first line, its text dedented)`` for each fenced bash/sh block;
    fences may be indented (a block inside a list item)."""
    out, lines, i = [], text.splitlines(), 0
    while i < len(lines):
        m = re.match(r"^([ \t]*)```([\w-]*)\s*$", lines[i])
        i += 1
        if not m:
            continue
        body, start = [], i + 1
        while i < len(lines) and not re.match(r"^\s*```\s*$", lines[i]):
            body.append(lines[i][len(m.group(1)):] if lines[i].startswith(m.group(1)) else lines[i])
            i += 1
        i += 1
        if m.group(2) in SHELLS:
            out.append((start, "\n".join(body) + "\n"))
    return out


def split_commands(block: str) -> list[tuple[int, str]]:
    """``(line offset, command text)`` of each command of a shell block: ``\\``-newline joined,
    split at unquoted newlines, ``;``, ``&&``, ``||`` and ``|``, ``#`` comments dropped. Quotes
    may span lines (a JSON ``--overrides`` written over two)."""
    out: list[tuple[int, str]] = []
    cur, quote, line, start, i = [], None, 0, 0, 0

    def end():
        text = "".join(cur).strip()
        if text:
            out.append((start, text))
        cur.clear()

    while i < len(block):
        c = block[i]
        if not quote and not c.isspace() and not "".join(cur).strip():
            start = line  # a command's first character
        if quote:
            cur.append(c)
            if c == "\\" and quote == '"':
                cur.append(block[i + 1])
                i += 1
            elif c == quote:
                quote = None
        elif c == "\\" and block[i + 1:i + 2] == "\n":
            cur.append(" ")
            line += 1
            i += 2
            continue
        elif c in "'\"":
            quote = c
            cur.append(c)
        elif c == "#" and (not cur or cur[-1] in " \t"):
            while i < len(block) and block[i] != "\n":
                i += 1
            continue
        elif c in "\n;|&":
            if c == "&" and block[i + 1:i + 2] != "&":
                raise ValueError(f"line {line}: a background '&' is not read here")
            end()
            i += 2 if block[i:i + 2] in ("&&", "||") else 1
            line += c == "\n"
            continue
        else:
            cur.append(c)
        line += c == "\n"
        i += 1
    end()
    return out


ASSIGNMENT = re.compile(r"^[A-Za-z_]\w*=")


def expand(text: str, variables: dict[str, str]) -> str:
    """``$NAME`` / ``${NAME}`` of the page's variables, outside single quotes (unknown names are
    left as they are)."""
    parts = re.split(r"('[^']*')", text)
    sub = re.compile(r"\$\{(\w+)\}|\$(\w+)")
    return "".join(p if p.startswith("'") else
                   sub.sub(lambda m: variables.get(m.group(1) or m.group(2), m.group(0)), p)
                   for p in parts)


def doc_commands(path: Path) -> list[Command]:
    """The commands of every shell block of ``path``, in order; variable assignments (bare or
    ``export``) are the page's variables, not commands."""
    variables: dict[str, str] = {}
    out = []
    for start, block in shell_blocks(path.read_text()):
        for offset, text in split_commands(block):
            words = shlex.split(expand(text, variables))
            env = {}
            if words[0] == "export":
                words = words[1:]
            while words and ASSIGNMENT.match(words[0]):
                name, _, value = words.pop(0).partition("=")
                env[name] = value
            if not words:
                variables.update(env)
                continue
            out.append(Command(str(path.relative_to(ROOT)), start + offset, text, words, env))
    return out


COMMANDS = [c for doc in DOCS for c in doc_commands(doc)]


# ---------------------------------------------------------------- what each command is
def after_python(words: list[str]) -> tuple[str, list[str]]:
    """``("-m verl_core.train", rest)`` / ``("-c", [code])`` / ``("script.py", rest)`` of a
    python command's words."""
    w = words[1:]
    if w[:1] == ["-m"]:
        return f"-m {w[1]}", w[2:]
    if w[:1] == ["-c"]:
        return "-c", w[1:]
    return w[0], w[1:]


def kind(cmd: Command) -> str:
    """train, checkpoint, verl_core (``python -m verl_core <command>``), python-c, pyflyte-run,
    pyflyte-register, a NOT_RUN program, or unknown."""
    prog = cmd.program
    if prog in ("python", "python3"):
        what, _ = after_python(cmd.words)
        return {"-m verl_core.train": "train", "-m verl_core.checkpoint": "checkpoint",
                "-m verl_core.models": "models", "-m verl_core": "verl_core",
                "-c": "python-c"}.get(what, "unknown")
    if prog == "pyflyte":
        sub = next((w for w in cmd.words[1:] if w in ("run", "register")), "unknown")
        return f"pyflyte-{sub}"
    return prog if prog in NOT_RUN else "unknown"


def pyflyte_run_parts(words: list[str]) -> tuple[list[str], str, str, list[str]]:
    """``(pyflyte's own options, script, entity, the entity's options)`` of a pyflyte run's
    words."""
    w = words[1:]
    k = next(i for i, x in enumerate(w) if x.endswith(".py"))
    return w[:k], w[k], w[k + 1], w[k + 2:]


def needs_standins(cmd: Command) -> bool:
    return any(r in w for w in cmd.words for r in USER_ROOTS) or any(
        re.search(r"(^|[=,])gsm8k/", w) for w in cmd.words)


def not_run_reason(cmd: Command) -> str | None:
    """Why a command is validated only (None: the test runs it)."""
    k = kind(cmd)
    if k in NOT_RUN:
        return NOT_RUN[k]
    if k == "pyflyte-register":
        return "registers on a Flyte cluster"
    if k == "pyflyte-run":
        if "--remote" in pyflyte_run_parts(cmd.words)[0]:
            return "--remote: launches on a Flyte cluster"
        return "the workflow's end-to-end runs are tests/workflows' (minutes each)"
    if k == "checkpoint":
        return "needs a finished run's store (tests/verl_core/checkpoint run these commands)"
    if k == "models":
        return "downloads 93 MB and converts (tests/verl_core/models/test_fetch.py runs it)"
    if k == "verl_core":
        return "the health probe reports on this machine's state (tests/verl_core/test_health.py)"
    if k == "python-c":
        return None if "tests.standins" in cmd.words[-1] else "compiled and its names resolved only"
    if k == "train":
        if cmd.words[0].startswith(".venv-vllm/"):
            return "needs .venv-vllm (bash .ci/install vllm)"
        if cmd.doc != "README.md":
            return "docs/ commands are validated; the README's plain-loop commands run"
        if needs_standins(cmd):
            return "needs your model and data: validated on stand-ins"
        return None
    return "unknown command"


# ---------------------------------------------------------------- stand-ins and validation
def remap(text: str, root: Path) -> str:
    """A user's absolute folders (USER_ROOTS) moved under the stand-in folder ``root``."""
    for r in USER_ROOTS:
        text = re.sub(r"(^|[=,'\"\s])" + re.escape(r), lambda m: m.group(1) + f"{root}{r}", text)
    return text


def build_data_standins(words: list[str], root: Path) -> None:
    """GSM8K-style rows in verl's layout for every missing ``*.parquet`` a command names under
    ``root`` (the current folder): 128 training rows (a batch of 64 fits), 32 held-out."""
    from tests.standins import gsm8k_parquet

    for w in words:
        for part in [w, w.partition("=")[2]]:
            for p in part.split(","):
                path = (root / p).resolve()  # an absolute p stays itself
                if p.endswith(".parquet") and root in path.parents and not path.exists():
                    test = "test" in path.name
                    gsm8k_parquet(path, 32 if test else 128, split="test" if test else "train",
                                  seed=int(test))


STANDIN_POSITIONS = {"qwen": 32768, "llama": 131072, "smollm2": 8192}
"""The real families' ``max_position_embeddings`` (Qwen2.5-0.5B-Instruct, Llama-3.1-8B-Instruct,
SmolLM2-135M-Instruct: a Llama with a ChatML template, so the Qwen-style stand-in),
written into a stand-in the docs name as the real model, so verl's default 512 + 512 tokens fit as
they do there (tests/standins.py's folders have 512 positions)."""


def build_model_standins(cfg, root: Path) -> None:
    """The stand-in of a model folder the config names under ``root`` and that is missing: a
    Qwen2.5- or Llama-3.1-style folder (tests/standins.py) by its name."""
    import json

    from tests.standins import llama3_folder, qwen_folder

    for path in (cfg.model.path, cfg.reward_model.path if cfg.reward_model.enable else ""):
        path = Path(path)
        if not str(path) or root not in path.parents or path.exists():
            continue
        family = next((k for k in STANDIN_POSITIONS if k in path.name.lower()), None)
        assert family, (f"{path.name}: no stand-in for this model folder (name it Qwen*, Llama* "
                        "or SmolLM2*)")
        {"qwen": qwen_folder, "llama": llama3_folder, "smollm2": qwen_folder}[family](path)
        config = json.loads((path / "config.json").read_text())
        config["max_position_embeddings"] = STANDIN_POSITIONS[family]
        (path / "config.json").write_text(json.dumps(config, indent=2))


def parsed(parse, argv: list[str]):
    """``parse(argv)``, with an argparse refusal (its stderr) as the assertion's message."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            return parse(argv)
        except SystemExit:  # argparse's usage, then its one-line error: the error is enough
            error = err.getvalue().strip().splitlines()[-1:] or ["(no message)"]
            raise AssertionError(f"refused by its parser: {error[0]}") from None


def plain_loop_config(argv: list[str]):
    """The config ``python -m verl_core.train ARGV`` would train, built as its ``main()`` does."""
    from verl_core import train, verl_keys
    from verl_core.config import ConfigError
    from verl_core.prepare import run_store_uri

    p = train.build_parser()
    args = parsed(p.parse_intermixed_args, argv)
    given = {}
    for item in args.set:
        key, sep, value = item.partition("=")
        assert sep, f"--set {item!r}: expected KEY=VALUE"
        given[key] = train._parse_value(value)
    assert not (args.workdir and (args.store or args.run_name != "default")), \
        "--workdir and --store/--run-name together"
    options = verl_keys.entry_options(steps=args.steps, model=args.model,
                                      train_files=args.train_files, val_files=args.val_files)
    given = {**verl_keys.parse_cli(args.overrides), **given}
    workdir = train._workdir(args.workdir, given.pop(train.LOCAL_DIR, None))
    cfg = verl_keys.run_config(args.algorithm, args.verl_config, given, options)
    if workdir:
        train._run_store(workdir)
    else:
        run_store_uri(args.store, args.run_name)
    if cfg.trainer.world_size > 1:  # train()'s first refusal: the plain loop is one process
        raise ConfigError(f"trainer world size {cfg.trainer.world_size}: not the plain loop's")
    return cfg


def _typed(tp, value: str, option: str):
    try:
        if tp is datetime.datetime:
            return datetime.datetime.fromisoformat(value)
        return tp(value)
    except (TypeError, ValueError) as e:
        raise AssertionError(f"{option} {value!r}: not a {tp.__name__} ({e})") from None


def workflow_config(script: str, entity: str, argv: list[str]):
    """The inputs ``pyflyte run SCRIPT ENTITY ARGV`` gives, checked against the entity's
    interface; the config its ``configure`` would build when it takes the config inputs."""
    import inspect

    from flytekit import LaunchPlan

    from tasks.prepare import build_config
    from verl_core.prepare import run_store_uri

    module = importlib.import_module(script.removesuffix(".py").replace("/", "."))
    assert hasattr(module, entity), f"{script} has no workflow or launch plan {entity!r}"
    obj = getattr(module, entity)
    inputs = obj.python_interface.inputs
    values = dict(obj.python_interface.default_inputs_as_kwargs)
    if isinstance(obj, LaunchPlan):
        values.update(obj.saved_inputs)
    i = 0
    while i < len(argv):
        opt, eq, value = argv[i].partition("=")
        assert opt.startswith("--"), f"{argv[i]!r}: not an option of {entity}"
        name = opt[2:].replace("-", "_")
        assert name in inputs, (f"{opt}: not an input of {entity} (its inputs: "
                                f"{', '.join('--' + n.replace('_', '-') for n in inputs)})")
        if not eq:
            assert i + 1 < len(argv), f"{opt}: no value"
            value = argv[i + 1]
        values[name] = _typed(inputs[name], value, opt)
        i += 1 if eq else 2
    if "run_name" in values:
        run_store_uri(values.get("store", ""), values["run_name"])
    if not {"algorithm", "model", "overrides"} <= set(inputs):
        return None  # no run config among its inputs
    # an input the entity does not take (ppo_continue's steps) keeps the preset's: 0 / ""
    params = inspect.signature(build_config).parameters
    return build_config(**{p: values.get(p, 0 if params[p].annotation in (int, "int") else "")
                           for p in params if p != "verl_config" or p in values})


def check_python_c(code: str) -> None:
    """``code`` compiles and every ``module.name`` it uses of a module it imports exists."""
    tree = ast.parse(code)
    modules = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                modules[a.asname or a.name] = importlib.import_module(a.name)
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) \
                and node.value.id in modules:
            assert hasattr(modules[node.value.id], node.attr), \
                f"{node.value.id}.{node.attr}: no such name"


def check_inputs(cfg, root: Path) -> None:
    """The checks the run's prepare makes before any work, on stand-ins of the user's model."""
    from verl_core.validation import check_run_inputs

    build_model_standins(cfg, root)
    check_run_inputs(cfg)


def validate(cmd: Command, root: Path, monkeypatch) -> None:
    """Everything a command's front door checks before any work, on stand-ins under ``root``
    (the current folder)."""
    for name, value in cmd.env.items():
        monkeypatch.setenv(name, value)
    words = [remap(w, root) for w in cmd.words]
    k = kind(cmd)
    if k == "python-c":
        code = words[-1]
        if "tests.standins" in code:  # docs/models.md builds its stand-ins: run it
            exec(compile(code, cmd.id, "exec"), {})  # noqa: S102 - our own docs
        else:
            check_python_c(code)
        return
    if k in NOT_RUN:
        if k == "bash":
            assert (ROOT / words[1]).is_file(), f"no script {words[1]}"
        return
    if k == "pyflyte-register":
        return
    build_data_standins(words, root)
    if k == "checkpoint":
        from verl_core.checkpoint.__main__ import parser
        parsed(parser().parse_args, after_python(words)[1])
        return
    if k == "models":
        from verl_core.models.__main__ import parser as models_parser
        from verl_core.models.fetch import MODELS
        args = parsed(models_parser().parse_args, after_python(words)[1])
        assert args.cmd != "fetch" or args.name in MODELS, f"no model {args.name!r} to fetch"
        return
    if k == "verl_core":
        from verl_core.__main__ import COMMANDS as SUBCOMMANDS
        sub = after_python(words)[1]
        assert sub[0] in SUBCOMMANDS, f"python -m verl_core {sub[0]}: not one of {SUBCOMMANDS}"
        if sub[0] == "train":
            check_inputs(plain_loop_config(sub[1:]), root)
        return
    if k == "train":
        cfg = plain_loop_config(after_python(words)[1])
    elif k == "pyflyte-run":
        cfg = workflow_config(*pyflyte_run_parts(words)[1:])
    else:
        raise AssertionError(f"{cmd.id}: {cmd.text!r}: an unknown command; check it here or "
                             "list its program in NOT_RUN with the reason")
    if cfg is not None:
        check_inputs(cfg, root)


@pytest.fixture(scope="module")
def standin_root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("doc-commands").resolve()


# ---------------------------------------------------------------- the tests
def test_reading_a_block():
    block = ("# a comment\nA=1; B=\"--set x=2 --set y=3\"\n"
             "python -m m --o '{\"k\": 1,\n  \"j\": \"#no\"}' \\\n  $B   # trailing\n"
             "bash a && X=$A pyflyte run w.py e | tail\n")
    cmds = split_commands(block)
    assert [c for _, c in cmds] == [
        "A=1", 'B="--set x=2 --set y=3"',
        'python -m m --o \'{"k": 1,\n  "j": "#no"}\'    $B', "bash a", "X=$A pyflyte run w.py e",
        "tail"]
    assert [o for o, _ in cmds] == [1, 1, 2, 5, 5, 5]
    assert shlex.split(expand(cmds[2][1], {"B": "--set x=2 --set y=3"}))[-4:] == \
        ["--set", "x=2", "--set", "y=3"]
    assert expand("'$B' $B", {"B": "b"}) == "'$B' b"


def test_the_docs_have_commands():
    kinds = {kind(c) for c in COMMANDS}
    assert {"train", "pyflyte-run", "checkpoint", "python-c"} <= kinds, kinds
    assert [c for c in COMMANDS if c.doc == "README.md" and not_run_reason(c) is None]


@pytest.mark.parametrize("cmd", COMMANDS, ids=lambda c: c.id)
def test_doc_command_is_valid(cmd, standin_root, monkeypatch):
    assert kind(cmd) != "unknown", (
        f"{cmd.text!r}: a command this test does not know; validate it here or list its program "
        "in NOT_RUN with the reason it is not run")
    assert not_run_reason(cmd) != "unknown command"
    if cmd.program in VENV_PROGRAMS:
        assert re.match(r"\.venv(-vllm)?/bin/", cmd.words[0]), (
            f"{cmd.text!r}: write {cmd.program} as .venv/bin/{cmd.program} (the README never "
            "activates the venv)")
    monkeypatch.chdir(standin_root)
    validate(cmd, standin_root, monkeypatch)


def test_a_wrong_option_or_key_fails(standin_root, monkeypatch):
    """The checks above catch what a doc can get wrong (mistyped option, unknown key, bad value,
    an option the workflow does not take)."""
    monkeypatch.chdir(standin_root)
    bad = ["python -m verl_core.train --stpes 5",
           "python -m verl_core.train --set optim.lrr=1e-4",
           "python -m verl_core.train actor_rollout_ref.rollout.nn=8",
           "python -m verl_core.train --set data.train_batch_size=2.5",
           "python -m verl_core.train --batch-size 8",
           "pyflyte run workflows/ppo.py ppo --overrides '{\"optim.lrr\": 1}'",
           "pyflyte run workflows/ppo.py ppo --set optim.lr=1",
           "pyflyte run workflows/ppo.py ppo --steps many",
           "pyflyte run workflows/ppo.py ppo --run-name ../x",
           "pyflyte run workflows/ppo.py ppo_nightly",
           "python -m verl_core.checkpoint export runs/default latest out --dtype fp8",
           "python -m verl_core.checkpoint list runs/default --grace-s 0",
           "python -c 'import verl_core; verl_core.healthcheck()'",
           "VERL_FAULTS='[{\"kind\": \"explode\"}]' python -m verl_core.train"]
    for text in bad:
        cmd = doc_commands_of(text)
        with pytest.raises((AssertionError, ValueError)):
            validate(cmd, standin_root, monkeypatch)
        for name in cmd.env:
            monkeypatch.delenv(name)


def doc_commands_of(text: str) -> Command:
    (_, one), = split_commands(text + "\n")
    words = shlex.split(one)
    env = {}
    while ASSIGNMENT.match(words[0]):
        name, _, value = words.pop(0).partition("=")
        env[name] = value
    return Command("test", 0, one, words, env)


def shrunk(args: list[str], store: Path, run_name: str) -> list[str]:
    """A plain-loop command's arguments at one step and TINY sizes (see the module docstring)."""
    from verl_core import train, verl_keys

    ns = parsed(train.build_parser().parse_intermixed_args, args)

    def tiny(item: str) -> bool:
        key, _, value = item.partition("=")
        key = key.lstrip("+")
        ours = verl_keys.to_ours({key: verl_keys.parse_value(value)})
        return bool(set(ours) & set(TINY))

    drop_set = {i for i in ns.set if tiny(i)}
    drop_positional = {i for i in ns.overrides if tiny(i)}
    out, i = [], 0
    while i < len(args):
        if args[i] == "--set" and args[i + 1] in drop_set:
            i += 2
            continue
        if args[i] in drop_positional or args[i].removeprefix("--set=") in drop_set:
            i += 1
            continue
        out.append(args[i])
        i += 1
    return [*out, "--steps", "1", "--store", str(store), "--run-name", run_name,
            *(a for k, v in TINY.items() for a in ("--set", f"{k}={v}"))]


README_RUNS = [c for c in COMMANDS if kind(c) == "train" and not_run_reason(c) is None]


@pytest.fixture(scope="module")
def asset_cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("asset-cache")


@pytest.mark.slow
@pytest.mark.parametrize("cmd", README_RUNS, ids=lambda c: c.id)
def test_readme_plain_loop_command_runs_shrunk(cmd, asset_cache, tmp_path):
    argv = shrunk(after_python(cmd.words)[1], tmp_path / "runs", f"doc-{cmd.line}")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "VERL_ASSET_CACHE": str(asset_cache)}
    env.pop("VERL_STORE", None)
    r = subprocess.run([sys.executable, "-m", "verl_core.train", *argv], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=300)
    out = r.stdout + r.stderr
    assert r.returncode == 0, f"{shlex.join(argv)}\n{out[-3000:]}"
    assert re.search(r"^step 1/1 ", r.stdout, re.M), out[-3000:]


def test_shrunk_drops_the_commands_own_tiny_keys(tmp_path):
    argv = shrunk(["actor_rollout_ref.rollout.n=8", "trainer.test_freq=5", "--set",
                   "rollout.n=16", "--steps", "50", "--set", "optim.lr=1e-4"], tmp_path, "r")
    assert argv[:6] == ["trainer.test_freq=5", "--steps", "50", "--set", "optim.lr=1e-4",
                        "--steps"]
    assert "rollout.n=4" in argv and "actor_rollout_ref.rollout.n=8" not in argv
