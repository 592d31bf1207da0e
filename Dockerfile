# Images for running the workflows on a Flyte cluster (Kubernetes + KubeRay). Two targets:
#
#   docker build --target cpu -t <registry>/verl-flyte:<tag> .       the default image (light phases)
#   docker build --target gpu -t <registry>/verl-flyte-gpu:<tag> .   the Ray phases and the RayCluster
#
# and register with both: `pyflyte register --image <cpu> --image gpu=<gpu> ...` (tasks/images.py).
# `docker build .` builds the last target, cpu. tests/ops/test_images.py checks that what each
# target installs matches pyproject.toml and the constraints files.

# --- gpu: CUDA 13 base (torch 2.14's wheel ships its CUDA libraries; the base brings the driver
# compatibility layer and NVIDIA's container labels), Python 3.11 like the cpu image (Ray Client
# needs the same Python minor on both sides), the gpu and vllm extras and Ray.
FROM nvidia/cuda:13.0.2-base-ubuntu24.04 AS gpu
COPY --from=ghcr.io/astral-sh/uv:0.13.8 /uv /usr/local/bin/uv
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 RAY_AUTH_MODE=disabled \
    UV_PYTHON_INSTALL_DIR=/opt/python PATH=/opt/venv/bin:$PATH
# wget: KubeRay's default readiness probes call it. jemalloc: every process's allocator (below)
RUN apt-get update && apt-get install -y --no-install-recommends wget ca-certificates \
    libjemalloc2 && rm -rf /var/lib/apt/lists/* \
    && ln -s "$(find /usr/lib -name libjemalloc.so.2 | head -n 1)" /usr/local/lib/libjemalloc.so.2 \
    && uv venv --seed --python 3.11 /opt/venv
# jemalloc returns the update's freed buffers to the system, where glibc's heap keeps them
# resident: LoRA's peak RSS is then below full fine-tuning's by its saved gradients and AdamW
# moments (BENCHMARKS.md, "The allocator"); Ray's workers inherit the variable
ENV LD_PRELOAD=/usr/local/lib/libjemalloc.so.2
WORKDIR /root
COPY pyproject.toml README.md ./
COPY .ci/constraints-gpu.txt .ci/constraints-gpu.txt
COPY verl_core verl_core
COPY tasks tasks
COPY workflows workflows
RUN pip install --no-cache-dir -c .ci/constraints-gpu.txt '.[gpu,vllm]'
# Liveness: exits 1 when torch, CUDA, the store or the heartbeat is unhealthy (verl_core/health.py)
HEALTHCHECK --interval=60s --timeout=30s CMD python -m verl_core health || exit 1

# --- cpu: the default image
FROM python:3.11-slim AS cpu
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 RAY_AUTH_MODE=disabled
# jemalloc as every process's allocator, as in the gpu image
RUN apt-get update && apt-get install -y --no-install-recommends libjemalloc2 \
    && rm -rf /var/lib/apt/lists/* \
    && ln -s "$(find /usr/lib -name libjemalloc.so.2 | head -n 1)" /usr/local/lib/libjemalloc.so.2
ENV LD_PRELOAD=/usr/local/lib/libjemalloc.so.2
WORKDIR /root
COPY pyproject.toml README.md ./
COPY .ci/constraints-cpu.txt .ci/constraints-cpu.txt
COPY verl_core verl_core
COPY tasks tasks
COPY workflows workflows
# the CPU build of the pinned torch first (PyPI's Linux wheel is the multi-GB CUDA build); the
# constraint torch==X then accepts the installed X+cpu
RUN pip install --no-cache-dir --index-url https://download.pytorch.org/whl/cpu torch==2.13.0 \
    && pip install --no-cache-dir -c .ci/constraints-cpu.txt .
# Liveness: exits 1 when torch, the store or the heartbeat is unhealthy (verl_core/health.py)
HEALTHCHECK --interval=60s --timeout=30s CMD python -m verl_core health || exit 1
