"""A generative judge (``reward_model.style=generative``): a causal LM served by the project's
rollout engine answers a prompt built from a template, a named parser reads the score; answers
are stored with the scored batch, a damaged batch is recomputed bit for bit (per-row seeds), the
template is pinned with the run's assets, and a judge that fails or answers unreadably scores
``failure_score`` with a counted metric, never a crash.

The stand-in judge is a tiny random Llama causal LM on the character tokenizer (built here,
sampled at temperature 1, so its answers are varied and some hold a number, some not): what is
checked is the plumbing, exactly; a real judge's answers are checked on the real model
(tests/verl_core/models/test_real_model.py).
"""

import dataclasses
import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.presets import tiny_run
from tests.verl_core.reward.test_reward_model import build_reward_model
from verl_core.config import ConfigError, with_overrides
from verl_core.reward.config import RewardModelConfig
from verl_core.reward.judge import (DEFAULT_TEMPLATE, Judge, JudgeError, check_judge,
                                    check_template, parse_score)
from verl_core.seeds import derive_seed

CHAT = ("{% for m in messages %}{{ m['content'] }}{% endfor %}"
        "{% if add_generation_prompt %}={% endif %}")
TEMPLATE = "{problem}|{solution}?"  # short: the stand-in's positions are 128


@dataclasses.dataclass
class Row:  # the fields of a dataset row (verl_core.data.dataset.PromptRow) the judge reads
    chat: list
    ground_truth: str
    index: int = 0


def rows_and_responses(n=6):
    rows = [Row([{"role": "user", "content": f"{i}+{i + 1}="}], str(2 * i + 1), i)
            for i in range(n)]
    return rows, [str(2 * i + 1 + i % 2) for i in range(n)]


@pytest.fixture(scope="module")
def judge_dir(tmp_path_factory):
    return build_reward_model(tmp_path_factory.mktemp("judge"), causal=True, chat_template=CHAT,
                              seed=3)


@pytest.fixture(scope="module")
def template_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("tmpl") / "judge.txt"
    path.write_text(TEMPLATE)
    return str(path)


def judge_cfg(path, **kw):
    return RewardModelConfig(**{"enable": True, "path": path, "style": "generative",
                                "parser": "last_number", "temperature": 1.0,
                                "max_new_tokens": 6, "micro_batch_size": 4, **kw})


def test_parsers_read_their_format_and_nothing_else():
    cases = {
        "score_tag": [("<score>1</score>", 1.0), ("x <score> 0.5 </score> y <score>-2</score>", -2.0),
                      ("score: 1", None), ("<score>one</score>", None), ("", None)],
        "yes_no": [("Yes.", 1.0), ("  no, because", 0.0), ("NO", 0.0), ("Yesterday", None),
                   ("I think yes", None)],
        "last_number": [("a 3 then 4.5", 4.5), ("-7", -7.0), ("1e3", 1000.0), ("none", None),
                        ("inf", None)],
    }
    for parser, pairs in cases.items():
        for text, want in pairs:
            assert parse_score(parser, text) == want, (parser, text)


def test_templates_folders_and_values_are_refused_before_any_work(tmp_path, judge_dir):
    assert check_template(DEFAULT_TEMPLATE, "x") == DEFAULT_TEMPLATE
    for text, says in (("{problem} {answer}", "unknown placeholder(s) ['answer']"),
                       ("{problem} only", "no {solution} placeholder"),
                       ("{solution} {", "not a valid template")):
        with pytest.raises(JudgeError) as e:
            check_template(text, "where")
        assert says in str(e.value) and "where" in str(e.value)
    with pytest.raises(JudgeError, match="cannot read it"):
        check_judge(judge_dir, str(tmp_path / "absent.txt"))
    with pytest.raises(JudgeError, match="no such folder"):
        check_judge(str(tmp_path / "nowhere"))
    classifier = build_reward_model(tmp_path / "cls")  # a sequence classifier is no judge
    with pytest.raises(JudgeError, match="not a causal LM"):
        check_judge(classifier)
    check_judge(judge_dir)  # the stand-in passes
    for key, value in (("style", "critic"), ("parser", "regex"), ("engine", "sglang"),
                       ("top_p", 0.0), ("max_new_tokens", 0), ("temperature", -1.0)):
        with pytest.raises(ConfigError, match=f"reward_model.{key}"):
            judge_cfg(judge_dir, **{key: value})
    # a discriminative reward model hashes as before the judge's fields existed
    cfg = tiny_run("grpo", **{"reward_model.enable": True, "reward_model.path": judge_dir})
    assert set(cfg.trajectory_fields()["reward_model"]) == {
        "enable", "path", "combine", "dtype"}
    judged = with_overrides(cfg, {"reward_model.style": "generative"})
    assert judged.trajectory_hash() != cfg.trajectory_hash()
    assert with_overrides(judged, {"reward_model.parser": "yes_no"}).trajectory_hash() != \
        judged.trajectory_hash()


def test_the_same_seeds_give_the_same_answers_and_failures_score_zero_counted(
        tmp_path, judge_dir, template_file):
    rows, responses = rows_and_responses()
    seeds = [derive_seed(0, 1, f"judge-row-{i}") for i in range(len(rows))]
    judge = Judge.load(judge_dir, judge_cfg(judge_dir), template_path=template_file)
    first = judge.judge_rows(rows, responses, seeds=seeds)
    again = judge.judge_rows(rows, responses, seeds=seeds)
    assert first.outputs == again.outputs and first.scores == again.scores
    assert first.failed == 0 and len(first.outputs) == len(rows) and all(first.outputs)
    for out, score in zip(first.outputs, first.scores):
        assert score == (parse_score("last_number", out) or 0.0)
    assert first.unparsed == sum(parse_score("last_number", o) is None for o in first.outputs)
    # one row alone draws what it drew among the others (its own seed): no dependence on the
    # batch, so W workers, each with a share, ask and draw what one does
    alone = judge.judge_rows(rows[3:4], responses[3:4], seeds=seeds[3:4])
    assert alone.outputs == first.outputs[3:4]
    other = judge.judge_rows(rows, responses, seeds=[s + 1 for s in seeds])
    assert other.outputs != first.outputs

    # a prompt longer than max_length - max_new_tokens is not asked: scored 0, counted
    long_rows = [Row([{"role": "user", "content": "9" * 200}], "1")] + rows[:2]
    got = judge.judge_rows(long_rows, responses[5:6] + responses[:2], seeds=[7] + seeds[:2])
    assert got.failed == 1 and got.scores[0] == 0.0 and got.outputs[0] == ""
    assert got.outputs[1:] == first.outputs[:2]

    # a judge whose weights are NaN: its sampling raises; every row scores failure_score
    broken = tmp_path / "broken"
    shutil.copytree(judge_dir, broken)
    weights = load_file(str(broken / "model.safetensors"))
    weights = {k: torch.full_like(v, float("nan")) if "embed" in k else v
               for k, v in weights.items()}
    save_file(weights, str(broken / "model.safetensors"), metadata={"format": "pt"})
    bad = Judge.load(str(broken), judge_cfg(str(broken), failure_score=-1.0))
    got = bad.judge_rows(rows, responses, seeds=seeds)
    assert got.failed == len(rows) and got.scores == [-1.0] * len(rows)


SMALL = {"total_steps": 2, "model.warmup_sft_steps": 10, "actor.ppo_micro_batch_size": 16}


@pytest.mark.slow
def test_answers_are_stored_replayed_and_a_damaged_batch_is_recomputed_bit_for_bit(
        tmp_path, judge_dir, monkeypatch):
    from tests.verl_core.engine.test_worker_heal import _flip, _intact
    from verl_core import phases
    from verl_core.data.dataset import load_prompt_rows
    from verl_core.engine.assets import AssetsChangedError, materialize_assets
    from verl_core.engine.worker import get_batch
    from verl_core.engine.workers import WORKERS, RunWorkers
    from verl_core.models import load_tokenizer
    from verl_core.prepare import prepare_run
    from verl_core.reward.scoring import decoded
    from verl_core.types import PhaseOut

    monkeypatch.setenv("VERL_ASSET_CACHE", str(tmp_path / "assets"))
    copy = shutil.copytree(judge_dir, tmp_path / "judge-copy")
    template = tmp_path / "judge.txt"
    template.write_text(TEMPLATE)
    overrides = {"reward_model.enable": True, "reward_model.path": str(copy),
                 "reward_model.style": "generative", "reward_model.parser": "last_number",
                 "reward_model.prompt_template": str(template), "reward_model.temperature": 1.0,
                 "reward_model.max_new_tokens": 6, "reward_model.micro_batch_size": 5}
    cfg = tiny_run("grpo", **SMALL, **overrides)
    spec = prepare_run(cfg, str(tmp_path / "store"), "judge", log_fn=lambda *_: None)
    index = json.loads(spec.assets_json)
    assert "judge_template" in index and sorted(index["reward_model"]) == sorted(os.listdir(copy))
    shutil.rmtree(copy)  # hermetic: the run needs only its store from here on
    st = spec.open_store()
    try:
        sampled = RunWorkers(spec).rollout(0)[0]
        scored = phases.reward(spec, PhaseOut(0, sampled))
        batch = get_batch(st, scored.batch)
        advantaged = phases.advantage(spec, scored)
        WORKERS.release_all()
        _flip(st, scored.batch)  # bit rot in the stored judged batch
        assert not _intact(st, scored.batch)
        # the advantage phase re-executes on its cached input: the worker asks the judge again,
        # with the same seeds, and writes the same bytes under the same name
        assert phases.advantage(spec, scored).batch == advantaged.batch
        assert _intact(st, scored.batch)
    finally:
        WORKERS.release_all()
    outputs = batch.meta["judge_row_outputs"]
    m = scored.metrics
    assert len(outputs) == batch.num_rows and m["reward/mean"] == m["reward/model_mean"]
    assert m["reward/judge_failed"] == 0.0
    assert m["reward/judge_unparsed"] == sum(parse_score("last_number", o) is None
                                             for o in outputs)
    assert batch.score.tolist() == [float(torch.tensor(parse_score("last_number", o) or 0.0,
                                                       dtype=torch.float32))
                                    for o in outputs]
    # replayed outside the run from the original folder and template: the same answers
    assets = materialize_assets(st, index)
    tok = load_tokenizer(assets.model_path)
    rows = load_prompt_rows(assets.train_files)
    judge = Judge.load(judge_dir, cfg.reward_model, template_path=str(template))
    again = judge.judge_rows([rows[int(u)] for u in batch.uid], decoded(tok, batch).texts,
                             seeds=[derive_seed(cfg.seed, 0, f"judge-row-{i}")
                                    for i in range(batch.num_rows)])
    assert again.outputs == outputs
    # the template is pinned: changed, the same run is refused, naming it
    template.write_text(TEMPLATE + " ")
    shutil.copytree(judge_dir, tmp_path / "judge-copy")
    with pytest.raises(AssetsChangedError, match="judge.txt"):
        prepare_run(cfg, str(tmp_path / "store"), "judge", log_fn=lambda *_: None)
