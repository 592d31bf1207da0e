"""Package-level rules of ``verl_core.algorithms``: the public API imports, and the math stays
pure (no host syncs, no config objects, no orchestration imports)."""

import pathlib
import re

import verl_core.algorithms as algorithms

SOURCES = sorted(pathlib.Path(algorithms.__file__).parent.glob("*.py"))


def test_public_api_is_importable():
    for name in algorithms.__all__:
        assert getattr(algorithms, name) is not None, name


def test_math_is_pure():
    forbidden = {
        r"\.item\(\)": "host sync: return tensors, the caller reduces",
        r"\.tolist\(\)": "host sync",
        r"\.cpu\(\)": "host transfer",
        r"\bprint\(": "I/O",
        r"import flytekit|from flytekit": "orchestration import",
        r"verl_core\.config|from verl_core import config": "config object inside the math",
    }
    for path in SOURCES:
        code = path.read_text()
        for pattern, why in forbidden.items():
            assert not re.search(pattern, code), f"{path.name}: {pattern} ({why})"
