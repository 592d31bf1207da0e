"""On-policy distillation (issue 44 item 3) on the tiny model: the teacher's log-probs of the
student's tokens and the per-token signal against an independent forward of a hand-built batch,
a real run of the plain loop, its SIGKILL resume to the uninterrupted run's weights, the teacher
pinned with the run's assets, and the refusals (a teacher with another tokenizer, bad values,
verl's keys that cannot apply)."""
import dataclasses
import hashlib
import json
import math
import os

import pytest
import torch

from tests.crash import kill_then_resume, train_command, weights_sha
from tests.presets import TINY, tiny_run
from verl_core.assets import prepare_assets
from verl_core.config import ConfigError, RunConfig, with_overrides
from verl_core.data.batch import Batch
from verl_core.data.synthetic import write_arithmetic_dataset
from verl_core.engine.assets import AssetsChangedError
from verl_core.models import build_tiny_model
from verl_core.parts.teacher import Teacher, TeacherTokenizerError
from verl_core.prepare import prepare_run
from verl_core.train import train
from verl_core.training.advantage import compute_advantages
from verl_core.verl_keys import to_ours

DISTILL_STEPS = 3


def _save(model, tok, path) -> str:
    model.save_pretrained(path, safe_serialization=True)
    tok.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def teacher(tmp_path_factory) -> str:
    """A teacher of another shape than the student (hidden 32, one layer), the same character
    tokenizer."""
    model, tok = build_tiny_model(hidden_size=32, layers=1, heads=2, seed=7)
    return _save(model, tok, tmp_path_factory.mktemp("teacher") / "teacher")


def _distill(teacher: str, **over) -> dict:
    return {**TINY, "algorithm.distill_teacher_path": teacher, "total_steps": DISTILL_STEPS,
            "checkpoint.checkpoint_interval": 1, "val_before_train": False, **over}


# ------------------------------------------------------------------ the signal on a hand-built case
def _row_logprobs(model, prompt: list[int], response: list[int], temperature: float):
    """log p(response_t | prompt, response_<t) of one unpadded row: the test's own forward."""
    ids = torch.tensor([prompt + response])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0].float() / temperature  # (P + L, V)
    logp = torch.log_softmax(logits[len(prompt) - 1:-1], -1)  # (L, V): position t predicts t + 1
    return logp.gather(-1, torch.tensor(response)[:, None])[:, 0]  # (L,)


def test_the_signal_is_log_teacher_minus_log_student_of_an_independent_forward(teacher):
    student, tok = build_tiny_model(seed=1)
    teacher_model = Teacher(teacher, "float32", torch.device("cpu"))
    # two prompts of 4 tokens (no left padding), responses of 3 and 2 tokens (right-padded)
    prompts = [tok.encode("1+2=", add_special_tokens=False), tok.encode("7-3=", add_special_tokens=False)]
    responses = [tok.encode("3", add_special_tokens=False) + [tok.eos_token_id, 5],
                 tok.encode("4", add_special_tokens=False) + [tok.eos_token_id]]
    T, temp = 3, 0.6
    s_lp = torch.zeros(2, T)  # the student's at the rollout temperature, as the engine returns
    t_lp = torch.zeros(2, T)  # the teacher's at temperature 1 (verl's)
    mask = torch.zeros(2, T)
    for i, (p, r) in enumerate(zip(prompts, responses)):
        s_lp[i, :len(r)] = _row_logprobs(student, p, r, temp)
        t_lp[i, :len(r)] = _row_logprobs(teacher_model.model, p, r, 1.0)
        mask[i, :len(r)] = 1.0
    pad = tok.pad_token_id
    batch = Batch(
        prompt_ids=torch.tensor(prompts), prompt_mask=torch.ones(2, 4, dtype=torch.long),
        response_ids=torch.tensor([r + [pad] * (T - len(r)) for r in responses]),
        response_mask=mask, response_logprobs=s_lp, group=torch.tensor([0, 1]),
        uid=["0", "1"], ground_truth=["3", "4"], data_source=["synthetic/arithmetic"] * 2,
        extra_info=[{}, {}], pad_id=pad, score=torch.tensor([1.0, 0.0]))
    got = teacher_model.logprobs(batch, micro_batch_size=8)  # what the rollout phase stores
    assert torch.allclose(got, t_lp, atol=1e-6) and torch.equal(got * (1 - mask), torch.zeros(2, T))
    batch = batch.replace(teacher_logprobs=t_lp)
    algo = tiny_run(**{"algorithm.distill_teacher_path": teacher,
                       "algorithm.distill_use_task_rewards": False}).algorithm
    out, metrics = compute_advantages(batch, algo)
    # alone: r_t = log teacher - log student on the sampled tokens, 0 on padding
    assert torch.equal(out.advantages, (t_lp - s_lp) * mask)
    assert metrics["distillation/loss"] == pytest.approx(
        float(((s_lp - t_lp) * mask).sum() / mask.sum()), rel=1e-6)
    # mixed: the outcome advantage (GRPO over two groups of one: 0) plus coef x r_t
    plain = compute_advantages(batch, tiny_run().algorithm)[0].advantages
    mixed = compute_advantages(batch, dataclasses.replace(
        algo, distill_use_task_rewards=True, distill_coef=0.5))[0].advantages
    assert torch.equal(mixed, plain + 0.5 * (t_lp - s_lp) * mask)


# ------------------------------------------------------------------ a run, and its SIGKILL resume
@pytest.fixture(scope="module")
def run(teacher, tmp_path_factory):
    work = tmp_path_factory.mktemp("distill")
    summary = train(tiny_run(**_distill(teacher)), str(work / "store"), log=lambda *_: None)
    return summary, work


def test_a_distillation_run_logs_the_reverse_kl_each_step(run):
    summary, _ = run
    assert len(summary["history"]) == DISTILL_STEPS
    for h in summary["history"]:
        assert math.isfinite(h["distillation/loss"]) and h["distillation/abs_loss"] > 0


def test_the_stored_batch_holds_the_teachers_log_probs_and_its_advantages(run, teacher):
    """Update 0's batch, as the run store holds it (hash-named, what a resume replays): its
    teacher log-probs are the teacher's forward of its tokens, and its advantages are GRPO's
    plus r_t, recomputed here from the stored columns."""
    from verl_core.engine.worker import get_batch
    from verl_core.store import RunStore

    _, work = run
    st = RunStore(str(work / "store"))
    [folder] = st.list_folders("lineage")
    batch = get_batch(st, st.get_json(sorted(st.list_json(folder))[0])["batch"])
    mask = batch.response_mask
    again = Teacher(teacher, "float32", torch.device("cpu")).logprobs(batch, 8)
    assert torch.equal(batch.teacher_logprobs * batch.response_attn, again * batch.response_attn)
    grpo = compute_advantages(batch, tiny_run().algorithm)[0].advantages
    r = (batch.teacher_logprobs - batch.response_logprobs) * mask
    assert torch.equal(batch.advantages, grpo + 1.0 * r)


def test_a_sigkill_after_the_first_checkpoint_resumes_bit_identical(run, teacher, tmp_path):
    summary, _ = run
    work = tmp_path / "work"
    got = kill_then_resume(*train_command(work, _distill(teacher)), work / "latest.json",
                           tmp_path / "s.json")
    assert weights_sha(got["final_model"]) == weights_sha(summary["final_model"])


# ------------------------------------------------------------------ the teacher is a pinned asset
def test_a_changed_teacher_is_refused_under_a_recorded_run(tmp_path):
    train_f, val_f = write_arithmetic_dataset(str(tmp_path / "data"), train_size=40, val_size=10,
                                              max_operand=9, seed=0)
    student, tok = build_tiny_model(hidden_size=32, layers=1, heads=2, seed=0)
    teacher = _save(*build_tiny_model(hidden_size=32, layers=1, heads=2, seed=3),
                    tmp_path / "teacher")
    cfg = with_overrides(RunConfig(), {
        "model.path": _save(student, tok, tmp_path / "model"), "data.train_files": train_f,
        "data.val_files": val_f, "data.train_batch_size": 8, "actor.ppo_mini_batch_size": 4,
        "actor.ppo_micro_batch_size": 8, "guard.lease_ttl_s": 0.0, "validation.mode": "off",
        "algorithm.distill_teacher_path": teacher})
    spec = prepare_run(cfg, str(tmp_path / "runs"), "r", log_fn=lambda *_: None)
    assert "teacher" in json.loads(spec.assets_json)  # stored in the run store, hash-named
    weights = os.path.join(teacher, "model.safetensors")
    old = hashlib.sha256(open(weights, "rb").read()).hexdigest()
    _save(*build_tiny_model(hidden_size=32, layers=1, heads=2, seed=4), tmp_path / "teacher")
    with pytest.raises(AssetsChangedError, match=f"{weights} \\(sha256 {old} -> "):
        prepare_run(cfg, str(tmp_path / "runs"), "r", log_fn=lambda *_: None)


# ------------------------------------------------------------------ refusals
def test_a_teacher_with_another_tokenizer_is_refused_naming_both(tmp_path):
    model, tok = build_tiny_model(hidden_size=32, layers=1, heads=2, seed=7)
    tok.add_special_tokens({"additional_special_tokens": ["<think>"]})  # one token more
    model.resize_token_embeddings(len(tok))
    teacher = _save(model, tok, tmp_path / "teacher")
    work = tmp_path / "work"
    with pytest.raises(TeacherTokenizerError) as e:
        prepare_assets(tiny_run(**_distill(teacher)), str(work), log=lambda *_: None)
    msg = str(e.value)
    assert f"algorithm.distill_teacher_path='{teacher}'" in msg
    assert "the tiny model's character tokenizer" in msg and "<think>" in msg
    assert not (work / "model").exists()  # refused before the warm start


@pytest.mark.parametrize("over, match", [
    ({"algorithm.distill_coef": 0.0}, r"algorithm.distill_coef=0.0: must be > 0"),
    ({"algorithm.distill_coef": -1.0}, r"algorithm.distill_coef=-1.0: must be > 0"),
    ({"algorithm.distill_loss_mode": "forward_kl_topk"},
     r"algorithm.distill_loss_mode='forward_kl_topk': unknown value; known: abs, k1"),
    ({"algorithm.distill_loss_max_clamp": -1.0}, r"distill_loss_max_clamp=-1.0: must be >= 0"),
    ({"algorithm.distill_teacher_path": "", "algorithm.distill_coef": 2.0},
     r"algorithm.distill_coef=2.0: does nothing without algorithm.distill_teacher_path"),
    ({"algorithm.distill_use_task_rewards": False, "algorithm.distill_coef": 2.0},
     r"distill_coef=2.0: does nothing with algorithm.distill_use_task_rewards=False"),
    ({"algorithm.distill_use_task_rewards": False, "algorithm.adv_estimator": "gae"},
     r"distill_use_task_rewards=False: with algorithm.adv_estimator='gae' would train a critic"),
])
def test_bad_distillation_values_are_refused(over, match):
    with pytest.raises(ConfigError, match=match):
        tiny_run(**{"algorithm.distill_teacher_path": "/models/teacher", **over})


def test_distillation_off_hashes_as_before():
    assert tiny_run(**{"algorithm.distill_loss_mode": "k1"}).trajectory_hash() == \
        tiny_run().trajectory_hash()


def test_verls_distillation_keys_map_or_are_refused_with_the_reason():
    on = {"distillation.enabled": True,
          "distillation.teacher_models.teacher_model.model_path": "/models/teacher",
          "distillation.distillation_loss.loss_mode": "k1",
          "distillation.distillation_loss.use_policy_gradient": True,
          "distillation.distillation_loss.use_task_rewards": True,
          "distillation.distillation_loss.distillation_loss_coef": 2.0,
          "distillation.distillation_loss.loss_max_clamp": 10.0,
          "distillation.n_gpus_per_node": 8, "distillation.nnodes": 1}
    assert to_ours(on) == {"algorithm.distill_teacher_path": "/models/teacher",
                           "algorithm.distill_loss_mode": "k1",
                           "algorithm.distill_use_task_rewards": True,
                           "algorithm.distill_coef": 2.0,
                           "algorithm.distill_loss_max_clamp": 10.0}
    for key, value, why in (
            ("distillation.distillation_loss.use_policy_gradient", False, "GKD OPD"),
            ("distillation.distillation_loss.loss_mode", "forward_kl_topk", "top-k"),
            ("distillation.teacher_models.teacher_model2.model_path", "/m", "one teacher"),
            ("distillation.distillation_loss.policy_loss_mode", "gspo", "algorithm.policy_loss")):
        with pytest.raises(ConfigError, match=why):
            to_ours({**on, key: value})
    with pytest.raises(ConfigError, match="distillation.enabled"):
        to_ours({"distillation.teacher_models.teacher_model.model_path": "/models/teacher"})
    # verl's defaults when on: GKD OPD (refused, not run as PG OPD); with PG OPD, its k3
    first = {k: on[k] for k in ("distillation.enabled",
                                "distillation.teacher_models.teacher_model.model_path")}
    with pytest.raises(ConfigError, match="use_policy_gradient=False .verl's default."):
        to_ours(first)
    assert to_ours({**first, "distillation.distillation_loss.use_policy_gradient": True}) == {
        "algorithm.distill_teacher_path": "/models/teacher", "algorithm.distill_loss_mode": "k3"}
    assert to_ours({"distillation.enabled": False}) == {}
