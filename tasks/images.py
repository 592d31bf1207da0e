"""Container images of the tasks on a Flyte cluster (ignored by local ``pyflyte run``).

The heavy phases (rollout, update, checkpoint, evaluate, finalize: the Ray tasks) run in the CUDA
image, Dockerfile target ``gpu``; the light ones (configure, prepare, reward, advantage, the
schedule helpers) in the default image, Dockerfile target ``cpu``. Both are named when
registering: ``pyflyte register --image <cpu image> --image gpu=<gpu image> ...`` (flytekit
resolves the ``{{.image.gpu}}`` template then, and refuses to register without a ``gpu`` image).
"""

GPU_IMAGE = "{{.image.gpu}}"
"""flytekit image template: the image registered as ``--image gpu=<repo>:<tag>``."""
