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
import json
import os
import signal
import time

import pytest
import torch

from verl_core.config import ConfigError, RolloutConfig
from verl_core.errors import RolloutEngineError, TransientError
from verl_core.guard import faults
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


def test_the_engine_drills_fire_once_in_the_rollout_and_need_an_engine_process(
        tmp_path, monkeypatch):
    with pytest.raises(faults.FaultSpecError, match="fires only in phase 'rollout'"):
        faults.parse_faults('[{"kind": "engine_kill", "phase": "update", "step": 1}]')
    monkeypatch.setenv("VERL_FAULTS", '[{"kind": "engine_hang", "phase": "rollout", "step": 1}]')
    monkeypatch.setenv("VERL_FAULTS_DIR", str(tmp_path))
    sent = []

    class Engine:  # what the drill asks of the engine: a signal to its process, mid-generate
        def signal_when_generating(self, sig):
            sent.append(sig)

    faults.engine_drill(Engine(), 0)  # another step
    faults.engine_drill(Engine(), 1)
    faults.engine_drill(Engine(), 1)  # "times" defaults to 1
    assert sent == [signal.SIGSTOP]
    monkeypatch.setenv("VERL_FAULTS", '[{"kind": "engine_kill", "phase": "rollout", "step": 2}]')
    from verl_core.models import build_tiny_model
    model, tok = build_tiny_model(seed=0)
    hf = make_engine("hf", model=model, eos_token_id=tok.eos_token_id,
                     pad_token_id=tok.pad_token_id)
    with pytest.raises(faults.InjectedPermanentFault, match="HFEngine.*no process of its own"):
        faults.engine_drill(hf, 2)


def test_a_rollout_split_in_generation_batches_sums_its_engine_restarts():
    from verl_core.engine.dynamic_sampling import _merge_metrics

    merged = _merge_metrics([(32, {"rollout/engine_restarts": 1.0, "rollout/engine_timeouts": 1.0,
                                   "response_length/mean": 4.0}),
                             (16, {"rollout/engine_restarts": 2.0, "rollout/engine_timeouts": 0.0,
                                   "response_length/mean": 1.0})])
    assert merged["rollout/engine_restarts"] == 3.0 and merged["rollout/engine_timeouts"] == 1.0
    assert merged["response_length/mean"] == 3.0  # (32 x 4 + 16 x 1) / 48: averaged by rows


def test_a_failed_engine_is_a_transient_error():
    assert issubclass(RolloutEngineError, TransientError)


# ----------------------------------------------------------------- vLLM's CPU backend
@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """The tiny model (head size 64) and its Hugging Face folder."""
    from verl_core.models import build_tiny_model

    model, tok = build_tiny_model(hidden_size=256, heads=4, layers=2, seed=0)
    path = tmp_path_factory.mktemp("tiny-hf")
    model.save_pretrained(path, safe_serialization=True)
    tok.save_pretrained(path)
    return model, tok, path


@pytest.fixture(scope="module")
def served(tiny):
    """One engine in a process of its own, holding weights that are not its folder's (one
    projection scaled), so a rebuild that forgot to load them back samples differently; and the
    undisturbed reference: the rollout it gives for fixed seeds."""
    model, tok, path = tiny
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


@pytest.mark.vllm
def test_the_engine_processes_end_when_the_trainers_process_is_killed(tiny):
    """The other way round: a SIGKILLed trainer (the OOM killer, a lost pod's process) leaves no
    engine behind. Without ``vllm_health.follow_trainer`` vLLM's engine core and worker outlived
    it (minutes, here), holding the model, the KV cache and 400 MiB of shared memory."""
    import subprocess
    import sys

    _, tok, path = tiny
    child = subprocess.Popen([sys.executable, "-c", f"""
import json, time
from verl_core.rollout import make_engine
eng = make_engine("vllm", model_path={str(path)!r}, eos_token_id={tok.eos_token_id},
                  pad_token_id={tok.pad_token_id}, dtype="float32", cpu_kv_cache_gib=0.25,
                  engine_own_process=True)
print("ENGINE " + json.dumps([eng.procs.pids, eng.procs.shm]), flush=True)
time.sleep(600)
"""], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        line = next(line for line in child.stdout if line.startswith("ENGINE "))
        pids, shm = json.loads(line[len("ENGINE "):])
        assert len(pids) == 2 and shm
        child.kill()  # SIGKILL: nothing of the trainer runs after it
        child.wait()
        # the engine's processes follow within the 1 s poll; the resource tracker unlinks the
        # shared memory once its last user is gone
        end = time.monotonic() + 30
        while not (_gone(pids) and not any(os.path.exists(p) for p in shm)) \
                and time.monotonic() < end:
            time.sleep(0.2)
        assert _gone(pids), pids
        assert not any(os.path.exists(p) for p in shm), shm
    finally:
        child.kill()


@pytest.mark.vllm
@pytest.mark.slow
def test_a_run_whose_engine_is_killed_mid_rollout_finishes_with_the_undisturbed_weights(
        tmp_path, monkeypatch):
    """``verl_core.train`` on vLLM with VERL_FAULTS ``engine_kill`` in the rollout of step 1: the
    engine core is SIGKILLed mid-generate, rebuilt and synced, the rollout repeated; the run ends
    with the undisturbed run's weights, bit for bit. The restart is in the step's metrics, in
    the guard's event log and in its counter, which a resumed run carries on from its
    checkpoint."""
    from tests.presets import tiny_run
    from verl_core.checkpoint import CheckpointManager
    from verl_core.guard.events import read_events
    from verl_core.store import RunStore
    from verl_core.train import train

    def sha(folder):
        import hashlib
        with open(os.path.join(folder, "model.safetensors"), "rb") as f:
            return hashlib.sha256(f.read()).hexdigest()

    quiet = lambda *_: None  # noqa: E731
    monkeypatch.setenv("VERL_ASSET_CACHE", str(tmp_path / "assets"))  # one warm start
    on_vllm = {"rollout.engine": "vllm", "rollout.engine_own_process": True}
    cfg = tiny_run(total_steps=2, **on_vllm)
    straight = train(cfg, str(tmp_path / "straight"), log=quiet)
    monkeypatch.setenv("VERL_FAULTS", json.dumps([{"kind": "engine_kill", "phase": "rollout",
                                                   "step": 1}]))
    monkeypatch.setenv("VERL_FAULTS_DIR", str(tmp_path / "faults"))
    logs: list[str] = []
    killed = train(cfg, str(tmp_path / "killed"), log=logs.append)
    assert [h["rollout/engine_restarts"] for h in killed["history"]] == [0.0, 1.0]
    assert any(line.startswith("guard: step 1 rollout_engine: the rollout engine died or hung "
                               "and was rebuilt 1 time(s)") for line in logs), logs
    assert sha(killed["final_model"]) == sha(straight["final_model"])
    assert [h["reward/mean"] for h in killed["history"]] == \
        [h["reward/mean"] for h in straight["history"]]
    store = RunStore(str(tmp_path / "killed"))
    events = [e for e in read_events(store, cfg.trajectory_hash())
              if e["detector"] == "rollout_engine"]
    assert [(e["step"], e["phase"], e["action"], e["value"]) for e in events] == \
        [(1, "rollout", "restart_engine", 1.0)]
    assert CheckpointManager(store).load("latest")[1]["guard"]["engine_restarts"] == 1
    # one more step from the checkpoint of step 2: the counter goes on from it
    monkeypatch.delenv("VERL_FAULTS")
    more = train(tiny_run(total_steps=3, **on_vllm),
                 str(tmp_path / "killed"), log=quiet)
    assert [h["rollout/engine_restarts"] for h in more["history"]] == [0.0]
    assert CheckpointManager(store).load("latest")[1]["guard"]["engine_restarts"] == 1
