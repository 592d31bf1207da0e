"""Every relative link in README.md, BENCHMARKS.md and docs/*.md resolves: the file exists and an
``#anchor`` names a heading of it by GitHub's slug. Links the code cites (``docs/x.md#anchor`` in a
comment or docstring) are held to the same rule, so a renamed heading cannot orphan them."""

import re
from collections import Counter
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", ROOT / "BENCHMARKS.md", *sorted((ROOT / "docs").glob("*.md"))]

# [text](target) outside code; a target has no spaces (titles are not used here)
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
# docs/x.md#anchor as the code cites it
CODE_LINK = re.compile(r"\bdocs/[\w.-]+\.md(?:#[\w-]+)?")


def github_slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, markup and punctuation dropped (word characters,
    spaces and hyphens kept), each space a hyphen. ``## The vLLM engine (`rollout.engine`)`` ->
    ``the-vllm-engine-rolloutengine``."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link's text only
    text = text.strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def unfenced(text: str) -> str:
    """The text outside fenced code blocks."""
    return re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)


def prose(text: str) -> str:
    """The text outside fenced code blocks and inline code."""
    return re.sub(r"`[^`\n]*`", "", unfenced(text))


def anchors(path: Path) -> set[str]:
    """Every heading's slug, a repeated one suffixed -1, -2 … as GitHub does."""
    seen: Counter = Counter()
    out = set()
    for line in unfenced(path.read_text()).splitlines():
        m = re.match(r"#{1,6} (.+)", line)
        if m:
            slug = github_slug(m.group(1))
            out.add(slug if not seen[slug] else f"{slug}-{seen[slug]}")
            seen[slug] += 1
    return out


def broken(source: Path, target: str) -> str | None:
    """Why ``target`` (relative to ``source``) does not resolve, or None."""
    file, _, anchor = target.partition("#")
    path = (source.parent / file).resolve() if file else source
    if not path.exists():
        return f"{source.name}: {target}: no file {path}"
    if anchor and path.suffix == ".md" and anchor not in anchors(path):
        return f"{source.name}: {target}: no heading with slug #{anchor} in {path.name}"
    return None


def test_github_slug():
    assert github_slug("Rule 3: phases are deterministic") == "rule-3-phases-are-deterministic"
    assert github_slug("Cluster modes (`cluster.mode`)") == "cluster-modes-clustermode"
    assert github_slug("Training guard: cost per step, guard on vs off (issue 12)") == \
        "training-guard-cost-per-step-guard-on-vs-off-issue-12"
    assert github_slug("W = 1 vs W = 2") == "w--1-vs-w--2"


def test_anchors_count_repeated_headings(tmp_path):
    doc = tmp_path / "a.md"
    doc.write_text("# Top\n## Notes\n```\n# not a heading\n```\n## Notes\n")
    assert anchors(doc) == {"top", "notes", "notes-1"}
    assert broken(doc, "#notes-1") is None
    assert "no heading" in broken(doc, "#not-a-heading")
    assert "no file" in broken(doc, "b.md")


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(doc):
    targets = [t for t in LINK.findall(prose(doc.read_text()))
               if not re.match(r"[a-z][a-z0-9+.-]*:", t)]  # http:, https:, mailto: are not ours
    problems = [p for t in targets if (p := broken(doc, t))]
    assert not problems, "\n".join(problems)


def test_docs_links_in_the_code_resolve():
    sources = [p for d in ("verl_core", "tasks", "workflows", "tests", "bench")
               for p in sorted((ROOT / d).rglob("*.py")) if p != Path(__file__).resolve()]
    problems = [f"{src.relative_to(ROOT)}: " + p for src in sources
                for t in CODE_LINK.findall(src.read_text())
                if (p := broken(ROOT / "README.md", t))]
    assert not problems, "\n".join(problems)


# docs/resume.md: a test named in its table as `tests/x.py::test_name`
RESUME_TEST = re.compile(r"`(tests/[\w/]+\.py)::(\w+)`")


def resume_table(text: str) -> list[list[str]]:
    """The body rows of docs/resume.md's table, each as its cells (the fault point first)."""
    rows = [line.strip().strip("|").split("|") for line in unfenced(text).splitlines()
            if line.startswith("|")]
    return [[c.strip() for c in r] for r in rows[2:]]  # past the header and the |---| line


def test_resume_table_names_tests_that_exist():
    """Every cell of the resume-equivalence table names tests that exist (the file, and a
    ``def <name>`` in it), or says ``missing`` or ``n/a``; the counts under it are the table's."""
    text = (ROOT / "docs" / "resume.md").read_text()
    rows = resume_table(text)
    assert len(rows) == 13 and all(len(r) == 8 for r in rows), rows
    kinds: Counter = Counter()
    problems = []
    for row in rows:
        for cell in row[1:]:
            named = RESUME_TEST.findall(cell)
            kinds["filled" if named else cell] += 1
            if not named and cell not in ("missing", "n/a"):
                problems.append(f"{row[0]}: {cell!r} names no test and is not missing or n/a")
            for path, name in named:
                file = ROOT / path
                if not file.exists():
                    problems.append(f"{row[0]}: no file {path}")
                elif not re.search(rf"^\s*def {name}\(", file.read_text(), re.M):
                    problems.append(f"{row[0]}: {path} has no def {name}")
    assert not problems, "\n".join(problems)
    assert f"{kinds['filled']} cells filled, {kinds['missing']} missing, {kinds['n/a']} n/a" \
        in " ".join(text.split())


def test_design_names_every_top_level_module_of_verl_core():
    """docs/design.md's layer map names every module and package directly under verl_core/
    (``name.py`` or ``name/``), so a new one cannot go in without a place on the map."""
    text = (ROOT / "docs" / "design.md").read_text()
    lib = ROOT / "verl_core"
    names = sorted(p.stem for p in lib.iterdir()
                   if (p.suffix == ".py" and p.stem not in ("__init__", "_version"))
                   or (p.is_dir() and not p.name.startswith(("_", "."))))
    missing = [n for n in names if not re.search(rf"(?<![\w.]){re.escape(n)}(?:\.py\b|/)", text)]
    assert not missing, f"docs/design.md's layer map leaves out: {missing}"
