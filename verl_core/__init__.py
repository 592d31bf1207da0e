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

__all__ = ["__version__", "beat", "health_check", "health_report"]


def health_check(*args, **kwargs):
    """Liveness probe: raises :class:`verl_core.health.UnhealthyError` when a check fails, so
    ``python -c "import verl_core; verl_core.health_check()"`` exits non-zero; the store and
    heartbeat come from the environment. See :mod:`verl_core.health`."""
    from verl_core.health import health_check as _health_check

    return _health_check(*args, **kwargs)


def health_report(*args, **kwargs):
    """The same checks as :func:`health_check`, returning the report without raising."""
    from verl_core.health import health_report as _health_report

    return _health_report(*args, **kwargs)


def beat(path=None):
    """Touch the heartbeat file named by ``VERL_HEARTBEAT_FILE`` (no-op when unset)."""
    from verl_core.health import beat as _beat

    _beat(path)
