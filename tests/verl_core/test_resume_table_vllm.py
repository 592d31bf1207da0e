"""docs/resume.md's vllm engine column: test_resume_table.py's chain (one plain-loop run stopped
at each fault point in turn, a VERL_FAULTS ``kill`` or ``term`` per process, the same command
re-run until it ends with the uninterrupted run's exact exported weights) with
``rollout.engine=vllm``: vLLM's CPU backend in ``.venv-vllm`` (``.ci/run`` runs the ``vllm``
tests there), its engine in the trainer's process.

Every process of the chain pays Python's and vLLM's imports and an engine build (~30 s on 2
loaded cores, against a few seconds for its RL steps), so the column is one chain of one
process per fault point. The first stop is a preemption of the warm start: its accuracy probe
samples with the ``hf`` engine in every mode and the vLLM engine is built after it, so that
process builds none, but the run it resumes is a vLLM run."""
import pytest

from tests.verl_core.test_resume_table import (  # noqa: F401 - asset_cache is a fixture
    ADVANTAGE, BASE, CHECKPOINT, EVALUATE, FINALIZE, REWARD, TERM, UPDATE, WARM_TERM, _chain,
    asset_cache)

ENGINE_BUILT = "Initializing a V1 LLM engine"
"""vLLM's log line as it builds an engine."""


@pytest.mark.vllm
@pytest.mark.slow
def test_vllm_killed_or_preempted_at_each_fault_point_ends_as_uninterrupted(asset_cache,
                                                                            tmp_path):
    points = [WARM_TERM, REWARD, TERM, ADVANTAGE, UPDATE, CHECKPOINT, EVALUATE, FINALIZE]
    _chain(tmp_path, {**BASE, "rollout.engine": "vllm"}, points)
    # every process after the warm start's sampled with vLLM before its fault fired: each built
    # a vLLM engine (the evaluation samples with it too)
    for i in range(1, len(points) + 1):
        assert ENGINE_BUILT in open(tmp_path / f"run{i}.out").read(), i
