"""Where a worker computes: the accelerator it trains and samples on, and the kernels' determinism.

``trainer.device`` (``auto``: CUDA when this process sees a GPU, else the CPU; ``cuda``; ``cpu``)
is resolved once per worker (:func:`resolve_device`). Models live there for the whole run; the
batch stays on the host, where it is stored, scored and hashed, and only the rows of one forward
travel to the device (``Batch.to``), their results back (``verl_core/training/forward.py``,
``verl_core/training/ppo.py``). So every stored batch and every phase's output are the same CPU
tensors whatever the device, and a run can be continued on the other kind of machine (not
bit-identically: the kernels differ).

``trainer.deterministic`` (CUDA): ``torch.use_deterministic_algorithms`` and cuBLAS's fixed
workspace (``CUBLAS_WORKSPACE_CONFIG``), so that two runs of the same step on the same GPU type
give the same bytes, which the resume promise (a resumed run ends with the uninterrupted run's
weights) needs. CUDA's default kernels are free to add in any order (atomics in embedding and
attention backward, split-K matmuls): without it a resume matches only up to rounding. The CPU
kernels used here are deterministic for a fixed thread count (``verl_core/threads.py``).
"""

from __future__ import annotations

import logging
import os

import torch

from verl_core.config import TRAINER_DEVICES as DEVICES  # auto, cuda, cpu

log = logging.getLogger(__name__)


CUBLAS_WORKSPACE = ":4096:8"
"""cuBLAS's deterministic workspace setting (CUDA's docs, "Results reproducibility"): fixed
workspace buffers, so a matmul's reduction order does not depend on the stream's history."""


class DeviceError(ValueError):
    """``trainer.device=cuda`` on a worker that sees no GPU."""


def resolve_device(setting: str) -> torch.device:
    """The device a worker computes on for ``trainer.device`` = ``setting``: one GPU (the
    current CUDA device: Ray gives each worker one, ``CUDA_VISIBLE_DEVICES``) or the CPU."""
    if setting not in DEVICES:
        raise DeviceError(f"trainer.device={setting!r}: must be one of {', '.join(DEVICES)}")
    cuda = torch.cuda.is_available()
    if setting == "cuda" and not cuda:
        raise DeviceError(
            "trainer.device=cuda but this worker sees no GPU (torch.cuda.is_available() is False"
            f"; torch {torch.__version__}, CUDA build {torch.version.cuda or 'none'}, "
            f"CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r}): give the worker "
            "a GPU (a CUDA build of torch, a GPU in its pod or Ray resources), or set "
            "trainer.device=auto to use the CPU where there is none")
    if setting == "cpu" or not cuda:
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


def make_deterministic(device: torch.device, deterministic: bool) -> None:
    """On CUDA with ``deterministic``: deterministic kernels from here on, in this process
    (a process-wide switch: the worker runs one run's trainer).

    Not ``warn_only``: with it, torch keeps the non-deterministic backward of its memory-
    efficient and cuDNN attention (it only warns), which a bitwise resume cannot have. An op
    with no deterministic CUDA kernel then raises, naming itself: the way on is
    ``trainer.deterministic=False`` (a resume then matches up to rounding)."""
    if device.type != "cuda" or not deterministic:
        return
    # read by cuBLAS when its handle is created (the first matmul): setting it here, before any
    # model work in this process, is in time; a value the user set is kept
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE)
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.benchmark = False


def model_device(model: torch.nn.Module) -> torch.device:
    """The device of ``model``'s first parameter (the CPU for a model with none)."""
    for p in model.parameters():
        return p.device
    return torch.device("cpu")


def describe(device: torch.device) -> str:
    """``cuda:0 (NVIDIA H200, 139.8 GiB)`` or ``cpu``: for the run's first log line."""
    if device.type != "cuda":
        return "cpu"
    props = torch.cuda.get_device_properties(device)
    return f"{device} ({props.name}, {props.total_memory / 2**30:.1f} GiB)"


def device_line(setting: str, deterministic: bool) -> str:
    """The run header's line on where the workers of this host compute (raises
    :class:`DeviceError` before any work when ``trainer.device=cuda`` finds no GPU)."""
    device = resolve_device(setting)
    kernels = (", deterministic kernels (trainer.deterministic)" if deterministic
               else ", CUDA's default kernels (trainer.deterministic=False)") \
        if device.type == "cuda" else ""
    return f"[verl] device: {describe(device)}{kernels}"
