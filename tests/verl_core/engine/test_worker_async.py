"""One-step off-policy rollout (``rollout.max_staleness=1``, issue 27) at the worker level, on
the real tiny model: the rollout of step t samples with the weights of step t - 1 in a background
thread while update t - 1 runs, every batch records that version, the update refuses a batch
outside the allowed lag, and checkpoints + lineage replay rebuild the behaviour policy exactly
(a rollout re-sampled by a fresh worker is the same object, byte for byte)."""
import hashlib
import json

import pytest
import torch

from tests.presets import TINY, tiny_run
from verl_core.config import ConfigError
from verl_core.engine.assets import publish_assets
from verl_core.engine.worker import RunWorker, StaleBatchError, get_batch, put_batch
from verl_core.store import RunStore
from verl_core.training.advantage import compute_advantages
from verl_core.assets import prepare_assets
from verl_core.reward.scoring import score_batch

STEPS = 5
ASYNC = {**TINY, "model.warmup_sft_steps": 400, "model.warmup_target_accuracy": 0.2,
         "rollout.max_staleness": 1, "algorithm.rollout_is": "token",
         "algorithm.use_kl_loss": True, "total_steps": STEPS,
         "checkpoint.checkpoint_interval": 2, "checkpoint.async_save": False}


def _cfg(**over):
    return tiny_run(**{**ASYNC, **over})


@pytest.mark.parametrize("over, match", [
    ({"rollout.max_staleness": 5}, r"rollout.max_staleness=5: at most 4 is offered"),
    ({"rollout.max_staleness": -1}, r"rollout.max_staleness=-1: must be >= 0"),
    ({"algorithm.rollout_is": ""}, r"rollout.max_staleness=1: .*set algorithm.rollout_is=token"),
    ({"trainer.n_gpus_per_node": 2, "rollout.async_mode": "process"},
     r"rollout.async_mode='process': .*share no process group.*use rollout.async_mode=thread"),
])
def test_settings_the_off_policy_rollout_cannot_honour_are_refused(over, match):
    with pytest.raises(ConfigError, match=match):
        _cfg(**over)


def test_staleness_0_is_the_run_it_was():
    # the default: the field changes nothing, not even the trajectory hash (cache keys, lineage
    # and checkpoint names of runs from before it existed)
    assert tiny_run(**{"rollout.max_staleness": 0}).trajectory_hash() == \
        tiny_run().trajectory_hash()
    assert _cfg().trajectory_hash() != _cfg(**{"rollout.max_staleness": 0}).trajectory_hash()
    # bypass_mode is the other correction offered
    assert _cfg(**{"algorithm.rollout_is": "", "algorithm.policy_loss": "bypass_mode"})
    # DAPO's dynamic sampling too (tests/verl_core/engine/test_dynamic_sampling_resume.py)
    assert _cfg(**{"algorithm.filter_groups_enable": True, "rollout.n": 2})
    # several workers: the background rollout in a thread of each (test_async_workers.py)
    assert _cfg(**{"trainer.n_gpus_per_node": 2}).trainer.world_size == 2


def _weights_sha(worker) -> str:
    h = hashlib.sha256()
    for k, v in sorted(worker.trainer.actor.model.state_dict().items()):
        h.update(k.encode())
        h.update(v.detach().contiguous().numpy().tobytes())
    return h.hexdigest()


def _worker(uri, cfg, index):
    return RunWorker(uri, json.dumps(cfg.to_dict()), index)


def _step(worker, step) -> tuple[str, dict, str]:
    """One step as the workflow's phases run it; the rollout batch, its metrics and the
    advantaged batch that update ``step`` read."""
    ref, metrics = worker.rollout(step)
    batch = get_batch(worker.store, ref)
    batch, _ = score_batch(batch, worker.trainer.scorer, worker.trainer.tokenizer)
    batch, _ = compute_advantages(batch, worker.cfg.algorithm)
    adv = put_batch(worker.store, batch)
    worker.update(step, adv)
    worker.checkpoint(step + 1)
    return ref, metrics, adv


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    return prepare_assets(_cfg(), str(tmp_path_factory.mktemp("assets")), log=lambda *_: None)


@pytest.fixture(scope="module")
def run(tmp_path_factory, assets):
    """Five steps of staleness 1 by one worker: the rollout refs, their metrics, the
    advantaged batches and the weights after each step."""
    return _run_steps(str(tmp_path_factory.mktemp("store")), _cfg(), assets)


def _run_steps(uri, cfg, assets, after_step=None):
    """``cfg.total_steps`` steps by one worker on a fresh store: (uri, cfg, assets index, the
    rollout refs, their metrics, the advantaged batches, the weights' sha before and after each
    step). ``after_step(worker, step)``: a check after each."""
    index = publish_assets(RunStore(uri), assets)
    w = _worker(uri, cfg, index)
    refs, metrics, advs, shas = [], [], [], [_weights_sha(w)]
    try:
        for s in range(cfg.total_steps):
            ref, m, adv = _step(w, s)
            refs.append(ref), metrics.append(m), advs.append(adv), shas.append(_weights_sha(w))
            if after_step is not None:
                after_step(w, s)
    finally:
        w.close()
    return uri, cfg, index, refs, metrics, advs, shas


def test_each_rollout_samples_one_update_behind_in_the_background(run):
    uri, _, _, refs, metrics, _, shas = run
    st = RunStore(uri)
    assert len(set(shas)) == STEPS + 1  # every update moved the weights
    for s, (ref, m) in enumerate(zip(refs, metrics)):
        batch = get_batch(st, ref)
        assert batch.meta["step"] == s and batch.meta["policy_version"] == max(0, s - 1)
        assert m["rollout/staleness"] == (0.0 if s == 0 else 1.0)
        # step 0 has no update before it to overlap; every later one was sampled while the
        # update before it ran, and taken from that background thread
        assert m["rollout/prefetched"] == (0.0 if s == 0 else 1.0), (s, m)
        if s:
            assert m["rollout/prefetch_ahead_s"] > 0.0 and m["rollout/prefetch_wait_s"] >= 0.0


def test_the_background_rollout_is_what_the_previous_state_samples(run, assets):
    # a fresh worker at the state of step t - 1, sampling step t in the foreground: the same
    # tokens and log-probs, bit for bit, as the background thread's (the draws are seeded by
    # (seed, step, row), the behaviour copy is the state of step t - 1); the state of step t
    # gives other log-probs, so the batch really is one update old
    uri, cfg, index, refs, *_ = run
    st = RunStore(uri)
    w = _worker(uri, cfg, index)
    try:
        for t in (1, 3):
            stored = get_batch(st, refs[t])
            w.ensure_state(t - 1)
            w.trainer.behaviour.reset(w.step)
            again, _ = w.trainer.sample(t, w.trainer.prompt_indices(t))
            assert torch.equal(again.response_ids, stored.response_ids)
            assert torch.equal(again.response_logprobs, stored.response_logprobs)
            w.ensure_state(t)
            w.trainer.behaviour.reset(w.step)
            on_policy, _ = w.trainer.sample(t, w.trainer.prompt_indices(t))
            assert not torch.equal(on_policy.response_logprobs, stored.response_logprobs)
    finally:
        w.close()


@pytest.mark.parametrize("fixture, step, checkpoint", [
    # staleness 1 (issue 27) - step 2: the checkpoint of step 2 holds the behaviour policy (the
    # state of step 1); step 3: that checkpoint + the replay of update 2, which pushes the
    # state of step 2
    ("run", 2, 2), ("run", 3, 2),
    # staleness 2 (issue 42) - step 4: the checkpoint of step 4 holds versions 2 and 3; step 5:
    # that checkpoint and the replay of update 4 (which pushes version 4)
    ("run_k2", 4, 4), ("run_k2", 5, 4)])
def test_a_fresh_worker_rebuilds_the_behaviour_policy_and_resamples_the_same_batch(
        request, fixture, step, checkpoint):
    # Either way the rollout (sampled in the foreground now, from the rebuilt queue) is the
    # stored object; the later ones are the background's; a batch one update further behind
    # than the bound is refused before it touches anything; the weights after the remaining
    # updates are the run's
    uri, cfg, index, refs, _, advs, shas = request.getfixturevalue(fixture)
    k = cfg.rollout.max_staleness
    w = _worker(uri, cfg, index)
    try:
        ref, m = w.rollout(step)
        assert ref == refs[step] and m["rollout/prefetched"] == 0.0
        assert w.replayed == step - checkpoint
        for s in range(step, cfg.total_steps):
            if s > step:
                ref, m = w.rollout(s)
                assert ref == refs[s] and m["rollout/prefetched"] == 1.0
            good = get_batch(w.store, advs[s])
            bad = put_batch(w.store, good.replace(meta={**good.meta,
                                                        "policy_version": s - k - 1}))
            with pytest.raises(StaleBatchError, match=rf"{k + 1} updates behind.*allows 0..{k}"):
                w.update(s, bad)
            w.update(s, advs[s])
            assert _weights_sha(w) == shas[s + 1]
    finally:
        w.close()


def test_an_update_refuses_a_batch_outside_the_allowed_lag(run):
    uri, cfg, index, refs, _, advs, _ = run
    st = RunStore(uri)
    w = _worker(uri, cfg, index)
    try:
        w.ensure_state(3)
        good = get_batch(st, advs[3])
        for version, lag in ((1, 2), (4, -1)):
            bad = put_batch(st, good.replace(meta={**good.meta, "policy_version": version}))
            with pytest.raises(StaleBatchError,
                               match=rf"update 3: its batch {bad[:12]} was sampled with the "
                                     rf"weights of step {version} .*{lag} updates behind.*"
                                     r"rollout.max_staleness=1 allows 0..1"):
                w.update(3, bad)
    finally:
        w.close()


def test_a_sampler_process_samples_the_same_batches_and_a_killed_one_is_replaced(run, assets,
                                                                                tmp_path):
    # rollout.async_mode=process: the background rollout in a sampler process of its own, its
    # behaviour weights the worker's (shared memory). The same bytes as the thread's; a sampler
    # killed by SIGKILL costs the step its background rollout (sampled again in the foreground,
    # the same bytes), and the next update starts a new one
    import os
    import signal

    refs = run[3]
    cfg = _cfg(**{"rollout.async_mode": "process"})
    uri = str(tmp_path / "store")
    w = _worker(uri, cfg, publish_assets(RunStore(uri), assets))
    try:
        got = []
        for s in range(4):
            if s == 2:
                sampler = w.trainer.behaviour._sampler
                os.kill(sampler.proc.pid, signal.SIGKILL)
                sampler.proc.join(30)
            ref, m, _ = _step(w, s)
            got.append((ref, m["rollout/prefetched"]))
        assert [r for r, _ in got] == refs[:4]
        assert [p for _, p in got] == [0.0, 1.0, 1.0, 0.0] or \
            [p for _, p in got] == [0.0, 1.0, 0.0, 1.0]
        now = w.trainer.behaviour._sampler
        assert now is not None and now is not sampler and now.proc.is_alive()
    finally:
        w.close()


@pytest.mark.vllm
def test_on_vllm_the_background_rollout_and_the_evaluation_each_get_their_weights(assets,
                                                                                  tmp_path):
    # vLLM holds one copy of the weights: the background rollout needs the behaviour policy's,
    # the evaluation between two steps the actor's. Each gets its own (the engine reloads when
    # the other used it), and a fresh worker resampling step 2 from the store gets the same
    # object, byte for byte. The background rollout's thread computes with the trainer's OpenMP
    # thread count, not the host's default a new thread starts with: on an AVX2 host a weight
    # load under another count served other weights (test_vllm_engine.py's thread test)
    cfg = _cfg(**{"rollout.engine": "vllm"})
    uri = str(tmp_path / "store")
    index = publish_assets(RunStore(uri), assets)
    w = _worker(uri, cfg, index)
    try:
        refs, evals = [], []
        for s in range(3):
            ref, m, _ = _step(w, s)
            refs.append(ref)
            assert m["rollout/staleness"] == min(s, 1) and m["rollout/prefetched"] == min(s, 1)
            evals.append(w.evaluate(s + 1))  # the actor's weights, between two steps
        assert get_batch(w.store, refs[2]).meta["policy_version"] == 1
    finally:
        w.close()
    fresh = _worker(uri, cfg, index)
    try:
        assert fresh.rollout(2)[0] == refs[2]
        assert fresh.evaluate(2) == evals[1]  # the state of step 2, evaluated as the live one
    finally:
        fresh.close()


# ---------------------------------------------------------------- staleness k = 2 (issue 42)
K2_STEPS = 6


@pytest.fixture(scope="module")
def run_k2(tmp_path_factory, assets):
    """Six steps of ``rollout.max_staleness=2`` by one worker (checkpoints at 2, 4, 6)."""
    def queue_holds_the_last_two(w, s):
        assert w.trainer.behaviour.versions() == list(range(max(0, s - 1), s + 1))

    return _run_steps(str(tmp_path_factory.mktemp("store_k2")),
                      _cfg(**{"rollout.max_staleness": 2, "total_steps": K2_STEPS}), assets,
                      queue_holds_the_last_two)


def test_staleness_2_samples_two_updates_behind_never_more(run_k2):
    # step t samples the weights of step max(0, t - 2): steps 1 and 2 both sample the initial
    # weights (both started in the background when update 0 began), every later one the state
    # two updates old, started when the update two steps before it began
    uri, _, _, refs, metrics, _, shas = run_k2
    st = RunStore(uri)
    assert len(set(shas)) == K2_STEPS + 1
    for s, (ref, m) in enumerate(zip(refs, metrics)):
        batch = get_batch(st, ref)
        assert batch.meta["policy_version"] == max(0, s - 2), s
        assert m["rollout/staleness"] == min(s, 2) <= 2
        assert m["rollout/prefetched"] == (0.0 if s == 0 else 1.0), (s, m)
    # the checkpoint of step 4 holds both versions the next two rollouts sample with
    from verl_core.checkpoint import CheckpointManager

    info = [i for i in CheckpointManager(st).list_checkpoints() if i.step == 4][0]
    assert {"behaviour", "behaviour_1"} <= set(info.groups)


# ---------------------------------------------------------------- partial rollout (issue 42)
PARTIAL = {"rollout.max_staleness": 2, "rollout.partial_rollout": True,
           "rollout.max_new_tokens": 4, "total_steps": 4, "optim.lr": 2e-2}
"""Segments of 2 tokens: the tiny model's answers (two digits and EOS) cross a boundary; a large
learning rate, so one update moves the log-probs far more than rounding does."""


@pytest.fixture(scope="module")
def run_partial(tmp_path_factory, assets):
    return _run_steps(str(tmp_path_factory.mktemp("store_partial")), _cfg(**PARTIAL), assets)


def test_a_partial_rollout_goes_on_with_each_newer_version_token_by_token(run_partial):
    # step t >= 2 samples its first 2 tokens with the weights of step t - 2 and the rest with
    # those of step t - 1 (the background rollout waited for update t - 1 to begin); every
    # token's log-prob is the one of the weights that sampled it (recomputed here by a full
    # forward of each version: equal up to the engine's incremental-decoding rounding)
    from verl_core.models import load_causal_lm
    from verl_core.training.forward import batched_logprobs

    uri, cfg, index, refs, metrics, _, _ = run_partial
    st = RunStore(uri)
    w = _worker(uri, cfg, index)
    try:
        for t in (2, 3):
            batch = get_batch(st, refs[t])
            assert batch.meta["partial_versions"] == [t - 2, t - 1]
            assert batch.meta["policy_version"] == t - 2 and batch.meta["partial_segment_tokens"] == 2
            assert metrics[t]["rollout/prefetched"] == 1.0
            second = batch.response_mask[:, 2:].sum()
            assert second > 0  # tokens of the newer version exist
            by_version = {}
            for v in (t - 2, t - 1):
                w.ensure_state(v)
                model = load_causal_lm(w.assets.model_path, cfg.model.dtype)
                model.load_state_dict(w.trainer.actor.merged_state())
                by_version[v] = batched_logprobs(model, batch, cfg.rollout.temperature, 64)
            mask = batch.response_mask.bool()
            seg = torch.zeros_like(mask)
            seg[:, 2:] = True  # the second segment's positions
            for v, where in ((t - 2, mask & ~seg), (t - 1, mask & seg)):
                err = (by_version[v] - batch.response_logprobs).abs()[where]
                # float32 log-softmax rounding is ~1e-6 here (measured <= 1e-6): 100x margin
                assert err.max() < 1e-4, (t, v, err.max())
            # and the other version's log-probs are not these (the versions really differ)
            other = (by_version[t - 2] - batch.response_logprobs).abs()[mask & seg]
            assert other.max() > 1e-3  # (measured 1.5e-2 and 9.6)
    finally:
        w.close()


def test_a_partial_rollout_replayed_is_the_same_tokens_and_log_probs(run_partial):
    # a fresh worker rebuilds the queue of step t (checkpoint + lineage replay) and samples it
    # in the foreground, waiting for nothing: the stored object, byte for byte; the remaining
    # updates give the run's weights
    from verl_core.parts.behaviour import Cancelled

    uri, cfg, index, refs, _, advs, shas = run_partial
    w = _worker(uri, cfg, index)
    try:
        ref, m = w.rollout(3)
        assert ref == refs[3] and m["rollout/prefetched"] == 0.0
        # a version that left the queue never comes again: a rollout waiting for it gives up
        # (one whose rollout phase was a cache hit, never taken) instead of hanging
        assert w.trainer.behaviour.versions() == [1, 2]
        with pytest.raises(Cancelled, match="version 0"):
            w.trainer.behaviour._wait_for(0)
        w.update(3, advs[3])
        assert _weights_sha(w) == shas[4]
    finally:
        w.close()


def test_partial_rollout_refuses_what_it_cannot_honour():
    for over, match in (
            ({"rollout.max_staleness": 1}, r"needs rollout.max_staleness >= 2 \(it is 1\)"),
            ({"rollout.async_mode": "process"}, r"sampler process samples whole rollouts"),
            ({"algorithm.adv_estimator": "remax"}, r"greedy baseline is one generation")):
        with pytest.raises(ConfigError, match=rf"rollout.partial_rollout=True: .*{match}"):
            _cfg(**{**PARTIAL, **over})


@pytest.mark.vllm
def test_on_vllm_a_partial_rollout_is_sampled_again_the_same(assets, tmp_path):
    # vLLM takes each segment's weights (a reload per version) and samples each row on from
    # its tokens so far with the row's own seed: a fresh worker that rebuilds the queue from
    # the store samples the same tokens and log-probs, byte for byte
    cfg = _cfg(**{**PARTIAL, "rollout.engine": "vllm", "total_steps": 3})
    uri = str(tmp_path / "store")
    index = publish_assets(RunStore(uri), assets)
    w = _worker(uri, cfg, index)
    try:
        refs = [_step(w, s)[0] for s in range(3)]
        batch = get_batch(w.store, refs[2])
        assert batch.meta["partial_versions"] == [0, 1] and batch.response_mask[:, 2:].any()
    finally:
        w.close()
    fresh = _worker(uri, cfg, index)
    try:
        assert fresh.rollout(2)[0] == refs[2]
    finally:
        fresh.close()


def test_two_sampler_processes_sample_the_thread_modes_batches_at_once(run_k2, assets, tmp_path):
    import os
    import signal

    # rollout.async_samplers=2: the background rollouts of steps t + 1 and t + 2 each in a
    # sampler process of its own (step t on sampler t mod 2, with a copy of the behaviour weights
    # of its own), so they may sample at once: the same bytes as one thread one after another
    refs = run_k2[3]
    cfg = _cfg(**{"rollout.max_staleness": 2, "total_steps": K2_STEPS,
                  "rollout.async_mode": "process", "rollout.async_samplers": 2})
    uri = str(tmp_path / "store")
    w = _worker(uri, cfg, publish_assets(RunStore(uri), assets))
    try:
        got, b = [], w.trainer.behaviour
        for s in range(K2_STEPS):
            if s == 3:  # the second sampler killed by SIGKILL (it samples steps 1 and 3)
                killed = b._slots[1].sampler
                assert killed.proc.pid != b._sampler.proc.pid
                os.kill(killed.proc.pid, signal.SIGKILL)
                killed.proc.join(30)
            ref, m, _ = _step(w, s)
            got.append((ref, m["rollout/prefetched"]))
        # the same bytes; step 3's background rollout is lost if the kill came before it
        # ended (sampled again in the foreground), and step 5's starts a new sampler
        assert [r for r, _ in got] == refs
        assert [p for s, (_, p) in enumerate(got) if s != 3] == [0.0, 1.0, 1.0, 1.0, 1.0]
        now = b._slots[1].sampler
        assert now is not killed and now.proc.is_alive() and b._sampler.proc.is_alive()
    finally:
        w.close()


def test_more_samplers_than_the_lag_or_without_processes_are_refused():
    with pytest.raises(ConfigError, match=r"rollout.async_samplers=3: at most "
                                          r"rollout.max_staleness=2"):
        _cfg(**{"rollout.max_staleness": 2, "rollout.async_mode": "process",
                "rollout.async_samplers": 3})
    with pytest.raises(ConfigError, match=r"rollout.async_samplers=2: .*needs "
                                          r"rollout.async_mode=process"):
        _cfg(**{"rollout.max_staleness": 2, "rollout.async_samplers": 2})
