"""Structure counts for issue 24's before/after: the largest modules, functions whose docstring
is longer than the rest of their body, stale-prone prose, README length.

    python bench/code_stats.py [ROOT]
"""

from __future__ import annotations

import ast
import pathlib
import re
import sys


def _py_files(root: pathlib.Path) -> list[pathlib.Path]:
    return sorted(p for d in ("verl_core", "tasks", "workflows") for p in (root / d).rglob("*.py"))


def _long_docstrings(tree: ast.AST) -> int:
    """Functions whose docstring has more lines than the statements after it."""
    n = 0
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or not node.body:
            continue
        first = node.body[0]
        if not (isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant)
                and isinstance(first.value.value, str)) or len(node.body) < 2:
            continue
        doc = first.end_lineno - first.lineno + 1
        body = node.end_lineno - node.body[1].lineno + 1
        n += doc > body
    return n


def main(root: pathlib.Path) -> None:
    files = _py_files(root)
    sizes = sorted(((len(p.read_text().splitlines()), p.relative_to(root)) for p in files),
                   reverse=True)
    long_doc = sum(_long_docstrings(ast.parse(p.read_text())) for p in files)
    text = "\n".join(p.read_text() for p in files)
    readme = root / "README.md"
    rows = [
        ("python files (verl_core, tasks, workflows)", len(files)),
        ("lines in them", sum(s for s, _ in sizes)),
        *((f"largest: {p}", s) for s, p in sizes[:5]),
        ("functions with a docstring longer than their body", long_doc),
        ('"DESIGN rule N" citations', len(re.findall(r"DESIGN rule", text))),
        ("docstring/comment timings (N ms)", len(re.findall(r"\b\d+(?:\.\d+)? ?ms\b", text))),
        ("README.md lines", len(readme.read_text().splitlines()) if readme.exists() else 0),
    ]
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{width}}  {v:>6}")


if __name__ == "__main__":
    main(pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else "."))
