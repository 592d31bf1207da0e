"""The LM head only where it is needed (issue 23 item 2): training's log-probs, entropy and Σπ²
from the LM head run in checkpointed chunks of the response positions' hidden states (no
[rows, T, V] tensor in forward or backward), and the rollout prefill's last position, equal the
old full-logits computation up to float32 rounding, gradients too, on the Qwen (tied) and Llama
(untied) stand-ins, under FSDP2 with W = 2 as with W = 1, and stay deterministic.

Tolerance. Old and new compute each logit as the same float32 dot product h . w over H terms,
possibly summed in another order (a gemm over P + T positions vs over T). Each is within
gamma_H * sum_i |h_i| |w_i| of the exact value (Higham, Accuracy and Stability of Numerical
Algorithms, 3.1; gamma_H = H u / (1 - H u), u = 2^-24), so two of them differ by at most
delta = 2 gamma_H max_{pos, v} (|h| . |w_v|) / temperature. logp = x_y - logsumexp(x) moves by at
most 2 delta through its inputs; entropy H = lse(x) - sum_v p_v x_v has d H / d x_v =
-p_v (x_v - E_p[x]), so it moves by at most delta * 2 max|x|. Each side's own rounding of the
log-softmax over V terms adds at most gamma_V (max|x| + |lse|) per side.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import verl_core.training.forward as forward
from tests.gloo_workers import finish, run_gloo_workers
from verl_core.algorithms.utils import entropy_from_logits, logprobs_from_logits
from verl_core.rollout.base import SamplingParams
from verl_core.rollout.hf import generate_with_cache

U = 2.0 ** -24
NUM_THREADS = torch.get_num_threads()
TEMPERATURE = 0.7


def gamma(n: int) -> float:
    return n * U / (1 - n * U)


def tiny_qwen2(vocab=512, seed=0):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(vocab_size=vocab, hidden_size=64, intermediate_size=128,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=64, tie_word_embeddings=False, pad_token_id=0)
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(cfg).float()


class NoLogitsToKeep(nn.Module):
    """The same model behind a forward without ``logits_to_keep``: the old full-logits path."""

    def __init__(self, model):
        super().__init__()
        self.m = model

    def forward(self, input_ids, attention_mask, position_ids, **kw):
        return self.m(input_ids=input_ids, attention_mask=attention_mask,
                      position_ids=position_ids, **kw)


def rows(vocab=512, n=5, P=6, T=7, seed=1):
    """Left-padded prompts and right-padded responses of different lengths."""
    g = torch.Generator().manual_seed(seed)
    p_ids = torch.randint(1, vocab, (n, P), generator=g)
    r_ids = torch.randint(1, vocab, (n, T), generator=g)
    p_len = torch.tensor([P, 3, 1, P - 1, 2][:n])
    r_len = torch.tensor([T, 1, 4, T - 2, 3][:n])
    p_mask = (torch.arange(P) >= P - p_len[:, None]).long()
    r_mask = (torch.arange(T) < r_len[:, None]).float()
    return p_ids * p_mask, p_mask, r_ids * r_mask.long(), r_mask


def old_computation(model, p_ids, p_mask, r_ids, r_mask, temperature):
    """The pre-fix code: logits over every position, sliced, divided, log-softmax + entropy."""
    ids, attn, position, P = forward._inputs(p_ids, p_mask, r_ids, r_mask)
    out = model(input_ids=ids, attention_mask=attn, position_ids=position,
                output_hidden_states=True)
    logits = out.logits[:, P - 1:-1].float() / temperature  # (n, T, V)
    logp = logprobs_from_logits(logits, r_ids) * r_mask
    ent = entropy_from_logits(logits) * r_mask
    with torch.no_grad():
        h = out.hidden_states[-1][:, P - 1:-1]  # (n, T, H): the LM head's input
        w = model.get_output_embeddings().weight  # (V, H)
        delta = 2 * gamma(h.shape[-1]) * (h.abs() @ w.abs().T).max() / temperature
        lse = torch.logsumexp(logits, -1).abs().max()
        xmax = logits.abs().max()
    return logp, ent, float(delta), float(xmax), float(lse)


def tolerances(delta, xmax, lse, V):
    own = 2 * gamma(V) * (xmax + lse)  # each side's log-softmax rounding
    return 2 * delta + own, 2 * delta * xmax + own


def test_logprobs_and_entropy_equal_the_full_logits_computation(monkeypatch):
    model = tiny_qwen2()
    batch = rows()
    with torch.no_grad():
        logp0, ent0, delta, xmax, lse = old_computation(model, *batch, TEMPERATURE)
    tol_logp, tol_ent = tolerances(delta, xmax, lse, 512)
    # 35 positions in chunks of 8 rows: several chunks and a short last one
    monkeypatch.setattr(forward, "_CHUNK_ELEMENTS", 8 * 512)
    for grad in (False, True):
        with torch.set_grad_enabled(grad):
            logp, ent = forward.response_logprobs(model, *batch, TEMPERATURE, with_entropy=True)
        assert (logp - logp0).abs().max() <= tol_logp
        assert (ent - ent0).abs().max() <= tol_ent
        assert logp[batch[3] == 0].eq(0).all() and ent[batch[3] == 0].eq(0).all()
    # the model without logits_to_keep takes the full-logits path and agrees too
    with torch.no_grad():
        logp, ent = forward.response_logprobs(NoLogitsToKeep(model), *batch, TEMPERATURE, True)
    assert (logp - logp0).abs().max() <= tol_logp and (ent - ent0).abs().max() <= tol_ent


def test_checkpointed_chunks_give_the_gradients_of_the_unchunked_loss(monkeypatch):
    """Backward through the checkpointed chunks recomputes each chunk's softmax: the gradient is
    the one of the same loss computed in one piece (same ops on the same logits, so bit-equal
    up to the chunk-wise reduction order of the head's own input gradient; both are float32
    gemms over n*T rows, compared within gamma_{nT} relative to the summed magnitudes)."""
    model = tiny_qwen2()
    batch = rows()
    r_mask = batch[3]

    def grads(chunk_elements):
        monkeypatch.setattr(forward, "_CHUNK_ELEMENTS", chunk_elements)
        model.zero_grad()
        logp, ent = forward.response_logprobs(model, *batch, TEMPERATURE, with_entropy=True)
        ((logp * r_mask).sum() + 0.1 * (ent * r_mask).sum()).backward()
        return {k: p.grad.clone() for k, p in model.named_parameters()}

    whole, chunked = grads(1 << 30), grads(8 * 512)
    nT = int(r_mask.numel())
    for k in whole:
        scale = whole[k].abs().max() + chunked[k].abs().max()
        assert (whole[k] - chunked[k]).abs().max() <= 4 * gamma(nT * 64) * scale + 1e-30, k


def test_training_forward_is_deterministic(monkeypatch):
    monkeypatch.setattr(forward, "_CHUNK_ELEMENTS", 8 * 512)
    outs = []
    for _ in range(2):
        model = tiny_qwen2()
        batch = rows()
        logp, ent = forward.response_logprobs(model, *batch, TEMPERATURE, with_entropy=True)
        (logp.sum() + ent.sum()).backward()
        outs.append([logp.detach(), ent.detach()] + [p.grad for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*outs))


def test_rollout_prefill_on_the_last_position_samples_what_full_logits_sample():
    model = tiny_qwen2().eval()
    p_ids, p_mask, _, _ = rows()
    params = SamplingParams(temperature=TEMPERATURE, max_new_tokens=6, seed=0)
    u = torch.rand((p_ids.shape[0], 6), generator=torch.Generator().manual_seed(3))
    kw = dict(eos_token_id=511, pad_token_id=0)
    new = generate_with_cache(model, p_ids, p_mask, u, params, **kw)
    old = generate_with_cache(NoLogitsToKeep(model), p_ids, p_mask, u, params, **kw)
    assert torch.equal(new.response_ids, old.response_ids)
    assert torch.equal(new.response_mask, old.response_mask)
    # each sampled log-prob is one log-softmax of logits that differ by at most delta
    with torch.no_grad():
        _, _, delta, xmax, lse = old_computation(model, p_ids, p_mask, new.response_ids,
                                                 new.response_mask, TEMPERATURE)
    assert (new.logprobs - old.logprobs).abs().max() <= tolerances(delta, xmax, lse, 512)[0]


# ------------------------------------------------------------ the LM head itself in chunks
# The stand-ins of the families users bring: Qwen2.5-style with tied embeddings (the head's weight
# is the embedding's, so its gradient has two sources) and Llama-3-style with an untied head
# (stored in bfloat16, loaded in float32 here so the float32 bounds above apply).
FAMILIES = ("qwen_tied", "llama_untied")


@pytest.fixture(scope="module")
def standin_folders(tmp_path_factory):
    from tests.standins import llama3_folder, qwen_folder

    root = tmp_path_factory.mktemp("standins")
    return {"qwen_tied": qwen_folder(root / "qwen"), "llama_untied": llama3_folder(root / "llama")}


def load_standin(folder):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)


class LargestVocabTensor(TorchDispatchMode):
    """Records the most rows any op's output with a vocabulary-sized last dimension has (logits,
    their softmax, their gradient), in forward and in backward's recomputation alike; the head's
    weight-gradient gemm (H, V) is weight-shaped, not logits, and is left out."""

    def __init__(self, model):
        super().__init__()
        self.vocab, hidden = model.get_output_embeddings().weight.shape
        self.weight_shapes = {(self.vocab, hidden), (hidden, self.vocab)}
        self.rows = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in (out if isinstance(out, (tuple, list)) else (out,)):
            if (isinstance(t, torch.Tensor) and t.dim() and t.shape[-1] == self.vocab
                    and tuple(t.shape) not in self.weight_shapes):
                self.rows = max(self.rows, t.numel() // self.vocab)
        return out


def old_grads(model, batch, temperature):
    """Parameter gradients of the test loss under the pre-fix full-logits computation."""
    model.zero_grad()
    logp, ent, *_ = old_computation(model, *batch, temperature)
    (logp.sum() + 0.1 * ent.sum()).backward()
    return {k: p.grad.clone() for k, p in model.named_parameters()}


def grad_tolerance(whole, part, k):
    """Two float32 evaluations of the same gradient whose sums run in other orders (the head's
    gemm over H, its weight gradient over the rows, per chunk or at once): each within gamma_k of
    the exact value relative to the summed magnitudes, bounded here by the larger max |grad|."""
    return 4 * gamma(k) * (whole.abs().max() + part.abs().max()) + 1e-30


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("temperature", [TEMPERATURE, 1.0])
def test_head_in_chunks_gives_the_full_logits_values_and_gradients(standin_folders, family,
                                                                   temperature, monkeypatch):
    """The real stand-in models (tied and untied heads, at a temperature and at 1.0): the head
    runs on chunks of 8 rows, no tensor with a vocabulary-sized last dimension ever has more than
    8 rows (the pre-fix code formed all n * T = 35 at once), and log-probs, entropy and every
    parameter's gradient equal the full-logits computation's within the float32 bounds."""
    model = load_standin(standin_folders[family])
    V = model.get_output_embeddings().weight.shape[0]
    batch = rows(vocab=V)
    r_mask = batch[3]
    with torch.no_grad():
        logp0, ent0, delta, xmax, lse = old_computation(model, *batch, temperature)
    tol_logp, tol_ent = tolerances(delta, xmax, lse, V)
    want = old_grads(model, batch, temperature)
    monkeypatch.setattr(forward, "_CHUNK_ELEMENTS", 8 * V)
    model.zero_grad()
    with LargestVocabTensor(model) as seen:
        logp, ent = forward.response_logprobs(model, *batch, temperature, with_entropy=True)
        (logp.sum() + 0.1 * ent.sum()).backward()
    assert seen.rows == 8, seen.rows
    assert type(model) not in forward._HEAD_NOT_LAST
    assert (logp - logp0).abs().max() <= tol_logp and (ent - ent0).abs().max() <= tol_ent
    assert logp[r_mask == 0].eq(0).all() and ent[r_mask == 0].eq(0).all()
    k = int(r_mask.numel()) * model.config.hidden_size
    for name, p in model.named_parameters():
        assert (p.grad - want[name]).abs().max() <= grad_tolerance(want[name], p.grad, k), name
    # without grad (old and reference log-probs) and Σ π² take the same chunked head
    with torch.no_grad(), LargestVocabTensor(model) as seen:
        logp_ng, _ = forward.response_logprobs(model, *batch, temperature)
    assert seen.rows == 8 and torch.equal(logp_ng, logp.detach())


def test_sum_pi_squared_in_chunks_equals_the_full_softmax(standin_folders, monkeypatch):
    """Σ_v π_v² from chunks of the head equals the sum of the full softmax squared: both take
    the same float32 logits up to delta; Σ π² = exp(lse(2x) - 2 lse(x)) moves by at most
    exp(4 delta) - 1 relative through them, plus each side's rounding over V terms."""
    from verl_core.data.batch import Batch

    model = load_standin(standin_folders["qwen_tied"])
    V = model.get_output_embeddings().weight.shape[0]
    p_ids, p_mask, r_ids, r_mask = rows(vocab=V)
    n, T = r_ids.shape
    batch = Batch(prompt_ids=p_ids, prompt_mask=p_mask, response_ids=r_ids, response_mask=r_mask,
                  response_logprobs=torch.zeros(n, T), group=torch.arange(n),
                  uid=[str(i) for i in range(n)], ground_truth=[""] * n, data_source=[""] * n,
                  extra_info=[{}] * n)
    with torch.no_grad():
        ids, attn, position, P = forward._inputs(p_ids, p_mask, r_ids, r_mask)
        out = model(input_ids=ids, attention_mask=attn, position_ids=position,
                    output_hidden_states=True)
        want = (torch.softmax(out.logits[:, P - 1:-1] / TEMPERATURE, -1) ** 2).sum(-1) * r_mask
        _, _, delta, xmax, lse = old_computation(model, p_ids, p_mask, r_ids, r_mask, TEMPERATURE)
    monkeypatch.setattr(forward, "_CHUNK_ELEMENTS", 8 * V)
    with LargestVocabTensor(model) as seen:
        got = forward.batched_sum_pi_squared(model, batch, TEMPERATURE, n)
    assert seen.rows == 8
    rel = math.expm1(4 * delta + 8 * gamma(V) * (xmax + lse))
    assert ((got - want).abs() <= rel * want + 1e-30).all()


class ScaledHead(nn.Module):
    """A model whose forward rescales the head's output (as Cohere's logit scale, Gemma's soft
    cap): the head's result is not what it returns, so the chunked head must not be used."""

    def __init__(self, model, scale=0.5):
        super().__init__()
        self.m, self.scale = model, scale

    def get_output_embeddings(self):
        return self.m.get_output_embeddings()

    def forward(self, input_ids, attention_mask, position_ids, logits_to_keep=0):
        out = self.m(input_ids=input_ids, attention_mask=attention_mask,
                     position_ids=position_ids, logits_to_keep=logits_to_keep)
        out.logits = out.logits * self.scale
        return out


def test_a_forward_that_changes_the_head_output_takes_the_full_logits_path(standin_folders):
    model = load_standin(standin_folders["llama_untied"])
    batch = rows(vocab=model.config.vocab_size)
    scaled = ScaledHead(model)
    with torch.no_grad():
        # the scale before the softmax is a temperature of 1 / scale on the plain model
        want, want_ent, delta, xmax, lse = old_computation(model, *batch, 1 / scaled.scale)
        got, ent = forward.response_logprobs(scaled, *batch, 1.0, with_entropy=True)
    assert ScaledHead in forward._HEAD_NOT_LAST
    tol_logp, tol_ent = tolerances(delta, xmax, lse, model.config.vocab_size)
    assert (got - want).abs().max() <= tol_logp and (ent - want_ent).abs().max() <= tol_ent
    assert type(model) not in forward._HEAD_NOT_LAST


# ------------------------------------------------------------ W = 2 workers (FSDP2 over gloo)
BLOCKS = (slice(0, 3), slice(3, 5))  # the 5 rows split unevenly, worker r gets BLOCKS[r]


def _blocks_run(model, vocab, block):
    """No-grad log-probs, then log-probs and entropy with grad (the test loss's backward) of one
    block of ``rows``, the head in chunks of 4 rows: the trainer's order (old log-probs, then the
    update; under FSDP2 a forward after the backward would leave the root's unsharded
    parameters, without the gradients, registered until its next backward)."""
    forward._CHUNK_ELEMENTS = 4 * vocab
    batch = [b[block] for b in rows(vocab=vocab)]
    with torch.no_grad():
        logp_ng, _ = forward.response_logprobs(model, *batch, TEMPERATURE)
    logp, ent = forward.response_logprobs(model, *batch, TEMPERATURE, with_entropy=True)
    (logp.sum() + 0.1 * ent.sum()).backward()
    return logp_ng, logp.detach(), ent.detach()


def _fsdp_worker(rank: int, world: int, init: str, folders: str, out: str) -> None:
    """One of W processes: each stand-in ``shard``-ed (FSDP2: each decoder layer, then the root
    that holds the embedding and the head), this worker's block through the chunked head, the
    loss's backward (FSDP2 sums the gradients over workers), then every parameter's full
    gradient and every worker's values gathered; rank 0 writes them."""
    import torch.distributed as dist

    from verl_core.training.dist import init_process_group
    from verl_core.training.sharding import shard

    torch.set_num_threads(1)
    init_process_group("gloo", init, rank, world, 120.0)
    res = {}
    for family, folder in json.loads(folders).items():
        model = shard(load_standin(folder))
        vocab = model.get_output_embeddings().weight.shape[0]
        mine = _blocks_run(model, vocab, BLOCKS[rank])
        grads = {k: p.grad.full_tensor() for k, p in model.named_parameters()}
        values = [None] * world
        dist.all_gather_object(values, mine)
        res[family] = {"values": [torch.cat(v, 0) for v in zip(*values)], "grads": grads,
                       "chunked": type(model) not in forward._HEAD_NOT_LAST}
    if rank == 0:
        torch.save(res, out)
    finish()


@pytest.mark.slow
def test_two_fsdp2_workers_give_the_values_and_gradients_of_one(standin_folders, tmp_path,
                                                                monkeypatch):
    """The chunked head runs inside the root module's forward, so FSDP2 has the root's
    parameters (embedding, head, tied or not) unsharded when the head's chunks run and when
    backward recomputes them. Each worker's block is what W = 1 computes in two calls, and
    FSDP2's reduce-scatter adds the two blocks' gradients as W = 1's accumulation does: equal
    to W = 1 bit for bit."""
    out = tmp_path / "w2.pt"
    folders = json.dumps({k: str(v) for k, v in standin_folders.items()})
    run_gloo_workers("tests.verl_core.training.test_response_logits", "_fsdp_worker", tmp_path,
                     folders, out)
    w2 = torch.load(out)
    monkeypatch.setattr(forward, "_CHUNK_ELEMENTS", forward._CHUNK_ELEMENTS)  # restored after
    for family, folder in standin_folders.items():
        model = load_standin(folder)
        vocab = model.get_output_embeddings().weight.shape[0]
        torch.set_num_threads(1)
        try:
            w1 = [torch.cat(v, 0) for v in zip(*(_blocks_run(model, vocab, b) for b in BLOCKS))]
        finally:
            torch.set_num_threads(NUM_THREADS)
        assert w2[family]["chunked"], family
        for got, want in zip(w2[family]["values"], w1):
            assert torch.equal(got, want), family
        for name, p in model.named_parameters():
            assert torch.equal(w2[family]["grads"][name], p.grad), (family, name)
