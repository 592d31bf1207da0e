"""docs/resume.md's vllm engine column: test_resume_table.py's chain (one plain-loop run stopped
at each fault point in turn, a VERL_FAULTS ``kill`` or ``term`` per process, the same command
re-run until it ends with the uninterrupted run's exact exported weights) with
``rollout.engine=vllm``: vLLM's CPU backend in ``.venv-vllm`` (``.ci/run`` runs the ``vllm``
tests there), its engine in the trainer's process.

Every process of the chain pays Python's and vLLM's imports and an engine build (~30 s on 2
loaded cores, against a few seconds for its RL steps), so the column is one chain of one
process per fault point, in the mode that has them all: one-step off-policy with its background
rollout in a sampler process (``rollout.async_mode=process``, which builds a vLLM engine of its
own), on the calculator task (multi-turn: tool calls). The sampler process's kill ends only that
process, so it costs no launch (the chain passed in 7.3 min on 2 shared cores; the on-policy one
took 5-6, and a second chain for the tool call and the sampler process 6). The first stop is a
preemption of the warm start: its accuracy probe samples with the ``hf`` engine in every mode and
the vLLM engine is built after it, so that process builds none, but the run it resumes is a vLLM
run."""
import pytest

from tests.verl_core.test_resume_table import (  # noqa: F401 - asset_cache is a fixture
    ADVANTAGE, BASE, CHECKPOINT, EVALUATE, FINALIZE, REWARD, SAMPLER, SURVIVED, TOOL_CALL,
    UPDATE, WARM_TERM, _chain, asset_cache)

TERM_2 = ("term", "rollout", 2)
ENGINE_BUILT = "Initializing a V1 LLM engine"
"""vLLM's log line as it builds an engine."""


@pytest.mark.vllm
@pytest.mark.slow
def test_vllm_killed_or_preempted_at_each_fault_point_ends_as_uninterrupted(asset_cache,
                                                                            tmp_path):
    # killed in a tool call of step 0 (the trainer's own rollout); the sampler process killed as
    # it starts the background rollout of step 1 (in the process the reward kill left, whose
    # rollout of step 1 waits for it: the run goes on, samples step 1 in the foreground and is
    # killed in the advantage of step 1); the preemption as the rollout of step 2 starts (one as
    # the rollout of step 1 starts would stop the process of update 0 before its sampler process,
    # still importing vLLM, had been asked to sample: the sampler's fault never fired)
    points = [WARM_TERM, TOOL_CALL, REWARD, SAMPLER, ADVANTAGE, UPDATE, CHECKPOINT, EVALUATE,
              TERM_2, FINALIZE]
    _chain(tmp_path, {**BASE, "rollout.engine": "vllm", "data.synthetic_task": "calculator",
                      "model.warmup_mixed_steps": 0, "rollout.max_staleness": 1,
                      "algorithm.rollout_is": "token", "rollout.async_mode": "process"},
           points)
    ends = [p for p in points if p[1] not in SURVIVED]
    logs = [open(tmp_path / f"run{i}.out").read() for i in range(len(ends) + 1)]
    # every process after the warm start's sampled with vLLM before its fault fired: each built
    # a vLLM engine (the evaluation samples with it too)
    for i in range(1, len(ends) + 1):
        assert ENGINE_BUILT in logs[i], i
    # the sampler process (its output goes to the run's log) built a vLLM engine of its own
    # before its fault (it builds the run's trainer first), and the run sampled step 1 again
    sampled = logs[ends.index(REWARD) + 1]
    assert sampled.count(ENGINE_BUILT) >= 2, sampled[-3000:]
    assert "the background rollout of step 1 failed" in sampled, sampled[-3000:]
