"""guard/faults.py's store outage reaches the run store through the store's own check list
(``store.before_io``): the store imports nothing above it, and the drill still fails every call."""
import functools
import time

import pytest

from verl_core.errors import StoreUnavailableError
from verl_core.guard import faults  # importing it adds the store outage check
from verl_core.store import RunStore


def test_store_outage_fails_every_store_call_while_it_lasts(tmp_path, monkeypatch):
    st = RunStore(str(tmp_path / "run"))
    st.put_json("doc", {"a": 1})
    monkeypatch.setenv("VERL_FAULTS_DIR", str(tmp_path / "faults"))
    (tmp_path / "faults").mkdir()
    (tmp_path / "faults" / "store-outage-until").write_text(repr(time.time() + 60))
    # an outage state file alone does nothing: only a declared store_outage fault switches it on
    assert st.get_json("doc") == {"a": 1}
    monkeypatch.setenv("VERL_FAULTS", '[{"kind": "store_outage", "phase": "rollout", "step": 9}]')
    with pytest.raises(StoreUnavailableError, match="injected store_outage"):
        st.get_json("doc")
    with pytest.raises(StoreUnavailableError, match="injected store_outage"):
        st.put_bytes(b"x")
    (tmp_path / "faults" / "store-outage-until").write_text(repr(time.time() - 1))  # over
    assert st.get_json("doc") == {"a": 1}


def test_a_hook_point_applies_its_own_fault_once_at_its_step(tmp_path, monkeypatch):
    monkeypatch.setenv("VERL_FAULTS", '[{"kind": "nan_reward", "phase": "reward", "step": 2}]')
    monkeypatch.setenv("VERL_FAULTS_DIR", str(tmp_path))
    assert faults.hook("reward_scored", 1) is None  # another step
    assert faults.hook("after_backward", 2) is None  # another point: nan_grad, not nan_reward
    assert faults.hook("reward_scored", 2)["kind"] == "nan_reward"
    assert faults.hook("reward_scored", 2) is None  # "times" defaults to 1
    assert faults.IN_CODE_PHASE == {"nan_reward": "reward", "nan_grad": "update",
                                    "corrupt_object": "checkpoint", "engine_kill": "rollout",
                                    "engine_hang": "rollout"}



def test_a_term_fault_sends_sigterm_once_and_the_warm_start_is_a_phase(tmp_path, monkeypatch):
    import signal

    got = []
    old = signal.signal(signal.SIGTERM, lambda signum, frame: got.append(signum))
    try:
        monkeypatch.setenv("VERL_FAULTS", '[{"kind": "term", "phase": "warm_start", "step": 10}]')
        monkeypatch.setenv("VERL_FAULTS_DIR", str(tmp_path))
        assert faults.check_faults() == 1  # warm_start is a phase a fault may name
        faults.maybe_inject("warm_start", 9)
        assert got == []
        faults.maybe_inject("warm_start", 10)  # the handler ran: the signal is this process's
        faults.maybe_inject("warm_start", 10)  # "times" defaults to 1
        assert got == [signal.SIGTERM]
    finally:
        signal.signal(signal.SIGTERM, old)


def test_the_points_inside_a_rollout_are_phases_and_a_tool_call_fault_fires_mid_call(
        tmp_path, monkeypatch):
    # tool_call, background_rollout and sampler are phases a fault may name (docs/resume.md's
    # chains use them); tool_call fires through ToolHost's on_calls_sent (the trainer sets it
    # for a training rollout's calls), once the calls are sent, not for a create alone
    from verl_core.agent.tools import BUILTIN_CALCULATOR, Request, ToolHost, tool_entries

    monkeypatch.setenv("VERL_FAULTS", '[{"kind": "permanent", "phase": "tool_call", "step": 3},'
                       '{"kind": "kill", "phase": "background_rollout", "step": 1},'
                       '{"kind": "kill", "phase": "sampler", "step": 1}]')
    monkeypatch.setenv("VERL_FAULTS_DIR", str(tmp_path))
    assert faults.check_faults() == 3
    [entry] = tool_entries(BUILTIN_CALCULATOR)
    with ToolHost([entry], timeout_s=60) as host:
        calls = [Request("create", entry.name, "a", {}),
                 Request("execute", entry.name, "a", {"parameters": {"expression": "2+3"}})]
        assert host.run(calls)[1].status == "ok"  # no step: nothing fires
        host.on_calls_sent = functools.partial(faults.maybe_inject, "tool_call", 3)
        assert host.run(calls[:1])[0].status == "ok"  # a create alone: no tool call runs
        with pytest.raises(faults.InjectedPermanentFault, match="tool_call of step 3"):
            host.run(calls[1:])
