"""The rollout/trainer mismatch (verl's ``training/rollout_probs_diff_*``): the statistic by hand,
each of the update's three log-prob paths, the ``hf`` engine's ~0, and W = 2 equal to W = 1."""
import copy
import json
import math

import pytest
import torch

from tests.gloo_workers import finish, run_gloo_workers
from tests.verl_core.training.test_ppo_update import _rollout
from verl_core.algorithms import rollout_probs_diff
from verl_core.config import AlgorithmConfig, OptimConfig
from verl_core.training.dist import SINGLE, init_process_group
from verl_core.training.forward import batched_logprobs
from verl_core.training.optim import make_optimizer, make_scheduler
from verl_core.training.ppo import UpdateOptions, ppo_update

KEYS = ("max", "mean", "std")


def test_stats_by_hand_with_holes_in_the_mask():
    p_train = torch.tensor([[0.5, 0.2, 0.9], [0.95, 0.4, 0.3]])
    p_rollout = torch.tensor([[0.4, 0.2, 0.1], [0.05, 0.4, 0.6]])
    mask = torch.tensor([[1, 0, 1], [0, 1, 1]])
    rollout_logp = p_rollout.log()
    rollout_logp[0, 1] = float("nan")  # padding may hold anything: it must not leak
    m = rollout_probs_diff(p_train.log(), rollout_logp, mask)
    # valid d = |0.5-0.4|, |0.9-0.1|, |0.4-0.4|, |0.3-0.6| = 0.1, 0.8, 0, 0.3; the hole at [1, 0]
    # has the largest d (0.9) and must not be the max
    # mean = 1.2 / 4 = 0.3; deviations -0.2, 0.5, -0.3, 0: Σ² = 0.04 + 0.25 + 0.09 = 0.38
    # unbiased std = sqrt(0.38 / 3)
    assert m["rollout_probs_diff_max"].item() == pytest.approx(0.8, abs=1e-7)
    assert m["rollout_probs_diff_mean"].item() == pytest.approx(0.3, abs=1e-7)
    assert m["rollout_probs_diff_std"].item() == pytest.approx(math.sqrt(0.38 / 3), abs=1e-7)
    # (float32 inputs: p = exp(log p) is p to ~1 ulp, 6e-8; 1e-7 is that)


@pytest.mark.parametrize("seed", range(3))
def test_stats_match_verls_masked_select_and_torch_std(seed):
    g = torch.Generator().manual_seed(seed)
    train, rollout = -torch.rand(2, 5, 7, generator=g, dtype=torch.float64) * 4
    mask = torch.rand(5, 7, generator=g) < 0.6
    m = rollout_probs_diff(train, rollout, mask)
    d = torch.masked_select((train.exp() - rollout.exp()).abs(), mask)  # verl's way
    for k, ref in zip(KEYS, (d.max(), d.mean(), d.std())):
        assert m[f"rollout_probs_diff_{k}"].item() == pytest.approx(ref.item(), rel=1e-12), k


def test_empty_and_single_token_masks_give_zero_not_nan():
    logp = torch.log(torch.tensor([[0.5, 0.25]]))
    empty = rollout_probs_diff(logp, logp - 1, torch.zeros(1, 2))
    assert all(v.item() == 0.0 for v in empty.values())
    one = rollout_probs_diff(logp, torch.log(torch.tensor([[0.25, 0.25]])), torch.tensor([[1, 0]]))
    assert one["rollout_probs_diff_max"].item() == pytest.approx(0.25)
    assert one["rollout_probs_diff_std"].item() == 0.0  # verl's torch.std would say NaN


def test_shape_mismatch_is_refused():
    with pytest.raises(ValueError, match="share one"):
        rollout_probs_diff(torch.zeros(2, 3), torch.zeros(2, 4), torch.ones(2, 3))


# ------------------------------------------------------------------ the update's three paths
PATHS = {  # name -> ppo_update arguments
    "recompute": dict(epochs=2, mini_batch_rows=16),  # epoch 2 runs after a step: old_logp first
    "reuse_logp": dict(epochs=1, mini_batch_rows=16),  # exactly on-policy: the update's forward
    "bypass": dict(epochs=2, mini_batch_rows=8, algo=AlgorithmConfig(policy_loss="bypass_mode")),
}


def _update(model, batch, *, epochs, mini_batch_rows, algo=None, dp=SINGLE, seed=0):
    cfg = OptimConfig(lr=1e-2, warmup_steps=0)
    opt = make_optimizer(model.parameters(), cfg, cfg.lr)
    return ppo_update(model, opt, make_scheduler(opt, cfg, 10), batch,
                      UpdateOptions(algo=algo or AlgorithmConfig(), temperature=1.0,
                                    mini_batch_rows=mini_batch_rows, micro_batch_rows=4,
                                    epochs=epochs, grad_clip=1e9),
                      seed=seed, dp=dp)


def _diff(m) -> dict[str, float]:
    return {k: m[f"training/rollout_probs_diff_{k}"] for k in KEYS}


def _moved(model, scale=0.2, seed=1):
    """A copy of ``model`` with every weight moved by N(0, scale²): a rollout that used other
    weights than the trainer's (a stale or wrongly synced engine)."""
    moved = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in moved.parameters():
            p.add_(scale * torch.randn(p.shape, generator=g))
    return moved


# Same weights, same float32 kernels, other batch shapes (the engine decodes one token at a time
# against its KV cache, the trainer runs whole sequences): the logits differ only by rounding, a
# few ulp (u = 6e-8) of their magnitude accumulated over the layers, ~1e-6 at most.
# |Δ log-softmax| <= 2·max|Δ logit|, and |e^a - e^b| <= max(e^a, e^b)·|a - b| (mean value
# theorem), so d <= 2·p·max|Δ logit| <= 2·max|Δ logit| ~ 1e-6, two orders under the 1e-4
# bar (measured: 6.8e-9 on the tiny model, whose sampled tokens have p <= 0.024).
SAME_WEIGHTS_BAR = 1e-4


@pytest.mark.parametrize("path", sorted(PATHS))
def test_each_path_reports_the_mismatch_tiny_for_hf_and_large_for_other_weights(path):
    model, batch = _rollout()  # the hf engine, float32 on CPU, the trainer's weights
    kw = PATHS[path]
    same = _diff(_update(copy.deepcopy(model), batch, **kw))
    assert 0.0 <= same["max"] <= SAME_WEIGHTS_BAR, same
    assert same["mean"] <= same["max"] and same["std"] <= same["max"]

    # the trainer's weights are not the rollout's: the metric must see it, on the right rows
    trainer = _moved(model)
    got = _diff(_update(copy.deepcopy(trainer), batch, **kw))
    N = batch.num_rows
    rows = torch.arange(N)
    if path == "bypass":  # the first mini-batch of epoch 0 only (ppo_update's order, seed 0)
        rows = torch.randperm(N, generator=torch.Generator().manual_seed(0))[:kw["mini_batch_rows"]]
    ref = {k.removeprefix("rollout_probs_diff_"): float(v) for k, v in rollout_probs_diff(
        batched_logprobs(trainer, batch, 1.0, N)[rows], batch.response_logprobs[rows],
        batch.response_mask[rows]).items()}
    assert ref["max"] > 100 * SAME_WEIGHTS_BAR, ref  # far above the same-weights bar
    # the update's forward and the reference one differ by the same rounding as above
    for k in KEYS:
        assert abs(got[k] - ref[k]) <= SAME_WEIGHTS_BAR, (k, got, ref)
    if path == "bypass":  # and the rows measured are the first mini-batch's, not all of them
        all_rows = rollout_probs_diff(batched_logprobs(trainer, batch, 1.0, N),
                                      batch.response_logprobs, batch.response_mask)
        assert any(abs(float(all_rows[f"rollout_probs_diff_{k}"]) - ref[k]) > 10 * SAME_WEIGHTS_BAR
                   for k in KEYS)


# ------------------------------------------------------------------ W = 2 workers (gloo, 2 processes)
def _worker(rank: int, world: int, init: str, out: str) -> None:
    """One of W processes: the same rollout and moved trainer as the test, each path's metrics
    with this worker's block of every mini-batch (plain models: the metric is read before the
    first optimizer step, so no gradient all-reduce is needed for it)."""
    torch.set_num_threads(1)
    dp = init_process_group("gloo", init, rank, world, 120.0)
    model, batch = _rollout()
    trainer = _moved(model)
    res = {p: _diff(_update(copy.deepcopy(trainer), batch, dp=dp, **PATHS[p])) for p in PATHS}
    if rank == 0:
        with open(out, "w") as f:
            json.dump(res, f)
    finish()


def test_two_workers_report_the_numbers_of_one(tmp_path):
    out = tmp_path / "w2.json"
    run_gloo_workers("tests.verl_core.training.test_rollout_probs_diff", "_worker", tmp_path, out)
    w2 = json.loads(out.read_text())
    # W = 1 here with the workers' one thread: a float32 GEMM's rounding may depend on how many
    # threads split it (it does on AMD EPYC), and the comparison below is to float64 rounding
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model, batch = _rollout()
        trainer = _moved(model)
        w1s = {path: _diff(_update(copy.deepcopy(trainer), batch, **kw))
               for path, kw in PATHS.items()}
    finally:
        torch.set_num_threads(threads)
    for path, w1 in w1s.items():
        # each worker's micro-batches are W = 1's (4 rows each, the same rows in the same order),
        # and the statistic is taken once over the gathered rows: equal up to the float64
        # reductions' rounding (exactly on-policy, the workers' own maxima are 0.27 and 0.048:
        # their mean, 0.16, is what averaging the workers' metrics would report)
        for k in KEYS:
            assert w2[path][k] == pytest.approx(w1[k], rel=1e-12, abs=1e-15), (path, k, w2, w1)


# ------------------------------------------------------------------ where it is reported
@pytest.mark.slow
def test_every_update_step_reaches_the_metrics_table_and_both_trackers(tracked_run):
    """The shared real run (tests/verl_core/conftest.py: the workflow's phases, hf engine,
    float32): every update's record carries the three keys, within the same-weights bar, in the
    metrics table, TensorBoard and MLflow (test_tracking.py checks that the trackers hold every
    column; this names the columns)."""
    from tests.verl_core.test_tracking import _mlflow, _only_run, _tensorboard

    keys = [f"training/rollout_probs_diff_{k}" for k in KEYS]
    table = tracked_run.table
    updates = table[table["step"] >= 1]
    assert len(updates) == tracked_run.steps
    for k in keys:
        values = updates[k].tolist()
        assert all(0.0 <= v <= SAME_WEIGHTS_BAR for v in values), (k, values)
    spec = tracked_run.spec
    tb = _tensorboard(f"{tracked_run.tensorboard_dir}/tracked-{spec.trajectory_hash[:8]}")
    ml = _mlflow(tracked_run.mlflow_uri, _only_run(tracked_run.mlflow_uri).info.run_id, keys)
    steps = set(range(1, tracked_run.steps + 1))
    for k in keys:
        assert set(tb[k]) == steps and set(ml[k]) == steps, k
