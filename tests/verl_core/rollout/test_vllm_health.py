"""The ``vllm`` engine's health (``rollout/vllm_health.py`` and ``VLLMEngine._call``): an engine
whose process is killed (SIGKILL) or stopped (SIGSTOP, a hang) mid-generate, or found dead before
a call, is torn down, rebuilt with the weights it held and the call made again with the same
seeds; the rollout then equals an undisturbed one bit for bit, because vLLM's CPU backend draws a
seeded request's tokens from its seed alone (checked here: the same ids, mask and log-probs from
a rebuilt engine). The signals are real, sent to the real engine processes.

The ``vllm``-marked tests run in ``.venv-vllm`` (``bash .ci/install vllm``; ``.ci/run`` runs them),
on the tests' tiny model widened to head size 64 (test_vllm_engine.py says why) and served in
float32. Each rebuild costs one engine start (~20 s on 2 loaded cores), so the tests share one
engine and rebuild it once each. The rest runs anywhere: the deadline's derivation, the config,
the drills' declarations and the per-phase sums.
"""
import os
import signal
import time

import pytest
import torch

from verl_core.config import ConfigError, RolloutConfig
from verl_core.errors import RolloutEngineError, TransientError
from verl_core.rollout import SamplingParams, make_engine
from verl_core.rollout.vllm_health import deadline_s

PROMPTS = ["12+7=", "3-1=", "29+30=", "1+1=", "40+2=", "7-7="] * 2


# ----------------------------------------------------------------- anywhere
def test_the_deadline_is_the_setting_or_derived_from_the_work():
    assert deadline_s(45.0, tokens=10**6, mib=10**4) == 45.0  # rollout.engine_timeout_s wins
    # 0: 300 s + 0.1 s x 12 rows x (5 prompt + 48 new tokens) = 300 + 63.6
    assert deadline_s(0.0, tokens=12 * (5 + 48)) == pytest.approx(363.6)
    # a weight load of 512 MiB: 300 s + 0.1 s x 512
    assert deadline_s(0.0, mib=512.0) == pytest.approx(351.2)


def test_the_health_settings_are_checked_and_change_no_trajectory():
    d = RolloutConfig()
    assert (d.engine_own_process, d.engine_timeout_s, d.engine_max_restarts) == (False, 0.0, 2)
    for key, bad in (("engine_timeout_s", -1.0), ("engine_max_restarts", -1)):
        with pytest.raises(ConfigError, match=rf"rollout\.{key}=-1"):
            RolloutConfig(**{key: bad})
    from tests.presets import tiny_run
    base = tiny_run(**{"rollout.engine": "vllm"})
    other = tiny_run(**{"rollout.engine": "vllm", "rollout.engine_timeout_s": 60.0,
                        "rollout.engine_max_restarts": 5, "rollout.engine_own_process": True})
    assert other.trajectory_hash() == base.trajectory_hash()


def test_a_failed_engine_is_a_transient_error():
    assert issubclass(RolloutEngineError, TransientError)


# ----------------------------------------------------------------- vLLM's CPU backend
@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """One engine in a process of its own, holding weights that are not its folder's (one
    projection scaled), so a rebuild that forgot to load them back samples differently; and the
    undisturbed reference: the rollout it gives for fixed seeds."""
    from verl_core.models import build_tiny_model

    model, tok = build_tiny_model(hidden_size=256, heads=4, layers=2, seed=0)
    path = tmp_path_factory.mktemp("tiny-hf")
    model.save_pretrained(path, safe_serialization=True)
    tok.save_pretrained(path)
    eng = make_engine("vllm", model_path=str(path), model=model, eos_token_id=tok.eos_token_id,
                      pad_token_id=tok.pad_token_id, dtype="float32", cpu_kv_cache_gib=0.25,
                      seed=0, engine_own_process=True)
    assert eng.own_process and eng.procs is not None and len(eng.procs.pids) == 2  # core, worker
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    state["model.layers.0.self_attn.q_proj.weight"] *= 1.5
    eng.load_weights(state)
    enc = tok(PROMPTS, return_tensors="pt", padding=True)
    params = SamplingParams(temperature=1.0, max_new_tokens=48, seed=3)
    t0 = time.perf_counter()
    ref = eng.generate(enc.input_ids, enc.attention_mask, params)
    first_call_s = time.perf_counter() - t0  # a fresh engine's first call: its slowest
    yield {"eng": eng, "ids": enc.input_ids, "mask": enc.attention_mask, "params": params,
           "ref": ref, "checksum": eng.weights_checksum(), "first_call_s": first_call_s}
    eng.close()


def _same(a, b) -> bool:
    return (torch.equal(a.response_ids, b.response_ids) and torch.equal(a.response_mask,
                                                                        b.response_mask)
            and torch.equal(a.logprobs, b.logprobs))


def _gone(pids: list[int]) -> bool:
    import psutil

    def gone(pid):
        try:
            return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return True
    return all(gone(p) for p in pids)


def _torn_down(old) -> None:
    """The old engine's processes are gone and the shared memory they mapped is unlinked."""
    assert _gone(old.pids), old.pids
    assert old.shm and not any(os.path.exists(p) for p in old.shm), old.shm


@pytest.mark.vllm
def test_an_engine_killed_mid_generate_is_rebuilt_and_the_rollout_is_the_same(served):
    eng, old = served["eng"], served["eng"].procs
    restarts, timeouts = eng.restarts, eng.timeouts
    # SIGKILL to the engine core process once the requests have their first tokens
    eng.signal_when_generating(signal.SIGKILL)
    out = eng.generate(served["ids"], served["mask"], served["params"])
    assert (eng.restarts, eng.timeouts) == (restarts + 1, timeouts)
    _torn_down(old)
    assert set(eng.procs.pids).isdisjoint(old.pids)
    # the same seeds on a rebuilt engine holding the same weights: the same rollout, bit for bit
    assert _same(out, served["ref"])
    assert eng.weights_checksum() == served["checksum"]  # not the folder's: the loaded ones


@pytest.mark.vllm
def test_an_engine_found_dead_before_a_call_is_rebuilt_within_the_bound(served):
    """Liveness before a call: the engine's worker (the process holding the model, under the
    engine core) killed between calls. With ``engine_max_restarts=0`` the call refuses at once,
    naming the engine and what to do; allowed a rebuild, the next call (a weight load, as the
    trainer's sync before a rollout) rebuilds it first and the rollout is the undisturbed one."""
    import psutil

    eng, old = served["eng"], served["eng"].procs
    restarts = eng.restarts
    worker = old.tree[-1]
    assert worker.name() == "VLLM::Worker"
    worker.send_signal(signal.SIGKILL)
    psutil.wait_procs([worker], timeout=30)
    eng.max_restarts = 0
    try:
        with pytest.raises(RolloutEngineError, match=r"(?s)vllm rollout engine failed in "
                           r"generate \(dead: .*Worker.*\) after 0 rebuild.*"
                           r"rollout\.engine_max_restarts=0.*rollout\.engine=hf"):
            eng.generate(served["ids"], served["mask"], served["params"])
        assert eng.restarts == restarts
    finally:
        eng.max_restarts = 2
    eng.load_weights(eng._weights)  # found dead: rebuilt, then loaded
    assert eng.restarts == restarts + 1
    _torn_down(old)
    assert _same(eng.generate(served["ids"], served["mask"], served["params"]), served["ref"])


@pytest.mark.vllm
def test_a_hung_engine_hits_the_deadline_is_killed_and_rebuilt(served):
    """SIGSTOP mid-generate: the engine core is alive but makes no progress. The deadline is
    ten times a fresh engine's first call (its slowest: warm-up), at least 30 s; past it the
    stopped process is killed, the engine rebuilt and the rollout repeated."""
    eng, old = served["eng"], served["eng"].procs
    restarts, timeouts = eng.restarts, eng.timeouts
    eng.timeout_s = max(30.0, 10 * served["first_call_s"])
    try:
        eng.signal_when_generating(signal.SIGSTOP)
        t0 = time.perf_counter()
        out = eng.generate(served["ids"], served["mask"], served["params"])
        took = time.perf_counter() - t0
    finally:
        eng.timeout_s = 0.0
    assert (eng.restarts, eng.timeouts) == (restarts + 1, timeouts + 1)
    assert took >= eng.timeout_s
    _torn_down(old)
    assert _same(out, served["ref"])
