"""verl_core is the library layer: it must never import flytekit (docs/design.md), its imports
form no circle, and its lower layers import nothing from the layers above them.

Every import counts, module level or inside a function (a function-level import is how a circle
hides), except those under ``if TYPE_CHECKING:``, which never run."""
import ast
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2] / "verl_core"

LAYERS = {
    "verl_core.layout": set(),
    "verl_core.errors": set(),
    # a package: its modules import each other (the lease is a doc of the store it guards)
    "verl_core.store": {"verl_core.store", "verl_core.errors", "verl_core.layout"},
    "verl_core.algorithms": {"verl_core.algorithms"},
    "verl_core.config_fields": set(),
    "verl_core.seeds": set(),
    # the OpenAI-compatible endpoint runs in the trainer over the rollout engine (the tool host's
    # child never imports it); listed before its package, whose rule it would otherwise get
    "verl_core.agent.openai_server": {"verl_core.agent", "verl_core.errors", "verl_core.rollout",
                                      "verl_core.data.dataset"},
    # the agent loops run in the trainer too (their MultiTurnOutput is the rollout's)
    "verl_core.agent.loops": {"verl_core.agent", "verl_core.errors", "verl_core.rollout"},
    # the tool host's child process imports this package: no torch, no engines (agent/__init__)
    "verl_core.agent": {"verl_core.agent", "verl_core.errors"},
    **{f"verl_core.{c}.config": {"verl_core.config_fields"}
       for c in ("data", "models", "rollout", "reward", "training", "checkpoint", "guard")},
    # rollout.engine is checked against the engine registry's names (a module importing nothing)
    "verl_core.rollout.config": {"verl_core.config_fields", "verl_core.rollout.registry"},
    "verl_core.rollout.registry": set(),
}
"""Module (or package) -> the only verl_core modules and packages it may import. A section's
config beside its component imports the field machinery only (and the rollout section the engine
registry's names), so ``verl_core.config`` can import every section without a circle."""
NOT_ABOVE = ("verl_core.engine", "verl_core.phases", "verl_core.trainer", "verl_core.train",
             "verl_core.tasks")
"""What the building blocks below may not import: the engine and the drivers on top of it."""
BLOCKS = ("verl_core.agent", "verl_core.checkpoint", "verl_core.guard", "verl_core.data",
          "verl_core.models", "verl_core.rollout", "verl_core.reward", "verl_core.training",
          "verl_core.config", "verl_core.store", "verl_core.layout", "verl_core.seeds",
          "verl_core.writer",
          # what a run starts from (engine/assets.py stores them): below the engine too
          "verl_core.assets", "verl_core.tiny_warmup", "verl_core.format_warmup",
          "verl_core.warmstart")


def _module(path: pathlib.Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module(p): p for p in ROOT.rglob("*.py")}


def _under(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def _imports(path: pathlib.Path) -> dict[str, int]:
    """The verl_core modules ``path`` imports (at run time), each with a line that does."""
    tree = ast.parse(path.read_text())
    typing_only = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If)
                   and getattr(node.test, "id", getattr(node.test, "attr", "")) == "TYPE_CHECKING"
                   for n in ast.walk(node)}
    out: dict[str, int] = {}
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            # "from pkg import sub" imports the submodule, "from mod import name" the module
            names = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in MODULES
                     else node.module for a in node.names]
        else:
            continue
        for n in names:
            if n in MODULES:
                out.setdefault(n, node.lineno)
    return out


GRAPH = {m: _imports(p) for m, p in MODULES.items()}


def test_no_flytekit_import_in_source():
    offenders = []
    for path in ROOT.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            offenders += [f"{path}:{node.lineno}" for n in names if n.split(".")[0] == "flytekit"]
    assert offenders == []


def test_importing_the_library_does_not_load_flytekit():
    code = ("import sys, verl_core, verl_core.trainer, verl_core.train; "
            "print(verl_core.__version__); assert 'flytekit' not in sys.modules")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip()[0].isdigit()


def _circles(graph: dict[str, dict[str, int]]) -> list[str]:
    """Every import circle a depth-first walk closes (a back edge to a module on the path)."""
    circles, done = [], set()

    def walk(m, path):
        if m in path:
            circles.append(" -> ".join(path[path.index(m):] + [m]))
            return
        if m in done:
            return
        for n in sorted(graph.get(m, {})):
            if n != m:  # a package's __init__ importing from itself is no circle
                walk(n, path + [m])
        done.add(m)

    for m in sorted(graph):
        walk(m, [])
    return circles


def _upward(graph: dict[str, dict[str, int]]) -> list[str]:
    """Every import of a lower layer that :data:`LAYERS` or :data:`NOT_ABOVE` forbids."""
    offenders = []
    for m, imports in graph.items():
        allowed = next((ok for low, ok in LAYERS.items() if _under(m, low)), None)
        block = any(_under(m, b) for b in BLOCKS)
        for n, line in imports.items():
            if (allowed is not None and not any(_under(n, ok) for ok in allowed)) or \
                    (block and any(_under(n, up) for up in NOT_ABOVE)):
                offenders.append(f"{m}:{line} imports {n}")
    return offenders


def test_no_import_circle():
    assert _circles(GRAPH) == []


def test_lower_layers_import_nothing_above_them():
    assert _upward(GRAPH) == []


def test_the_checks_see_a_circle_and_an_upward_import():
    # what this module used to have: the store's drill import and cluster <-> group
    made_up = {"verl_core.store": {"verl_core.errors": 1, "verl_core.guard.faults": 206},
               "verl_core.guard.faults": {"verl_core.errors": 1},
               "verl_core.checkpoint.manager": {"verl_core.engine.worker": 9},
               "verl_core.engine.cluster": {"verl_core.engine.group": 208},
               "verl_core.engine.group": {"verl_core.engine.cluster": 26},
               # a section's config importing the composed config (a circle at import time)
               "verl_core.guard.config": {"verl_core.config_fields": 3, "verl_core.config": 4}}
    assert _upward(made_up) == ["verl_core.store:206 imports verl_core.guard.faults",
                                "verl_core.checkpoint.manager:9 imports verl_core.engine.worker",
                                "verl_core.guard.config:4 imports verl_core.config"]
    assert _circles(made_up) == ["verl_core.engine.cluster -> verl_core.engine.group -> "
                                 "verl_core.engine.cluster"]
