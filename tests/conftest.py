pytest_plugins = ["tests.conftest_s3"]


def pytest_collection_modifyitems(config, items):
    """``gpu`` tests need CUDA, ``vllm`` tests CUDA and the vllm package: skip them otherwise,
    saying which is missing (they are real tests, run on GPU machines)."""
    import importlib.util

    import pytest
    import torch

    cuda = torch.cuda.is_available()
    vllm = importlib.util.find_spec("vllm") is not None
    for item in items:
        if ("gpu" in item.keywords or "vllm" in item.keywords) and not cuda:
            item.add_marker(pytest.mark.skip(reason="needs CUDA (no GPU here)"))
        elif "vllm" in item.keywords and not vllm:
            item.add_marker(pytest.mark.skip(reason="needs the vllm package (pip install "
                                                    "'.[vllm]' on a GPU machine)"))
