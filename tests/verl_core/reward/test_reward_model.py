"""The model-based reward (``reward_model.enable``): a tiny Llama sequence classifier (one label),
built and saved here with the project's character tokenizer, scores prompt + response in
micro-batches; its score replaces or adds to the rule score; a folder that is not such a model
fails at prepare; and real short runs (plain loop, phase functions) train on it.

Tolerances. Right padding under a causal mask never reaches a real token, so a padded row's score
equals its unpadded forward in exact arithmetic; what differs is only the order in which kernels
of other shapes add up the same products. Reordering a sum of K terms moves it by at most
about K·u·Σ|terms| (u = 2^-53 in float64, 2^-24 in float32); K <= 4·hidden = 128 here and the
activations are O(1) after each RMSNorm, so a float64 score moves by ~1e-14, a float32 one by
~1e-5 (K·u = 8e-6), times a small factor for the two layers. We allow 1e-10 (float64) and 1e-4
(float32), relative to 1 + |score|. Pooling the wrong token or letting padding leak in moves a
score by O(1): the head's weights are drawn with std 1, so scores are O(1) too.
"""

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig, LlamaForCausalLM, LlamaForSequenceClassification

from tests.presets import tiny_run
from verl_core.config import ConfigError, RunConfig, preset, with_overrides
from verl_core.data.batch import Batch
from verl_core.data.dataset import load_prompt_rows, render_prompt
from verl_core.models import load_tokenizer
from verl_core.models.tokenizer import build_char_tokenizer
from verl_core.reward.decode import decode_responses
from verl_core.reward.manager import RewardScorer
from verl_core.reward.model import (RewardModel, RewardModelError, RewardModelLoadError,
                                    check_reward_model)
from verl_core.reward.registry import UnknownDataSourceError
from verl_core.assets import prepare_assets
from verl_core.reward.scoring import score_batch

TOL64, TOL32 = 1e-10, 1e-4  # see the module docstring
TEXTS = ["12+7=19", "3-1=2", "40+40=80<pad>", "1", "9+9=18 and a longer answer, 18", "5-5=0",
         "<bos>7", "31+2=33"]


def build_reward_model(folder, *, num_labels=1, causal=False, chat_template=None, seed=0) -> str:
    """Save a tiny Llama reward model (or, ``causal``, a causal LM) + tokenizer to ``folder``."""
    tok = build_char_tokenizer()
    if chat_template:
        tok.chat_template = chat_template
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=128,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                      max_position_embeddings=128, num_labels=num_labels,
                      pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id,
                      eos_token_id=tok.eos_token_id)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        if causal:
            model = LlamaForCausalLM(cfg)
        else:
            model = LlamaForSequenceClassification(cfg)
            torch.nn.init.normal_(model.score.weight, std=1.0)  # O(1) scores (see docstring)
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="module")
def rm_dir(tmp_path_factory):
    return build_reward_model(tmp_path_factory.mktemp("rm"))


@pytest.fixture(scope="module")
def rm(rm_dir):
    return RewardModel.load(rm_dir)


@pytest.fixture(scope="module")
def rm64(rm_dir):
    out = RewardModel.load(rm_dir)
    out.model.double()
    return out


def direct(rm: RewardModel, text: str, add_special_tokens: bool = True) -> float:
    """The model's own forward of one unpadded row (no attention mask, no batching)."""
    ids = torch.tensor([rm.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"]])
    with torch.no_grad():
        return float(rm.model(input_ids=ids).logits[0, 0])


def close(got, want, tol) -> bool:
    return all(abs(g - w) <= tol * (1 + abs(w)) for g, w in zip(got, want, strict=True))


# ---------------------------------------------------------------- scoring
def test_scores_match_a_direct_forward_of_each_row(rm, rm64):
    want = [direct(rm64, t) for t in TEXTS]
    assert close(rm64.score(TEXTS, micro_batch_size=3), want, TOL64)
    assert close(rm.score(TEXTS, micro_batch_size=3), want, TOL32)  # float32, as it runs
    assert max(abs(w) for w in want) > 0.5 and len({round(w, 3) for w in want}) == len(TEXTS)


def test_micro_batch_size_does_not_change_the_scores(rm, rm64):
    # every micro-batch is padded to the batch's widest row: a row's shapes never change
    for model, tol in ((rm64, TOL64), (rm, TOL32)):
        ref = model.score(TEXTS, micro_batch_size=len(TEXTS))
        for micro in (1, 2, 5):
            assert close(model.score(TEXTS, micro_batch_size=micro), ref, tol), (micro, tol)


def test_input_text_with_and_without_a_chat_template(rm, tmp_path):
    chat = [{"role": "user", "content": "2+2="}]
    # no template: the prompt as the policy saw it, then the response; the tokenizer's BOS first
    assert rm.render(chat, "2+2=", "4") == "2+2=4"
    assert rm.encode(["2+2=4"])[0][0] == rm.tokenizer.bos_token_id
    # a template: the chat plus the response as the assistant's turn, no BOS added on top
    template = "{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{% endfor %}"
    with_template = RewardModel.load(build_reward_model(tmp_path / "t", chat_template=template))
    text = with_template.render(chat, "ignored", "4")
    assert text == "[user]2+2=[assistant]4"
    assert with_template.tokenizer.bos_token_id not in with_template.encode([text])[0]
    assert close(with_template.score([text], micro_batch_size=1),
                 [direct(with_template, text, add_special_tokens=False)], TOL32)


def test_too_long_input_and_non_finite_score_name_the_row(rm_dir):
    short = RewardModel.load(rm_dir, max_length=8)
    with pytest.raises(RewardModelError, match=r"input of row 1 \(uid 7\) has 14 tokens, more "
                                               r"than reward_model.max_length=8; raise"):
        short.score(["12+7=19", "123456789+1=1"], micro_batch_size=2,
                    names=["row 0 (uid 3)", "row 1 (uid 7)"])
    broken = RewardModel.load(rm_dir)
    with torch.no_grad():
        broken.model.score.weight[0, 0] = float("nan")
    with pytest.raises(RewardModelError, match=r"non-finite score \(nan\) for row 0"):
        broken.score(["1"], micro_batch_size=1)


# ---------------------------------------------------------------- combination with the scorer
def _batch(tok, responses, data_source="synthetic/arithmetic", baseline=None):
    """N = len(responses) rows of groups of 2, ground truth "19"; ``baseline``: one greedy
    response per group."""
    def pad(texts):
        rows = [tok.convert_tokens_to_ids(list(t)) + [tok.eos_token_id] for t in texts]
        T = max(map(len, rows))
        ids = torch.full((len(rows), T), tok.pad_token_id)
        for i, r in enumerate(rows):
            ids[i, :len(r)] = torch.tensor(r)
        return ids, (ids != tok.pad_token_id).float()

    n = len(responses)
    ids, mask = pad(responses)
    group = torch.arange(n) // 2
    extra = {}
    if baseline is not None:
        b_ids, b_mask = pad([baseline[g] for g in group.tolist()])
        extra = {"baseline_response_ids": b_ids, "baseline_response_mask": b_mask}
    return Batch(prompt_ids=torch.ones(n, 3, dtype=torch.long), prompt_mask=torch.ones(n, 3),
                 response_ids=ids, response_mask=mask, response_logprobs=torch.zeros(mask.shape),
                 group=group, uid=[str(g) for g in group.tolist()], ground_truth=["19"] * n,
                 data_source=[data_source] * n, extra_info=[{}] * n,
                 pad_id=tok.pad_token_id, **extra)


def test_model_score_replaces_or_adds_to_the_rule_score():
    tok = build_char_tokenizer()
    model = [0.5, -1.25, 2.0, 0.1]  # (N,)
    batch = _batch(tok, ["19", "7", "18", "19"])
    with RewardScorer("auto") as rs:
        added, m = score_batch(batch, rs, tok, model_scores=model, combine="add")
        rule = torch.tensor([1.0, 0.0, 0.0, 1.0])
        assert torch.equal(added.score, rule + torch.tensor(model))  # one float32 addition
        assert m["reward/rule_mean"] == 0.5 and m["reward/model_mean"] == float(
            torch.tensor(model).mean())
        replaced, m = score_batch(batch, rs, tok, model_scores=model, combine="replace")
        assert torch.equal(replaced.score, torch.tensor(model)) and "reward/rule_mean" not in m
        assert m["reward/mean"] == m["reward/model_mean"] and m["reward/timeouts"] == 0.0
        # replace never calls the scorer: a data_source no rule scorer knows is fine there...
        unknown = _batch(tok, ["19", "7", "18", "19"], data_source="hh/rlhf")
        assert torch.equal(score_batch(unknown, rs, tok, model_scores=model)[0].score,
                           torch.tensor(model))
        # ...while add does call it
        with pytest.raises(UnknownDataSourceError):
            score_batch(unknown, rs, tok, model_scores=model, combine="add")


def test_greedy_baseline_is_combined_the_same_way():
    tok = build_char_tokenizer()
    batch = _batch(tok, ["19", "7", "18", "19"], baseline=["19", "4"])  # rule: 1 and 0
    with RewardScorer("auto") as rs:
        out, m = score_batch(batch, rs, tok, model_scores=[0.0] * 4,
                             baseline_model_scores=[0.25, -0.5], combine="add")
        assert out.baseline_score.tolist() == [1.25, 1.25, -0.5, -0.5]
        assert m["reward/baseline_mean"] == 0.375
        out, _ = score_batch(batch, rs, tok, model_scores=[0.0] * 4,
                             baseline_model_scores=[0.25, -0.5])
        assert out.baseline_score.tolist() == [0.25, 0.25, -0.5, -0.5]
        with pytest.raises(ValueError, match="pass baseline_model_scores"):
            score_batch(batch, rs, tok, model_scores=[0.0] * 4)


# ---------------------------------------------------------------- config and folder checks
def test_config_fields_are_validated_and_hashed():
    with pytest.raises(ConfigError, match=r"reward_model.path='': reward_model.enable=True "
                                          r"needs .*; set reward_model.path"):
        with_overrides(RunConfig(), {"reward_model.enable": True})
    with pytest.raises(ConfigError, match=r"reward_model.combine='sum': unknown value; known: "
                                          r"add, replace"):
        with_overrides(RunConfig(), {"reward_model.combine": "sum"})
    with pytest.raises(ConfigError, match=r"reward_model.micro_batch_size=0: must be > 0"):
        with_overrides(RunConfig(), {"reward_model.micro_batch_size": 0})
    base = RunConfig()
    # off: nothing in the section changes the trajectory (nor the hash it had before it existed)
    assert with_overrides(base, {"reward_model.path": "/x", "reward_model.combine": "add"}
                          ).trajectory_hash() == base.trajectory_hash()
    on = with_overrides(base, {"reward_model.enable": True, "reward_model.path": "/x"})
    assert on.trajectory_hash() != base.trajectory_hash()
    # memory knob and length guard: same trajectory; how it combines, which model: not
    same = {"reward_model.micro_batch_size": 3, "reward_model.max_length": 64}
    assert with_overrides(on, same).trajectory_hash() == on.trajectory_hash()
    for k, v in (("reward_model.combine", "add"), ("reward_model.path", "/y"),
                 ("reward_model.dtype", "bfloat16")):
        assert with_overrides(on, {k: v}).trajectory_hash() != on.trajectory_hash(), k


def test_a_folder_that_is_no_one_label_classifier_fails_before_any_work(tmp_path):
    with pytest.raises(RewardModelLoadError, match="no such folder"):
        check_reward_model(str(tmp_path / "missing"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(RewardModelLoadError, match="no config.json"):
        check_reward_model(str(tmp_path / "empty"))
    causal = build_reward_model(tmp_path / "causal", causal=True)
    with pytest.raises(RewardModelLoadError, match=r"not a sequence-classification model "
                                                   r"\(architectures=\['LlamaForCausalLM'\]"):
        check_reward_model(causal)
    with pytest.raises(RewardModelLoadError, match="has num_labels=2; a reward model outputs one"):
        check_reward_model(build_reward_model(tmp_path / "two", num_labels=2))
    rm = build_reward_model(tmp_path / "rm")
    assert check_reward_model(rm) == 128  # max_length 0: the model's max_position_embeddings
    with pytest.raises(RewardModelLoadError, match=r"max_length=200: exceeds the reward model's "
                                                   r"max_position_embeddings=128"):
        check_reward_model(rm, 200)
    # a head missing from the weights would be random: refused when loading
    weights = os.path.join(rm, "model.safetensors")
    save_file({k: v for k, v in load_file(weights).items() if not k.startswith("score.")},
              weights, metadata={"format": "pt"})
    with pytest.raises(RewardModelLoadError, match=r"lacks \['score.weight'\]"):
        RewardModel.load(rm)
    # at prepare: refused before the dataset is written or the policy warm-started
    cfg = preset("grpo", **{"reward_model.enable": True, "reward_model.path": causal})
    work = tmp_path / "work"
    work.mkdir()
    with pytest.raises(RewardModelLoadError, match="not a sequence-classification model"):
        prepare_assets(cfg, str(work))
    assert not list(work.iterdir())


# ---------------------------------------------------------------- real short runs
SMALL = {"total_steps": 2, "model.warmup_sft_steps": 10, "actor.ppo_micro_batch_size": 16}
"""Where these runs differ from :data:`tests.presets.TINY`."""


@pytest.mark.slow
def test_plain_loop_trains_on_the_model_score_added_to_the_rule_score(tmp_path, rm_dir):
    from verl_core.train import train

    cfg = tiny_run("grpo", **SMALL, **{"reward_model.enable": True, "reward_model.path": rm_dir,
                                       "reward_model.combine": "add",
                                       "reward_model.micro_batch_size": 5})
    summary = train(cfg, str(tmp_path / "run"), log=lambda *_: None)
    assert [h["step"] for h in summary["history"]] == [1, 2]
    for h in summary["history"]:
        # mean(rule + model) = mean(rule) + mean(model), up to float32 rounding of 32 rows
        assert abs(h["reward/mean"] - h["reward/rule_mean"] - h["reward/model_mean"]) <= TOL32
        assert h["reward/model_mean"] != 0.0 and h["reward/max"] > h["reward/min"]
    assert os.path.exists(os.path.join(summary["final_model"], "model.safetensors"))


@pytest.mark.slow
def test_phase_functions_score_on_the_worker_with_the_stored_reward_model(tmp_path, rm_dir,
                                                                         monkeypatch):
    from verl_core.engine.assets import materialize_assets
    from verl_core.engine.group import WorkerGroup
    from verl_core import phases
    from verl_core.engine.worker import get_batch
    from verl_core.engine.workers import WORKERS, RunWorkers
    from verl_core.prepare import prepare_run
    from verl_core.types import PhaseOut

    monkeypatch.setenv("VERL_ASSET_CACHE", str(tmp_path / "assets"))
    copy = shutil.copytree(rm_dir, tmp_path / "rm-copy")
    cfg = tiny_run("grpo", **SMALL, **{"reward_model.enable": True, "reward_model.path": str(copy),
                                       "reward_model.micro_batch_size": 3})
    spec = prepare_run(cfg, str(tmp_path / "store"), "rm", log_fn=lambda *_: None)
    index = json.loads(spec.assets_json)
    assert sorted(index["reward_model"]) == sorted(os.listdir(copy))
    shutil.rmtree(copy)  # the run needs only its store from here on (hermetic)
    st = spec.open_store()
    scored = []
    try:
        for s in range(2):
            ref, _ = RunWorkers(spec).rollout(s)
            out = phases.reward(spec, PhaseOut(s, ref))
            ref, metrics = out.batch, out.metrics
            scored.append(get_batch(st, ref))
            assert metrics["reward/mean"] == metrics["reward/model_mean"]  # replace
            assert "reward/rule_mean" not in metrics
            ref = phases.advantage(spec, PhaseOut(s, ref)).batch
            RunWorkers(spec).update(s, ref)
        worker = WORKERS.held(spec)
        assert worker.trainer.reward_model.path.startswith(str(tmp_path / "assets"))
        assets = worker.assets
    finally:
        WORKERS.release_all()
    # every stored score is the reward model's score of that prompt + response, recomputed here
    # from the original folder, outside the run
    tok = load_tokenizer(assets.model_path)
    rows = load_prompt_rows(assets.train_files)
    reference = RewardModel.load(rm_dir)
    for batch in scored:
        texts = [render_prompt(rows[int(u)], tok) + r for u, r in zip(
            batch.uid, decode_responses(tok, batch.response_ids, batch.response_mask).texts)]
        assert close(batch.score.tolist(), reference.score(texts, micro_batch_size=8), TOL32)
    assert not torch.equal(scored[0].score, scored[1].score)  # two steps, two batches


@pytest.mark.slow
def test_two_workers_each_score_their_share_and_rank0_gathers(tmp_path, rm_dir, monkeypatch):
    ray = pytest.importorskip("ray")
    from verl_core.engine.assets import materialize_assets
    from verl_core.engine.group import WorkerGroup
    from verl_core import phases
    from verl_core.engine.worker import get_batch
    from verl_core.engine.workers import WORKERS, RunWorkers
    from verl_core.prepare import prepare_run
    from verl_core.types import PhaseOut

    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    monkeypatch.setenv("VERL_ASSET_CACHE", str(tmp_path / "assets"))  # the actors inherit it
    cfg = tiny_run("grpo", **SMALL, **{"reward_model.enable": True, "reward_model.path": rm_dir,
                                       "reward_model.combine": "add",
                                       "trainer.n_gpus_per_node": 2,
                                       "trainer.worker_timeout_s": 120.0})
    spec = prepare_run(cfg, str(tmp_path / "store"), "w2", log_fn=lambda *_: None)
    ray.init(address="local", num_cpus=2, include_dashboard=False, configure_logging=False)
    try:
        ref, _ = RunWorkers(spec).rollout(0)
        assert isinstance(WORKERS.held(spec), WorkerGroup)
        out = phases.reward(spec, PhaseOut(0, ref))
        ref, metrics = out.batch, out.metrics
        batch = get_batch(spec.open_store(), ref)
    finally:
        WORKERS.release_all()
        ray.shutdown()
    assets = materialize_assets(spec.open_store(), json.loads(spec.assets_json))
    tok = load_tokenizer(assets.model_path)
    rows = load_prompt_rows(assets.train_files)
    dec = decode_responses(tok, batch.response_ids, batch.response_mask)
    texts = [render_prompt(rows[int(u)], tok) + r for u, r in zip(batch.uid, dec.texts)]
    model = RewardModel.load(rm_dir).score(texts, micro_batch_size=len(texts))  # all 32 rows
    with RewardScorer("auto") as rs:
        rule = rs.score(batch.data_source, dec.texts, batch.ground_truth,
                        special_token=dec.special_token).scores
    # rows 0-15 scored by worker 0, 16-31 by worker 1, in order: rule + model of every row
    want = (torch.tensor(rule) + torch.tensor(model, dtype=torch.float32)).tolist()
    assert close(batch.score.tolist(), want, TOL32)
    assert abs(metrics["reward/mean"] - metrics["reward/rule_mean"]
               - metrics["reward/model_mean"]) <= TOL32
