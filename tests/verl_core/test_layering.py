"""verl_core is the library layer: it must never import flytekit (DESIGN.md)."""
import ast
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2] / "verl_core"


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
