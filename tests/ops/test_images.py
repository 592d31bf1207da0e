"""The Dockerfile's two images install what pyproject.toml and the constraints files say (no
Docker engine runs here: the Dockerfile is parsed), and the tasks name the image they need."""
import pathlib
import re
import shlex
import tomllib

import pytest
import yaml
from dockerfile_parse import DockerfileParser
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name

REPO = pathlib.Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
EXPECTED_EXTRAS = {"cpu": set(), "gpu": {"gpu", "vllm"}}
# pins that may differ between the images: vLLM pins its own torch and transformers
GPU_OWN_PINS = {"torch", "transformers"}


def _stages() -> dict[str, list[dict]]:
    """Stage name -> its instructions (dockerfile-parse's structure, FROM included)."""
    parser = DockerfileParser(path=str(REPO / "Dockerfile"))
    stages: dict[str, list[dict]] = {}
    current = None
    for ins in parser.structure:
        if ins["instruction"] == "COMMENT":
            continue
        if ins["instruction"] == "FROM":
            m = re.fullmatch(r"(\S+)\s+AS\s+(\S+)", ins["value"].strip(), re.IGNORECASE)
            assert m, f"every stage is named (FROM image AS name): {ins['value']!r}"
            current = m.group(2)
            stages[current] = []
        assert current, "an instruction before the first FROM"
        stages[current].append(ins)
    return stages


def _pip_installs(stage: list[dict]) -> list[list[str]]:
    """Argument lists of every `pip install` in the stage's RUN commands."""
    out = []
    for ins in stage:
        if ins["instruction"] != "RUN":
            continue
        for cmd in re.split(r"&&|;", ins["value"]):
            words = shlex.split(cmd)
            if words[:2] == ["pip", "install"]:
                out.append(words[2:])
    return out


def _constraints(path: pathlib.Path) -> dict[str, str]:
    pins = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            req = Requirement(line)
            (spec,) = req.specifier
            assert spec.operator == "==", f"{path.name}: {line!r} is not an exact pin"
            pins[canonicalize_name(req.name)] = spec.version
    return pins


def _declared(extras: set[str]) -> dict[str, SpecifierSet]:
    reqs = [Requirement(r) for r in PYPROJECT["project"]["dependencies"]]
    for extra in extras:
        reqs += [Requirement(r) for r in PYPROJECT["project"]["optional-dependencies"][extra]]
    return {canonicalize_name(r.name): r.specifier for r in reqs}


def _project_install(stage_name: str, stage: list[dict]) -> tuple[set[str], pathlib.Path]:
    """(extras, constraints file) of the stage's install of the project itself."""
    found = []
    for args in _pip_installs(stage):
        targets = [a for a in args if a == "." or a.startswith(".[")]
        if targets:
            (target,) = targets
            extras = set(filter(None, target[2:-1].split(","))) if target != "." else set()
            assert "-c" in args, f"{stage_name}: the project install must use a constraints file"
            found.append((extras, REPO / args[args.index("-c") + 1]))
    assert len(found) == 1, f"{stage_name}: expected one install of the project, got {found}"
    return found[0]


def test_each_image_installs_its_extras_under_its_constraints():
    stages = _stages()
    assert set(stages) == set(EXPECTED_EXTRAS)
    assert list(stages)[-1] == "cpu", "`docker build .` (the last stage) must stay the CPU image"
    assert any("nvidia/cuda:" in ins["value"] for ins in stages["gpu"][:1]), "gpu: CUDA base"
    known_extras = set(PYPROJECT["project"]["optional-dependencies"])
    find = PYPROJECT["tool"]["setuptools"]["packages"]["find"]
    packages = [p.rstrip("*") for p in find["include"]]
    for name, stage in stages.items():
        extras, constraints = _project_install(name, stage)
        assert extras == EXPECTED_EXTRAS[name] and extras <= known_extras, (name, extras)
        assert constraints.exists(), constraints
        copied = {shlex.split(i["value"])[0] for i in stage if i["instruction"] == "COPY"
                  and not i["value"].startswith("--from")}
        rel = str(constraints.relative_to(REPO))
        for needed in [rel, *packages]:
            assert needed in copied, f"{name}: {needed} is not copied into the image"
        assert {"pyproject.toml", "README.md"} <= {w for i in stage if i["instruction"] == "COPY"
                                                   for w in shlex.split(i["value"])[:-1]}
        # every pin of a declared dependency satisfies pyproject's specifier
        pins, declared = _constraints(constraints), _declared(extras)
        for pkg, version in pins.items():
            if pkg in declared:
                assert declared[pkg].contains(version, prereleases=True), \
                    f"{rel}: {pkg}=={version} is outside pyproject's {pkg}{declared[pkg]}"
        assert "torch" in pins, f"{rel}: torch must be pinned (an unpinned torch pulls CUDA)"
    gpu = _constraints(REPO / ".ci/constraints-gpu.txt")
    assert {"vllm", "torch", "ray"} <= set(gpu) and "ray" in _declared(set())


def test_shared_pins_agree_and_the_cpu_image_gets_the_cpu_torch():
    cpu = _constraints(REPO / ".ci/constraints-cpu.txt")
    gpu = _constraints(REPO / ".ci/constraints-gpu.txt")
    for pkg in (set(cpu) & set(gpu)) - GPU_OWN_PINS:
        assert cpu[pkg] == gpu[pkg], f"{pkg}: {cpu[pkg]} (cpu) != {gpu[pkg]} (gpu)"
    dev_only = {canonicalize_name(Requirement(r).name)
                for r in PYPROJECT["project"]["optional-dependencies"]["dev"]}
    missing = set(cpu) - set(gpu) - GPU_OWN_PINS - dev_only
    assert not missing, f"pinned for CPU but not for the GPU image: {sorted(missing)}"
    # the cpu stage installs the pinned torch from the CPU wheel index before the project
    torch_installs = [a for a in _pip_installs(_stages()["cpu"]) if any(
        w.startswith("torch") for w in a)]
    assert torch_installs, "cpu: no explicit CPU torch install"
    (args,) = torch_installs
    assert f"torch=={cpu['torch']}" in args
    assert args[args.index("--index-url") + 1].endswith("/whl/cpu")


def test_both_images_run_the_same_python_minor_as_ray_client_needs():
    stages = _stages()
    cpu_from = stages["cpu"][0]["value"]
    m = re.match(r"python:(3\.\d+)", cpu_from)
    assert m, cpu_from
    gpu_runs = " ".join(i["value"] for i in stages["gpu"] if i["instruction"] == "RUN")
    assert f"--python {m.group(1)}" in gpu_runs, "gpu: Python minor differs from the cpu image"
    assert SpecifierSet(PYPROJECT["project"]["requires-python"]).contains(f"{m.group(1)}.0")


def test_raycluster_runs_the_pinned_ray():
    gpu = _constraints(REPO / ".ci/constraints-gpu.txt")
    (cluster,) = [d for d in yaml.safe_load_all((REPO / "deploy/k8s/raycluster.yaml").read_text())
                  if d and d["kind"] == "RayCluster"]
    assert cluster["spec"]["rayVersion"] == gpu["ray"]


@pytest.fixture(scope="module")
def serialized_images():
    """Task name -> container image, as `pyflyte register --image cpu --image gpu=...` would
    register it (every task the workflows package defines)."""
    import importlib
    import pkgutil

    from flytekit.configuration import ImageConfig, SerializationSettings
    from flytekit.core.base_task import PythonTask
    from flytekit.tools.translator import get_serializable

    import tasks

    settings = SerializationSettings(image_config=ImageConfig.from_images(
        "registry.example.com/verl-flyte:1", {"gpu": "registry.example.com/verl-flyte-gpu:1"}))
    images, types = {}, {}
    for mod in pkgutil.iter_modules(tasks.__path__):
        module = importlib.import_module(f"tasks.{mod.name}")
        for obj in vars(module).values():
            if isinstance(obj, PythonTask) and obj.name.startswith("tasks."):
                spec = get_serializable({}, settings, obj)
                images[obj.name] = spec.template.container.image
                types[obj.name] = obj.task_type
    return images, types


def test_ray_tasks_use_the_gpu_image_and_the_others_the_default(serialized_images):
    images, types = serialized_images
    assert "tasks.rollout.rollout" in images and "tasks.prepare.prepare" in images
    wrong = {name: image for name, image in images.items()
             if image != ("registry.example.com/verl-flyte-gpu:1" if types[name] == "ray"
                          else "registry.example.com/verl-flyte:1")}
    assert not wrong, f"tasks on the wrong image (Ray tasks need container_image=GPU_IMAGE " \
                      f"from tasks/images.py): {wrong}"


def test_registering_without_a_gpu_image_is_refused():
    from flytekit.configuration import ImageConfig, SerializationSettings
    from flytekit.tools.translator import get_serializable

    from tasks.rollout import rollout

    settings = SerializationSettings(
        image_config=ImageConfig.from_images("registry.example.com/verl-flyte:1"))
    with pytest.raises(AssertionError, match="Image Config with name gpu not found"):
        get_serializable({}, settings, rollout)


def test_both_images_preload_jemalloc():
    # jemalloc hands freed buffers back where glibc's heap keeps them resident (LoRA's saving
    # shows in the RSS only then: BENCHMARKS.md, "The allocator"); Ray's workers inherit it
    for name, stage in _stages().items():
        runs = " ".join(ins["value"] for ins in stage if ins["instruction"] == "RUN")
        envs = " ".join(ins["value"] for ins in stage if ins["instruction"] == "ENV")
        assert "libjemalloc2" in runs and "/usr/local/lib/libjemalloc.so.2" in runs, name
        assert "LD_PRELOAD=/usr/local/lib/libjemalloc.so.2" in envs, name
