"""The worker group (W Ray actors, FSDP2 over gloo) on a real local Ray cluster: the same training
as one worker up to float rounding, checkpoints that resume on any worker count, and a worker
killed mid-update that costs one retry on a rebuilt group, not the run."""
import json
import os
import shutil
import signal
import threading
import time

import pytest
import torch

from tests.presets import tiny_run
from verl_core import phases
from verl_core.engine import workers
from verl_core.engine.workers import WORKERS, RunWorkers
from verl_core.phases import with_retries
from verl_core.prepare import prepare_run
from verl_core.types import PhaseOut, StepState

pytestmark = pytest.mark.slow

STEPS = 4


def _cfg(W: int, total_steps: int = STEPS, algorithm: str = "grpo", **extra):
    # 6 prompts x 4 samples = 24 rows: W = 1, 2 and 3 all get equal blocks
    return tiny_run(algorithm, **extra, **{
        "total_steps": total_steps, "model.warmup_sft_steps": 150,
        "model.warmup_target_accuracy": 0.3, "data.synthetic_train_size": 120,
        "data.synthetic_val_size": 12, "data.train_batch_size": 6,
        "actor.ppo_mini_batch_size": 6, "checkpoint.checkpoint_interval": 2,
        "trainer.n_gpus_per_node": W, "trainer.worker_timeout_s": 120.0})


@pytest.fixture(scope="module")
def local_ray(tmp_path_factory):
    ray = pytest.importorskip("ray")
    faults = tmp_path_factory.mktemp("faults")
    env = {"RAY_AUTH_MODE": "disabled", "VERL_FAULTS_DIR": str(faults),
           "VERL_ASSET_CACHE": str(tmp_path_factory.mktemp("assets")),
           # worker 1 hangs in the middle of the update of step 1, once (the kill test)
           "VERL_FAULTS": json.dumps([{"phase": "update-rank1", "step": 1, "kind": "hang",
                                       "times": 1}])}
    with pytest.MonkeyPatch.context() as mp:  # the Ray workers inherit them
        for k, v in env.items():
            mp.setenv(k, v)
        ray.init(address="local", num_cpus=2, include_dashboard=False, configure_logging=False)
        try:
            yield ray, faults
        finally:
            WORKERS.release_all()
            ray.shutdown()


def _phases(spec, start: int, stop: int) -> None:
    for s in range(start, stop):
        def step(s=s):
            ref, _ = RunWorkers(spec).rollout(s)
            ref = phases.reward(spec, PhaseOut(s, ref)).batch
            ref = phases.advantage(spec, PhaseOut(s, ref)).batch
            RunWorkers(spec).update(s, ref)
            RunWorkers(spec).checkpoint(s + 1)
        with_retries(step, what=f"step {s}", backoff_s=0.1)


def _final(spec, step: int) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    # retried as run_phase retries it in a run: a worker lost here costs an attempt on a rebuilt
    # group (CI once saw a W = 3 gloo worker abort in glibc's heap check during export_final;
    # the numbers below are checked all the same)
    out = with_retries(lambda: phases.finalize(spec, StepState(step)), what="finalize",
                       backoff_s=0.1)
    return load_file(os.path.join(out["final_model"], "model.safetensors"))


def _run(store, name, W, start=None, stop=STEPS, **cfg):
    spec = prepare_run(_cfg(W, **cfg), str(store), name, log_fn=lambda *_: None)
    _phases(spec, spec.start_step if start is None else start, stop)
    return spec


def _sampled_tokens(store_run) -> list[torch.Tensor]:
    """The response tokens of every applied update's batch, in step order. (The batches' bytes
    differ in the last bits of their float log-probs: the rollout forward ran on other rows.)"""
    from verl_core.store import RunStore
    from verl_core.engine.worker import get_batch

    st = RunStore(str(store_run))
    [folder] = st.list_folders("lineage")
    return [get_batch(st, st.get_json(d)["batch"]).response_ids
            for d in sorted(st.list_json(folder))]


def _same_tokens(a, b) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def _max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


# The same trajectory on W workers differs from one worker only in the order floats are summed:
# the sampled tokens are the same (each row draws its own uniforms, see rollout/hf.py; a token
# could only flip where two tokens' cumulative probabilities straddle a uniform draw within
# rounding); the weights then differ by the rounding of the
# gradient sums (2·n·u·Σ|g_i| per coordinate, tests/verl_core/training/test_ppo_update.py) passed
# through AdamW. 1e-5 is the bar; the bound that holds whatever happens, even if sampling
# diverged, is Adam's update bound 2·Σ_t lr_t·(1-β1)/√(1-β2) ≈ 2·Σ_t lr_t here, ~1e-3.
ATOL = 1e-5


def test_two_workers_train_like_one_and_resume_on_one_and_three(tmp_path, local_ray):
    (local_ray[1] / "update-rank1-1.attempts").write_text("1")  # the kill test's fault: spent
    ref = _run(tmp_path / "w1", "r", 1)
    ref_w = _final(ref, STEPS)
    WORKERS.release_all()

    w2 = _run(tmp_path / "w2", "r", 2, stop=2)  # "killed" after step 2 (checkpoint 2 committed)
    WORKERS.release_all()
    shutil.copytree(tmp_path / "w2", tmp_path / "w2-copy")
    for store, W in ((tmp_path / "w2", 1), (tmp_path / "w2-copy", 3)):
        spec = prepare_run(_cfg(W), str(store), "r", log_fn=lambda *_: None)
        assert spec.start_step == 2  # resumes from the W = 2 checkpoint
        _phases(spec, 2, STEPS)
        assert _same_tokens(_sampled_tokens(store / "r"), _sampled_tokens(tmp_path / "w1" / "r")), W
        assert _max_diff(_final(spec, STEPS), ref_w) <= ATOL, W
        WORKERS.release_all()
    assert w2.trajectory_hash == ref.trajectory_hash  # one trajectory, whatever the worker count


def test_ppo_with_critic_and_reference_on_two_workers_trains_like_one(tmp_path, local_ray):
    """GAE with a critic (sharded, trained, its values computed block by block) and a KL loss
    against the reference model (sharded, forward only): every model of the algorithm."""
    (local_ray[1] / "update-rank1-1.attempts").write_text("1")  # the kill test's fault: spent
    over = {"algorithm": "ppo", "algorithm.use_kl_loss": True, "stop": 2}
    one = _run(tmp_path / "w1", "r", 1, **over)
    w1 = _final(one, 2)
    WORKERS.release_all()
    two = _run(tmp_path / "w2", "r", 2, **over)
    assert _same_tokens(_sampled_tokens(tmp_path / "w2" / "r"), _sampled_tokens(tmp_path / "w1" / "r"))
    assert _max_diff(_final(two, 2), w1) <= ATOL
    WORKERS.release_all()


def test_lora_on_two_workers_trains_like_one_and_resumes_on_one(tmp_path, local_ray):
    """LoRA adapters (PEFT) over FSDP2 shards with a KL loss against the base (the policy with
    its adapters off): W = 2 samples W = 1's tokens (its rollout copy holds the merged weights)
    and its checkpoint (the adapters; the base a shared group) resumes on one worker to W = 1's
    weights."""
    (local_ray[1] / "update-rank1-1.attempts").write_text("1")  # the kill test's fault: spent
    over = {"model.lora_rank": 4, "algorithm.use_kl_loss": True}
    one = _run(tmp_path / "w1", "r", 1, **over)
    w1 = _final(one, STEPS)
    WORKERS.release_all()
    _run(tmp_path / "w2", "r", 2, stop=2, **over)
    WORKERS.release_all()
    spec = prepare_run(_cfg(1, **over), str(tmp_path / "w2"), "r", log_fn=lambda *_: None)
    assert spec.start_step == 2  # resumes from the W = 2 checkpoint
    _phases(spec, 2, STEPS)
    assert _same_tokens(_sampled_tokens(tmp_path / "w2" / "r"),
                        _sampled_tokens(tmp_path / "w1" / "r"))
    assert _max_diff(_final(spec, STEPS), w1) <= ATOL
    WORKERS.release_all()


@pytest.mark.vllm
def test_vllm_on_two_workers_samples_the_tokens_of_one_and_trains_like_one(tmp_path, local_ray):
    """rollout.engine=vllm (vLLM's CPU backend in .venv-vllm, or CUDA): each worker builds its
    own vLLM engine next to its FSDP2 shard and samples its block of rows with the rows' own
    seeds, so W = 2 draws exactly the tokens of W = 1; the weights then differ from W = 1 by the
    gradient sums' rounding only (ATOL above)."""
    (local_ray[1] / "update-rank1-1.attempts").write_text("1")  # the kill test's fault: spent
    over = {"rollout.engine": "vllm", "stop": 2}
    one = _run(tmp_path / "w1", "r", 1, **over)
    w1 = _final(one, 2)
    WORKERS.release_all()
    two = _run(tmp_path / "w2", "r", 2, **over)
    tokens = _sampled_tokens(tmp_path / "w2" / "r")
    assert len(tokens) == 2 and _same_tokens(tokens, _sampled_tokens(tmp_path / "w1" / "r"))
    assert _max_diff(_final(two, 2), w1) <= ATOL
    WORKERS.release_all()


def test_worker_killed_mid_update_fails_transient_and_the_group_is_rebuilt(tmp_path, local_ray):
    ray, faults = local_ray
    (faults / "update-rank1-1.attempts").write_text("1")  # spent: no hang in this run
    undisturbed = _final(_run(tmp_path / "a", "r", 2), STEPS)
    WORKERS.release_all()
    (faults / "update-rank1-1.attempts").unlink()  # armed: the next run hangs once

    spec = prepare_run(_cfg(2), str(tmp_path / "b"), "r", log_fn=lambda *_: None)
    errors: list = []
    t = threading.Thread(target=lambda: _guard(errors, lambda: _phases(spec, 0, STEPS)))
    t.start()
    marker = faults / "update-rank1-1.entered"
    deadline = time.time() + 300
    while not marker.exists():
        assert t.is_alive() and time.time() < deadline, errors
        time.sleep(0.2)
    os.kill(int(marker.read_text()), signal.SIGKILL)  # worker 1, in the middle of update 1
    t.join(timeout=600)
    assert not errors, errors
    # a second attempt ran the update of step 1, on a new worker 1 (the fault hangs only once)
    assert (faults / "update-rank1-1.attempts").read_text() == "2"
    assert _max_diff(_final(spec, STEPS), undisturbed) <= ATOL


def _guard(errors, fn):
    try:
        fn()
    except BaseException as e:  # noqa: BLE001 - reported by the test
        errors.append(e)


def test_a_hung_actor_call_passes_its_deadline_and_the_actor_is_killed(local_ray):
    ray, _ = local_ray

    class Sleeper:  # local, so Ray pickles it by value (Ray's workers cannot import this file)
        """A stand-in for the run worker's Ray actor: ``call(method, seconds)`` sleeps."""

        def call(self, method, seconds):
            import time

            time.sleep(float(seconds))
            return "done"

    actor = ray.remote(num_cpus=0)(Sleeper).remote()
    assert workers.call(actor, "sleep", 0.0, timeout_s=60.0) == "done"
    t0 = time.monotonic()
    with pytest.raises(workers.PhaseTimeoutError, match="did not answer within 1s"):
        workers.call(actor, "sleep", 120.0, timeout_s=1.0)
    assert time.monotonic() - t0 < 30
    # killed, not left running the hung call (a retry would queue behind it)
    with pytest.raises(ray.exceptions.RayActorError):
        ray.get(actor.call.remote("sleep", 0.0), timeout=60)
