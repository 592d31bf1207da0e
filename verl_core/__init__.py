"""verl_core: the RL post-training library behind the Flyte workflows.

Everything here is plain Python + torch: no flytekit import anywhere (a test enforces it), so the
library runs from a notebook, a script (``python -m verl_core.train``) or a Flyte task alike.

Shape symbols used in every docstring and comment:

    B  prompts in a batch
    G  samples (responses) per prompt  (``rollout.n``)
    N  rows = B * G, one per sampled response
    P  prompt tokens (left-padded)
    T  response tokens (right-padded)
    L  P + T, a whole sequence
    V  vocabulary size
"""

from verl_core._version import __version__

__all__ = ["__version__", "health_check"]


def health_check(*args, **kwargs):
    """Liveness/readiness probe; see :func:`verl_core.health.health_check`."""
    from verl_core.health import health_check as _health_check

    return _health_check(*args, **kwargs)
