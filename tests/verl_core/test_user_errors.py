"""Every error class of the package is either a user error (the input was wrong: one line naming
the field or file and the fix, exit 2, in both front doors) or a fault of the run, named here with
why it is not the user's: a new class must be put on one side, so no wrong input ends in a
traceback with exit 1 (issue 40: tool and LoRA configs, a truncated adapter, ...)."""
import importlib
import inspect
import pkgutil

import verl_core
from verl_core.train import USER_ERROR_CLASSES, user_errors

NOT_USER_ERRORS = {
    # bases and control flow
    "verl_core.errors.VerlError": "the base of all",
    "verl_core.errors.PermanentError": "a base: permanent, not necessarily the user's",
    "verl_core.errors.TransientError": "a base: retried",
    "verl_core.reward.manager._Deadline": "a scorer worker's internal alarm",
    "verl_core.reward.sandbox.SandboxError": "the machine cannot run the code sandbox (no "
                                             "namespaces, the harness did not start): the host's "
                                             "fault, its message names what to change",
    "verl_core.reward.sandbox_fusion.SandboxUnavailableError": "a SandboxFusion service "
                                                               "unreachable or failing: transient",
    "verl_core.agent.tools._Refused": "a tool host's internal signal: the call becomes an error observation",
    "verl_core.agent.openai_server.RequestRefused": "an endpoint's internal signal: the "
                                                    "agent's request gets an HTTP 400 answer",
    "verl_core.agent.loops.AgentLoopStopped": "raised inside an agent loop the rollout gave up "
                                              "on (a timeout): its row scores 0, the run goes on",
    "verl_core.rollout.vllm._Failed": "an engine call's internal signal: rebuild and retry",
    "verl_core.parts.behaviour.Cancelled": "a background rollout's internal signal: its state "
                                           "changed, it is dropped (the phase samples again)",
    "verl_core.errors.RolloutEngineError": "a fault (the engine died or hung past its rebuilds): "
                                           "transient, retried",
    "verl_core.guard.faults.InjectedPermanentFault": "a fault the user asked the drill to inject",
    "verl_core.guard.faults.InjectedTransientFault": "a fault the user asked the drill to inject",
    # faults of the run, its machines or its store: the traceback is the evidence
    "verl_core.engine.group.WorkerLostError": "a worker process died (retried)",
    "verl_core.engine.workers.PhaseTimeoutError": "a phase overran its deadline (retried)",
    "verl_core.errors.StoreUnavailableError": "the store did not answer (retried)",
    "verl_core.guard.policy.GuardRetryError": "the guard retries the step",
    "verl_core.guard.policy.GuardHaltError": "the guard stopped a diverging run",
    "verl_core.errors.CorruptObjectError": "stored bytes damaged (quarantined, healed)",
    "verl_core.errors.CheckpointDisagreementError": "workers disagree on a checkpoint",
    "verl_core.errors.CheckpointSaveError": "a checkpoint write failed",
    "verl_core.errors.CheckpointNotFoundError": "a checkpoint the run needs is gone",
    "verl_core.errors.NoValidCheckpointError": "every checkpoint failed verification",
    "verl_core.errors.StoreFullError": "the store ran out of space mid-run",
    "verl_core.errors.UnsafeManifestError": "a manifest names paths outside the store",
    "verl_core.store.io.NotFoundError": "a stored doc or object is missing",
    "verl_core.errors.StaleBatchError": "an off-policy batch outside the bound",
    "verl_core.engine.worker.StateUnavailableError": "a worker's state is not where it should be",
    "verl_core.parts.sampler_process.SamplerError": "the background sampler process failed",
    "verl_core.engine.dynamic_sampling.FilterGroupsExhaustedError":
        "the data gave too few mixed groups during training",
    "verl_core.reward.manager.ScorerError": "a custom scorer failed on a row during training",
    "verl_core.reward.manager.ScorerTimeoutError": "too many scorer calls timed out in a step",
    "verl_core.reward.model.RewardModelError": "the reward model failed during training",
    "verl_core.health.UnhealthyError": "the health check's answer, not a run's",
    "verl_core.models.fetch.FetchError": "the fetch command's own errors (it prints them)",
    "verl_core.train.StoppedBeforeDeadline": "saved and stopped before checkpoint.must_save_by",
}


def _classes() -> dict[str, type]:
    out = {}
    for info in pkgutil.walk_packages(verl_core.__path__, "verl_core."):
        if info.name.endswith("__main__"):
            continue
        mod = importlib.import_module(info.name)
        for c in vars(mod).values():
            if (inspect.isclass(c) and issubclass(c, BaseException)
                    and not issubclass(c, Warning) and c.__module__ == mod.__name__):
                out[f"{c.__module__}.{c.__qualname__}"] = c
    return out


def test_every_error_class_is_a_user_error_or_named_as_a_fault():
    users = user_errors()
    unclassified, both = [], []
    for name, cls in sorted(_classes().items()):
        is_user = issubclass(cls, users)
        if not is_user and name not in NOT_USER_ERRORS:
            unclassified.append(name)
        if is_user and name in NOT_USER_ERRORS:
            both.append(name)
    assert not unclassified, (f"error classes on neither side: {unclassified}; add each to "
                              "verl_core.train.USER_ERROR_CLASSES or to NOT_USER_ERRORS here")
    assert not both, both
    assert not set(NOT_USER_ERRORS) - set(_classes()), "a named class no longer exists"


def test_the_issues_user_errors_are_in_the_set():
    names = {c for _, c in USER_ERROR_CLASSES}
    assert {"ToolConfigError", "LoRAConfigError", "AssetsChangedError",
            "TrajectoryChangedError"} <= names
