"""Flyte Decks and trackers from a real local workflow run (`pyflyte run`, no mocked phases): the
evaluate and finalize tasks write the run report, every checkpoint a light card, and TensorBoard
gets the metrics table's scalars from the phase tasks."""
import html
import re

import numpy as np
import pandas as pd
import pytest

from conftest import flyte_env, ppo_cmd, run
from verl_core import report

pytestmark = pytest.mark.slow

STEPS = 2
# flytekit logs the local deck file of each task at INFO: "<task> task creates flyte deck html to
# file://<path>" (plain-text logs so the path is on one line)
DECK_LOG = re.compile(r"(\w+) task creates flyte deck html to file://(\S+?deck\.html)")


def test_phase_tasks_write_decks_and_tensorboard(tmp_path):
    env = flyte_env(tmp_path, FLYTE_SDK_LOGGING_LEVEL="20", FLYTE_SDK_RICH_TRACEBACKS="0",
                    FLYTE_SDK_LOGGING_FORMAT="text")
    tb = tmp_path / "tb"
    out = run(ppo_cmd(tmp_path / "store", steps=STEPS,
                      overrides={"tracking.tensorboard_dir": str(tb)}), env)
    decks: dict[str, list[str]] = {}
    for task, path in DECK_LOG.findall(out.stdout + out.stderr):
        decks.setdefault(task, []).append(path)
    # a checkpoint phase (and its card) only where one is due (interval 2: after step 2)
    assert {t: len(p) for t, p in decks.items()
            if t in ("evaluate", "finalize", "checkpoint", "update")} \
        == {"evaluate": 2, "finalize": 1, "checkpoint": 1}, decks

    with open(decks["finalize"][0], encoding="utf-8") as f:
        page = f.read()
    tabs = re.findall(r'<li onclick="handleLinkClick\(this\)">([^<]+)</li>', page)
    assert {"RL run", "Input", "Output", "Timeline"} <= set(tabs)
    assert tabs[0] == "RL run"  # the page opens on the first tab: ours, not flytekit's Timeline
    # the console names the report's page (flytekit logs it only at INFO)
    assert f"[verl] run report (Flyte Deck: reward, accuracy, KL, samples, guard events): " \
           f"file://{decks['finalize'][0]}" in out.stdout
    assert "Dependencies" not in tabs  # flytekit's pip-list deck costs two pip runs per task
    for panel in report.PANELS:  # every plot, drawn (the run recorded all but the entropy)
        body = page.split(f'data-panel="{panel.title}"', 1)[1].split("</figure>", 1)[0]
        assert ("<svg" in body) == (panel.title != "Entropy"), panel.title
    samples = page.split("<h3>Held-out samples (greedy)</h3>", 1)[1].split("<h3>", 1)[0]
    steps = re.findall(r"<tr>\s*<td>(\d+)</td>", samples)
    assert sorted(set(steps)) == ["0", str(STEPS)] and len(steps) == 16  # 8 per evaluation
    assert "<h3>Guard events</h3>" in page
    assert not re.search(r"<script[^>]*\bsrc\s*=", page)  # flytekit's template script is inline

    # each page holds its own task's deck only (locally flytekit keeps one deck list for all
    # tasks of a run: tasks/decks.py drops the earlier tasks' reports)
    assert "Step" not in tabs and page.count("<h2>") == 1
    with open(decks["evaluate"][0], encoding="utf-8") as f:
        start = f.read()
    assert re.findall(r"<h2>([^<]+)</h2>", start) == ["Evaluation after 0 steps"]
    assert "Held-out samples (greedy)" in start
    # the sample the evaluation printed (verl's four fields, special tokens visible) is the
    # one its Deck shows
    [watched] = re.findall(r'<pre class="verl-watch">(.*?)</pre>', start, re.S)
    watched = html.unescape(watched)
    assert watched.startswith("[prompt] <bos>") and "\n[score] " in watched
    assert watched in out.stdout
    with open(decks["checkpoint"][0], encoding="utf-8") as f:
        card = f.read()
    assert re.findall(r"<h2>([^<]+)</h2>", card) == [f"Step {STEPS}"]
    # the card alone: not the earlier tasks' flytekit decks, nor the run's growing Timeline
    assert re.findall(r'<li onclick="handleLinkClick\(this\)">([^<]+)</li>', card) == ["Step"]
    assert "reward/mean" in card and "<svg" not in card  # light: a table, no plots
    assert "checkpoint/saved" in card

    # TensorBoard, written by the tasks that end a step (update or checkpoint) and evaluate,
    # holds the metrics table
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    summary = [ln for ln in out.stdout.splitlines() if ln.startswith("Summary(")][-1]
    table = pd.read_parquet(summary.split("metrics_table='", 1)[1].split("'", 1)[0])
    [logdir] = list(tb.iterdir())
    assert logdir.name.startswith("t-")  # <run name>-<trajectory hash>
    acc = EventAccumulator(str(logdir), size_guidance={"scalars": 0})
    acc.Reload()
    recorded = {c for c in table.columns if c not in ("step", "time") and table[c].notna().any()}
    assert set(acc.Tags()["scalars"]) == recorded
    for col in ("reward/mean", "val/accuracy", "timing/update_s"):
        cells = table[["step", col]].dropna()
        assert {e.step: e.value for e in acc.Scalars(col)} == {
            int(s): float(np.float32(v)) for s, v in zip(cells["step"], cells[col])}, col
