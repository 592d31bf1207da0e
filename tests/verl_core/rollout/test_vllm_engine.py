"""The ``vllm`` rollout engine for real: its log-probs against the trainer's forward, weight
refreshes (the checksum reads the weights the kernels use), sleep/wake. Runs wherever vLLM runs:
vLLM's CPU backend in ``.venv-vllm`` (``bash .ci/install vllm``; ``.ci/run`` runs it), or CUDA
with ``pip install -e '.[vllm]'``; skipped otherwise (tests/conftest.py). The engine's pure
helpers are in test_vllm_cpu.py.

The tiny model is the tests' usual one (build_tiny_model), widened to head_dim 64 (hidden 256,
4 heads), a head size every vLLM attention backend supports, and served in float32 so the
comparison with the trainer's forward can be tight.
"""
import copy
import gc
import threading

import pytest
import torch

from verl_core.models import build_tiny_model
from verl_core.rollout.vllm import on_cpu_backend
from verl_core.rollout import SamplingParams, make_engine
from verl_core.training.forward import response_logprobs

pytestmark = pytest.mark.vllm

PROMPTS = ["12+7=", "3-1=", "29+30=", "1+1=", "40+2=", "7-7="] * 2
# Tolerance on a log-prob, vLLM (float32) against the float64 forward of the same weights. The
# reference's own error is ~1e-15. On CUDA vLLM's float32 attention may take TF32 dot products
# (Triton's default on fp32 inputs: 10-bit mantissa, unit roundoff u = 2^-11 ≈ 4.9e-4). Each
# attention score of this model is a 64-term dot product of O(1) normalised entries, so its
# relative error is ≲ u; the resulting logit errors, through two layers, are ≲ 2u ≈ 1e-3, and a
# log-prob (log-softmax of logits) moves by at most twice the largest logit error: 2e-3. On CPU
# the kernels are plain float32 (u = 2^-24 ≈ 6e-8): the longest sum is the MLP's 1024-term dot
# product, whose worst-case relative error is 1024 u ≈ 6e-5 (typically sqrt(1024) u ≈ 2e-6), so
# 1e-4 bounds a logit's error and with it, within a factor of two, a log-prob's.
TOL = 1e-4 if on_cpu_backend() else 2e-3
DEVICE = "cpu" if on_cpu_backend() else "cuda"


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    model, tok = build_tiny_model(hidden_size=256, heads=4, layers=2, seed=0)
    path = tmp_path_factory.mktemp("tiny-hf")
    model.save_pretrained(path, safe_serialization=True)
    tok.save_pretrained(path)
    model = model.to(DEVICE)
    eng = make_engine("vllm", model_path=str(path), model=model, eos_token_id=tok.eos_token_id,
                      pad_token_id=tok.pad_token_id, dtype="float32",
                      gpu_memory_utilization=0.3, cpu_kv_cache_gib=0.25, enforce_eager=True,
                      free_cache_engine=True, seed=0)
    enc = tok(PROMPTS, return_tensors="pt", padding=True)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    yield model, tok, enc.input_ids, enc.attention_mask, eng, state
    del eng
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _reference_logprobs(model, ids, mask, out, temperature):
    """The trainer's forward (what the hf engine and the update compute), in float64 on CPU."""
    ref = copy.deepcopy(model).double().cpu()
    lp, _ = response_logprobs(ref, ids, mask, out.response_ids, out.response_mask, temperature)
    return lp.float()


@pytest.mark.parametrize("temperature,top_p,top_k", [
    (0.7, 1.0, -1),  # vLLM's own processed log-probs: softmax(logits / 0.7)
    (0.0, 1.0, -1),  # greedy: reported under softmax(logits), as the hf engine does
    (1.0, 0.8, 5),  # filtered: recomputed by the engine before top-k/top-p
])
def test_logprobs_of_sampled_tokens_match_the_trainers_forward(setup, temperature, top_p, top_k):
    model, tok, ids, mask, eng, _ = setup
    out = eng.generate(ids, mask, SamplingParams(temperature=temperature, top_p=top_p,
                                                 top_k=top_k, max_new_tokens=6, seed=3))
    assert out.response_ids.shape == out.logprobs.shape == out.response_mask.shape
    assert out.response_ids.shape[0] == len(PROMPTS)
    m = out.response_mask.bool()
    ref = _reference_logprobs(model, ids, mask, out, temperature or 1.0)
    assert (out.logprobs - ref).abs()[m].max().item() <= TOL
    assert torch.all(out.logprobs[~m] == 0) and torch.all(out.response_ids[~m] == tok.pad_token_id)
    # each row's mask is a prefix of ones that ends on its EOS, or at max_new_tokens without one
    lengths, cols = m.sum(-1), torch.arange(m.shape[1])
    assert torch.equal(m, cols < lengths[:, None])
    eos = out.response_ids == tok.eos_token_id
    assert not (eos & (cols < (lengths - 1)[:, None])).any()  # no EOS before a row's last token
    short = lengths < 6
    assert torch.all(out.response_ids[short, lengths[short] - 1] == tok.eos_token_id)


def test_seeded_sampling_is_reproducible(setup):
    model, tok, ids, mask, eng, _ = setup
    p = SamplingParams(temperature=1.0, max_new_tokens=6, seed=11)
    a, b = eng.generate(ids, mask, p), eng.generate(ids, mask, p)
    c = eng.generate(ids, mask, SamplingParams(temperature=1.0, max_new_tokens=6, seed=12))
    assert torch.equal(a.response_ids, b.response_ids)
    assert not torch.equal(a.response_ids, c.response_ids)


def test_row_blocks_at_their_offsets_draw_what_one_call_draws(setup):
    """What a worker's share of a rollout and a sampled evaluation's forward passes rely on:
    rows generated in blocks, each with its ``first_row`` in the whole, get the tokens one call
    over all the rows gets (each row's vLLM seed is its global row's)."""
    from verl_core.rollout.base import concat_outputs

    model, tok, ids, mask, eng, _ = setup
    p = SamplingParams(temperature=1.0, top_p=0.7, max_new_tokens=6, seed=5)
    whole = eng.generate(ids, mask, p)
    n = ids.shape[0]
    parts = concat_outputs([eng.generate(ids[s:e], mask[s:e], p, first_row=s, total_rows=n)
                            for s, e in ((0, 5), (5, n))], tok.pad_token_id)
    assert torch.equal(parts.response_ids, whole.response_ids)


def test_rows_draw_from_their_own_seeds_and_stop_at_their_own_limits(setup):
    """What multi-turn rollouts rely on (rows at different turns, each with its (row, turn)
    seed and what is left of its budget)."""
    from tests.engine_contract import assert_rows_draw_from_their_own_seeds_and_limits
    model, tok, ids, mask, eng, _ = setup
    assert_rows_draw_from_their_own_seeds_and_limits(eng, ids, mask, tok.pad_token_id)


def test_a_seeded_batch_larger_than_one_scheduler_step_samples(setup):
    """Prompts whose prefill outgrows one scheduler step (256 rows of ~57 tokens: ~14k tokens),
    sampled with per-row seeds: what the later turns of a multi-turn rollout send. vLLM 0.32's
    CPU backend failed this with chunked prefill ("CPU Generator does not use offset")."""
    model, tok, _, _, eng, _ = setup
    enc = tok([f"{i:03d}+{i:03d}=" * 7 for i in range(256)], return_tensors="pt", padding=True)
    assert int(enc.attention_mask.sum()) > 8192
    p = SamplingParams(temperature=1.0, max_new_tokens=4, seed=2)
    out = eng.generate(enc.input_ids, enc.attention_mask, p, row_seeds=list(range(256)))
    again = eng.generate(enc.input_ids[:4], enc.attention_mask[:4], p, row_seeds=list(range(4)))
    assert out.response_ids.shape[0] == 256
    assert torch.equal(again.response_ids, out.response_ids[:4, :again.response_ids.shape[1]])


def test_a_weight_refresh_changes_greedy_samples_and_refreshing_back_restores_them(setup):
    model, tok, ids, mask, eng, state = setup
    greedy = SamplingParams(temperature=0.0, max_new_tokens=6)
    before, checksum = eng.generate(ids, mask, greedy), eng.weights_checksum()
    # the final norm's weight negated: every logit is negated exactly, so each row's first
    # greedy token becomes its argmin instead of its argmax
    flipped = {**state, "model.norm.weight": -state["model.norm.weight"]}
    eng.load_weights(flipped)
    assert eng.weights_checksum() != checksum
    after = eng.generate(ids, mask, greedy)
    assert (after.response_ids[:, 0] != before.response_ids[:, 0]).all()
    # one projection alone: on vLLM's CPU backend the linear weights live repacked in the GEMM
    # kernel's layout (their parameters are empty), so only a checksum of what the kernels
    # apply sees this change
    scaled = {**state, "model.layers.0.self_attn.q_proj.weight":
              state["model.layers.0.self_attn.q_proj.weight"] * 1.5}
    eng.load_weights(scaled)
    assert eng.weights_checksum() != checksum
    eng.load_weights(state)
    assert eng.weights_checksum() == checksum  # bit-identical weights again
    back = eng.generate(ids, mask, greedy)
    assert torch.equal(back.response_ids, before.response_ids)
    assert torch.equal(back.response_mask, before.response_mask)


def test_a_load_from_a_thread_computing_with_another_thread_count_serves_the_same_weights(setup):
    # OpenMP's thread count is per thread: a thread started after the trainer set its count (the
    # background rollout of rollout.max_staleness) begins with the runtime's default, the host's
    # core count. vLLM's CPU backend repacks the linear weights on every load; on a 2-core AVX2
    # host a load under another count than the engine's build served wrong q/k/v weights (every
    # column of the fused projection, by up to 0.2), and a background rollout sampled from them.
    # The engine gives every call the count it was built with, whichever thread makes it
    model, tok, ids, mask, eng, state = setup
    eng.load_weights(state)
    checksum = eng.weights_checksum()
    q = "model.layers.0.self_attn.q_proj.weight"
    eng.load_weights({**state, q: state[q] * 1.5})  # so the thread's load changes them back
    threads = torch.get_num_threads()

    def elsewhere():
        torch.set_num_threads(threads + 1)
        eng.load_weights(state)

    try:
        t = threading.Thread(target=elsewhere)
        t.start()
        t.join()
    finally:
        torch.set_num_threads(threads)
    assert eng.weights_checksum() == checksum


def test_sleep_and_wake_keep_generation_identical(setup):
    model, tok, ids, mask, eng, state = setup
    p = SamplingParams(temperature=1.0, max_new_tokens=6, seed=5)
    a = eng.generate(ids, mask, p)
    # free_cache_engine: asleep after each generate where the platform has sleep mode (CUDA);
    # vLLM's CPU backend has none, so the engine stays awake and says it keeps its memory
    assert eng.sleep_level == (1 if eng.sleep_supported else 0)
    assert eng.releases_memory == eng.sleep_supported == (not on_cpu_backend())
    b = eng.generate(ids, mask, p)  # woken from level 1: weights restored from CPU
    eng.sleep(level=2)  # weights discarded ...
    eng.load_weights(state)  # ... and brought back by a refresh, as after an update
    c = eng.generate(ids, mask, p)
    eng.sleep(level=2)
    d = eng.generate(ids, mask, p)  # nobody refreshed: the engine reloads its torch model
    for o in (b, c, d):
        assert torch.equal(o.response_ids, a.response_ids)
        assert torch.allclose(o.logprobs, a.logprobs, atol=1e-6, rtol=0)
