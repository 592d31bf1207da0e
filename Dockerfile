# Image for running the workflows on a Flyte cluster (Kubernetes + KubeRay).
# CPU by default; for GPU nodes build FROM a CUDA base and install torch for that CUDA version
# before the project (the constraints file pins the CPU wheel used in CI).
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 RAY_AUTH_MODE=disabled
WORKDIR /root
COPY pyproject.toml README.md ./
COPY .ci/constraints-cpu.txt .ci/constraints-cpu.txt
COPY verl_core verl_core
COPY tasks tasks
COPY workflows workflows
RUN pip install --no-cache-dir -c .ci/constraints-cpu.txt .
# Liveness probe for long-running pods: exits 1 when torch, the store or the heartbeat is unhealthy.
HEALTHCHECK --interval=60s --timeout=30s CMD python -m verl_core.health || exit 1
