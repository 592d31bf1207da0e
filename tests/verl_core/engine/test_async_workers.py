"""Off-policy rollout (``rollout.max_staleness`` 1 and 2) with W = 2 workers (FSDP2 over gloo,
two processes): the background rollouts gather their blocks of rows on a gloo group of their own
while the update's collectives run on the default group, and the behaviour weights are gathered
from the actor's shards at every push. The run samples W = 1's tokens and ends at W = 1's weights
up to the rounding of the gradient sums (test_group.py's bound)."""
import json

import pytest
import torch

from tests.gloo_workers import finish, run_gloo_workers
from tests.presets import tiny_run
from tests.verl_core.engine.test_group import ATOL
from verl_core.assets import prepare_assets
from verl_core.engine.assets import publish_assets
from verl_core.engine.worker import RunWorker, get_batch, put_batch
from verl_core.reward.scoring import score_batch
from verl_core.store import RunStore
from verl_core.training.advantage import compute_advantages
from verl_core.training.dist import SINGLE, init_process_group

pytestmark = pytest.mark.slow  # ~1 min on 2 cores: a warm start, W = 1, then two processes

STEPS = 3
# a warm start that scores some rows (GRPO's advantages are 0 where a group scores alike, and
# the weights would not move); TINY's 8 prompts x 4 samples = 32 rows, 16 per worker
OVER = {"model.warmup_sft_steps": 150, "model.warmup_target_accuracy": 0.3,
        "rollout.max_staleness": 1, "algorithm.rollout_is": "token", "total_steps": STEPS,
        "checkpoint.checkpoint_interval": 2, "checkpoint.async_save": False,
        # the evaluation's shares (4 and 5 of 9 rows) decode in chunks of 4: one call on
        # worker 0, two on worker 1. Decoding runs no collectives, so it must not sample the
        # sharded actor (each forward an all-gather) but a full copy of it
        "data.synthetic_val_size": 9, "data.val_batch_size": 4}


DAPO = {"algorithm.filter_groups_enable": True, "algorithm.filter_groups_metric": "acc"}
"""DAPO's dynamic sampling: each step's generation batches sampled, scored and filtered in the
background, rank 0's scores deciding for both workers (gathered on the rollout's group)."""


def _cfg(W: int, k: int = 1, extra: dict | None = None):
    return tiny_run(**{**OVER, "trainer.n_gpus_per_node": W, "rollout.max_staleness": k,
                       **(extra or {})})


def _run(worker: RunWorker) -> dict:
    """STEPS steps as the workflow's phases run them (the driver passes rank 0's refs to every
    worker): each step's rollout ref, sampled tokens, policy version and rollout metrics (the
    checkpoint of step 2 holds the behaviour copy, the state of step 1), an evaluation after
    update 1 (the actor's weights, while the background rollout of step 2 holds the behaviour
    copy's), and the final weights (gathered from the shards with W > 1: a collective)."""
    dp, refs, tokens, versions, metrics, evals = worker.dp, [], [], [], [], None
    gen = []
    for s in range(STEPS):
        ref, m = worker.rollout(s)
        ref = dp.gather_objects(ref)[0]
        batch = get_batch(worker.store, ref)
        refs.append(ref)
        tokens.append(batch.response_ids)
        versions.append(batch.meta["policy_version"])
        gen.append((batch.meta.get("gen_batches_start"), batch.meta.get("gen_batches_end")))
        metrics.append(m)
        batch, _ = score_batch(batch, worker.trainer.scorer, worker.trainer.tokenizer)
        batch, _ = compute_advantages(batch, worker.cfg.algorithm)
        adv = dp.gather_objects(put_batch(worker.store, batch) if worker.leader else None)[0]
        worker.update(s, adv)
        worker.checkpoint(s + 1)
        if s == 1:
            evals = worker.evaluate(s + 1)
    actor = worker.trainer.actor
    weights = actor.gathered_merged_state() if dp.distributed else actor.merged_state()
    return {"refs": refs, "tokens": tokens, "versions": versions, "metrics": metrics,
            "gen_batches": gen,
            "evals": evals, "weights": {k: v.detach().clone() for k, v in weights.items()}}


def _worker(rank: int, world: int, init: str, uri: str, index_json: str, out: str,
            k: str, extra_json: str = "{}") -> None:
    torch.set_num_threads(1)
    dp = init_process_group("gloo", init, rank, world, 120.0)
    cfg = _cfg(world, int(k), json.loads(extra_json))
    worker = RunWorker(uri, json.dumps(cfg.to_dict()), json.loads(index_json), dp=dp)
    got = _run(worker)
    worker.close()
    # a fresh group resamples step 2 from the checkpoint of step 2 (its behaviour copy saved by
    # both workers, loaded by both), in the foreground
    fresh = RunWorker(uri, json.dumps(cfg.to_dict()), json.loads(index_json), dp=dp)
    ref, m = fresh.rollout(2)
    got["resampled"] = (dp.gather_objects(ref)[0], m["rollout/prefetched"], fresh.replayed)
    fresh.close()
    if rank == 0:
        torch.save(got, out)
    finish()


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    return prepare_assets(_cfg(1), str(tmp_path_factory.mktemp("assets")), log=lambda *_: None)


@pytest.mark.parametrize("k, extra", [(1, {}), (2, {}), (1, DAPO)], ids=["k1", "k2", "k1-dapo"])
def test_two_workers_sample_off_policy_as_one_and_train_like_one(assets, tmp_path, k, extra):
    uri1 = str(tmp_path / "w1")
    one = RunWorker(uri1, json.dumps(_cfg(1, k, extra).to_dict()),
                    publish_assets(RunStore(uri1), assets), dp=SINGLE)
    try:
        w1 = _run(one)
    finally:
        one.close()
    uri2, out = str(tmp_path / "w2"), tmp_path / "w2.pt"
    index = publish_assets(RunStore(uri2), assets)
    run_gloo_workers("tests.verl_core.engine.test_async_workers", "_worker", tmp_path, uri2,
                     json.dumps(index), out, k, json.dumps(extra))
    w2 = torch.load(out, weights_only=False)
    # every step after the first was sampled k updates behind (fewer at the start), in the
    # background, by both runs
    for got in (w1, w2):
        assert got["versions"] == [max(0, s - k) for s in range(STEPS)]
        assert [m["rollout/prefetched"] for m in got["metrics"]] == \
            [0.0] + [1.0] * (STEPS - 1), got["metrics"]
    # each worker samples its block of rows with the draws the whole batch gives them, from a
    # full behaviour copy gathered from the shards: W = 1's tokens exactly
    for s, (a, b) in enumerate(zip(w2["tokens"], w1["tokens"])):
        assert torch.equal(a, b), s
    if extra:  # the same generation batches consumed, contiguous from 0
        assert w2["gen_batches"] == w1["gen_batches"]
        assert [g[0] for g in w1["gen_batches"]] == [0] + [g[1] for g in w1["gen_batches"][:-1]]
        assert max(g[1] - g[0] for g in w1["gen_batches"]) > 1, w1["gen_batches"]
    # the same object, byte for byte, from the checkpoint (no update replayed)
    assert w2["resampled"] == (w2["refs"][2], 0.0, 0), (w2["resampled"], w2["refs"])
    # the evaluation samples the actor (W = 2: a full copy gathered from its shards), not the
    # behaviour policy; greedy, so the same scores
    assert w2["evals"] == w1["evals"], (w2["evals"], w1["evals"])
    assert any(not torch.equal(w1["weights"][k], v) for k, v in _initial_weights(assets).items())
    diff = max(float((w2["weights"][k] - w1["weights"][k]).abs().max()) for k in w1["weights"])
    assert diff <= ATOL, diff


def _initial_weights(assets) -> dict:
    """The warm-started weights the runs start from."""
    from verl_core.models import load_causal_lm

    return load_causal_lm(assets.model_path, "float32").state_dict()
