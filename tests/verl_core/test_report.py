"""The run report (what the evaluate/finalize Decks show) and the light checkpoint card, rendered
from a real short run's store (tests/verl_core/conftest.py): every plot present as inline SVG,
the held-out samples and the guard's event in tables, nothing fetched from the network."""
import html
import re

import pytest

from verl_core import report
from verl_core import runlog
from verl_core.engine.worker import EVAL_SAMPLES

pytestmark = pytest.mark.slow

# what a browser would fetch: scripts, stylesheets, images, fonts, frames (namespace URIs such as
# xmlns="http://www.w3.org/2000/svg" are identifiers, never fetched)
FETCHES = re.compile(r"<script|<link|<iframe|<img|src\s*=|href\s*=\s*[\"']?https?:"
                     r"|url\(\s*[\"']?https?:|@import", re.I)


@pytest.fixture(scope="module")
def finalize_html(tracked_run):
    return report.for_run(tracked_run.spec, title="grpo: 3 steps",
                          sample_steps=[0, tracked_run.steps])


def _figures(page: str) -> dict[str, str]:
    return dict(re.findall(r'<figure[^>]*data-panel="([^"]+)"[^>]*>(.*?)</figure>', page, re.S))


def test_every_plot_is_inline_svg_with_its_lines(tracked_run, finalize_html):
    figures = _figures(finalize_html)
    assert list(figures) == [p.title for p in report.PANELS]
    for panel in report.PANELS:
        body = figures[panel.title]
        assert "<svg" in body and "</svg>" in body, panel.title  # a plot, not the empty note
        # text is kept as SVG text: the legend names each column drawn (those the run recorded)
        drawn = report.panel_columns(panel, tracked_run.table)
        assert drawn and all(f">{c}<" in body for c in drawn), (panel.title, drawn)
    timing = figures["Phase timings"]
    for c in ("timing/rollout_s", "timing/reward_s", "timing/advantage_s", "timing/update_s"):
        assert f">{c}<" in timing
    assert "<?xml" not in finalize_html and "<!DOCTYPE" not in finalize_html


def test_nothing_is_fetched_from_the_network(finalize_html, tracked_run):
    assert not FETCHES.findall(finalize_html)
    card = report.step_card(1, tracked_run.table.iloc[1].dropna().to_dict())
    assert not FETCHES.findall(card)


def test_samples_table_holds_the_stored_greedy_responses(tracked_run, finalize_html):
    spec, steps = tracked_run.spec, tracked_run.steps
    samples = runlog.eval_samples(spec, 0) + runlog.eval_samples(spec, steps)
    assert len(samples) == 2 * EVAL_SAMPLES
    assert {s["step"] for s in samples} == {0, steps}
    table = finalize_html.split("<h3>Held-out samples (greedy)</h3>")[1].split("<h3>")[0]
    rows = re.findall(r"<tr>(.*?)</tr>", table, re.S)  # the header row has a style attribute
    assert len(rows) == len(samples)
    for row, s in zip(rows, samples):
        cells = [html.unescape(c) for c in re.findall(r"<td>(.*?)</td>", row, re.S)]
        response = s["response"] or "(empty)"  # a response that is EOS at once, shown as such
        assert cells[:4] == [str(s["step"]), s["prompt"], response, s["ground_truth"]]
        assert float(cells[4]) == pytest.approx(s["score"], abs=5e-5)  # shown with 4 digits
    # held-out accuracy at step 0 is the mean score over the split; the samples are its rows
    assert all(s["score"] in (0.0, 1.0) for s in samples)


def test_samples_show_the_tokens_the_model_saw_and_wrote(tracked_run):
    """Special tokens visible, padding stripped: one BOS at the start of every prompt (the tiny
    tokenizer adds one; the held-out prompts differ in length, so the batch is left-padded),
    an EOS only where the response ended."""
    from verl_core.models.tokenizer import BOS, EOS, PAD

    spec, steps = tracked_run.spec, tracked_run.steps
    samples = runlog.eval_samples(spec, 0) + runlog.eval_samples(spec, steps)
    assert len({len(s["prompt"]) for s in samples}) > 1  # padding was there to strip
    for s in samples:
        assert s["prompt"].startswith(BOS) and s["prompt"].count(BOS) == 1, s["prompt"]
        assert PAD not in s["prompt"] + s["response"], s
        assert EOS not in s["response"][:-len(EOS)], s["response"]
    assert any(s["response"].endswith(EOS) for s in samples)  # the EOS is shown, not cut


def test_the_evaluation_deck_shows_the_sample_it_printed(tracked_run, finalize_html):
    """The evaluate task prints ``sample_lines`` of the first sample it stored; its Deck (this
    page, as the task builds it) holds the same text; finalize's shows the newest evaluation's."""
    spec, steps = tracked_run.spec, tracked_run.steps
    first = runlog.eval_samples(spec, steps)[0]
    page = report.for_run(spec, title=f"Evaluation after {steps} steps", sample_steps=[steps])
    shown = f'<pre class="verl-watch">{html.escape(report.sample_lines(first))}</pre>'
    assert shown in page and shown in finalize_html
    lines = report.sample_lines(first).split("\n")
    assert [ln.split(" ", 1)[0] for ln in lines[-3:]] == ["[response]", "[ground_truth]",
                                                          "[score]"]
    assert lines[0].startswith("[prompt] ")
    assert not FETCHES.findall(page)


def test_guard_event_of_the_poisoned_update_is_listed_and_marked(tracked_run, finalize_html):
    events = runlog.guard_events(tracked_run.spec)
    assert events and {(e["step"], e["action"]) for e in events} == {
        (tracked_run.nan_grad_step, "skip_batch")}  # one event per non-finite signal
    section = finalize_html.split("<h3>Guard events</h3>")[1]
    assert "No guard events" not in section
    for e in events:
        assert html.escape(e["detector"]) in section and html.escape(e["signal"]) in section
        assert html.escape(e["message"]) in section  # escaped (a message may hold "<", ">")
    # a dotted red line (#d62728, not among the Reward plot's three line colours) at the event's
    # row of the table: RL step s -> row s + 1
    red = "stroke-dasharray: 1,1.65; stroke-dashoffset: 0; stroke: #d62728"
    assert red not in _figures(report.run_report(tracked_run.table, title="no events"))["Reward"]
    assert red in _figures(finalize_html)["Reward"]


def test_missing_columns_give_a_note_not_an_empty_plot(tracked_run):
    only_eval = tracked_run.table[tracked_run.table["step"] == 0].dropna(axis=1, how="all")
    page = report.run_report(only_eval, title="Evaluation after 0 steps")
    figures = _figures(page)
    assert "<svg" in figures["Held-out accuracy"]
    assert "Not recorded: no rollout has been scored yet." in figures["Reward"]
    assert "<svg" not in figures["Reward"]
    assert "No held-out samples stored" in page and "No guard events" in page


def test_checkpoint_card_is_one_small_table(tracked_run):
    s = tracked_run.nan_grad_step  # RL step s (0-based) makes the state and the row s + 1
    row = tracked_run.table[tracked_run.table["step"] == s + 1].iloc[0].dropna().to_dict()
    card = report.step_card(s + 1, row, events=runlog.step_events(tracked_run.spec, s))
    assert "<svg" not in card and card.count("<table") == 2  # metrics + the step's guard events
    first = card.split("<h3>Guard events</h3>")[0]
    metrics = dict(re.findall(r"<tr>\s*<td>([^<]+)</td>\s*<td>([^<]+)</td>", first))
    assert metrics["reward/mean"] == f"{row['reward/mean']:.4g}"
    assert set(metrics) == {k for k in report.CARD_METRICS if k in row}
    assert len(card) < 10_000  # light: written on every step


def test_a_table_without_steps_is_refused():
    import pandas as pd

    with pytest.raises(ValueError, match="metrics table without a 'step' column"):
        report.run_report(pd.DataFrame({"reward/mean": [0.5]}), title="x")


def test_the_data_validation_reports_are_in_the_report(tracked_run, finalize_html):
    # step 0 is validated (validation.every_steps divides it): its three stages' reports
    section = finalize_html.split("<h3>Data validation</h3>", 1)[1]
    for stage in ("rollout", "reward", "advantage"):
        assert f"{stage} batch of step 0: passed" in section, stage
    assert "expect_column_max_to_be_between" in section
    assert not FETCHES.search(section)


def test_a_multi_turn_response_shows_its_appended_spans_marked():
    from verl_core.models.tokenizer import CHAR_CHAT_TEMPLATE, build_char_tokenizer
    tok = build_char_tokenizer(CHAR_CHAT_TEMPLATE)
    call = tok("<tool_call>x</tool_call>", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    obs = tok(">42\n", add_special_tokens=False)["input_ids"]
    answer = tok("42", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    ids = call + obs + answer + [tok.pad_token_id] * 3
    real = [1] * (len(ids) - 3) + [0] * 3
    sampled = [1] * len(call) + [0] * len(obs) + [1] * len(answer) + [0] * 3
    left, right = report.OBSERVATION_MARKS
    assert report.visible_text(tok, ids, real, sampled) == \
        f"<tool_call>x</tool_call><eos>{left}>42\n{right}42<eos>"
    assert report.visible_text(tok, ids, real) == "<tool_call>x</tool_call><eos>>42\n42<eos>"
