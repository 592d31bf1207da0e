"""Run reports as self-contained HTML: what the Flyte Decks of the evaluate, finalize and checkpoint
tasks show (``tasks/`` attach the strings; this module never imports flytekit).

- :func:`run_report`: plots over steps (reward, held-out accuracy, KL, entropy, response length,
  gradient norm, phase timings) as inline SVG, the held-out samples (prompt, response, score;
  the first one as the evaluation printed it: :func:`sample_lines`) and the training guard's
  events.
- :func:`step_card`: the light per-checkpoint card: one small table, no plots.
- :func:`for_run`: :func:`run_report` from a run store (metrics table, samples, guard events).
- :class:`EvalSample`: one held-out sample as an evaluation scored it (the worker stores them as
  dicts, the reports read those).

Everything is inline (SVG from matplotlib, CSS in a ``<style>``): no script, no network access,
so a report renders the same in the Flyte console, a saved file or an air-gapped cluster.
"""

from __future__ import annotations

import html
import io
import math
import numbers
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import pandas as pd

from verl_core import layout


@dataclass(frozen=True)
class EvalSample:
    """One greedy held-out response as scored (what the reports show)."""

    prompt: str
    """The prompt's tokens as the policy read them (chat template, BOS; padding stripped)."""
    response: str
    """The generated tokens, EOS included, special tokens visible (scored: cut at the EOS)."""
    ground_truth: str
    """The row's reference answer."""
    score: float
    """The scorer's score of the response."""


@dataclass(frozen=True)
class Panel:
    """One plot of the report: the metrics-table columns it draws."""

    title: str
    """Heading of the plot."""
    columns: tuple[str, ...]
    """Columns drawn, one line each (those absent from the table are left out)."""
    unit: str = ""
    """Y-axis label."""
    missing: str = ""
    """Why the plot can be empty (shown instead of it)."""
    prefix: str = ""
    """Also draw every column starting with this."""


PANELS = (
    Panel("Reward", ("reward/mean", "reward/min", "reward/max"), "score",
          "no rollout has been scored yet"),
    Panel("Held-out accuracy", ("val/accuracy",), "mean score",
          "no evaluation recorded yet"),
    Panel("KL", ("actor/ppo_kl", "actor/kl_loss", "actor/reward_kl"), "nats",
          "no update recorded yet"),
    Panel("Entropy", ("actor/entropy",), "nats / token",
          "the policy entropy is computed when algorithm.entropy_coeff > 0"),
    Panel("Response length", ("response_length/mean", "val/response_length"), "tokens",
          "no rollout recorded yet"),
    Panel("Gradient norm", ("actor/grad_norm", "critic/grad_norm"), "L2 norm (before clipping)",
          "no update recorded yet"),
    Panel("Phase timings", ("checkpoint/blocked_s",), "seconds", "no phase timing recorded yet",
          prefix="timing/"),
)
"""The plots of :func:`run_report`, in order."""

SAMPLE_COLUMNS = ("step", "prompt", "response", "ground_truth", "score")
EVENT_COLUMNS = ("step", "phase", "detector", "signal", "value", "threshold", "action", "outcome",
                 "message")
CARD_METRICS = ("reward/mean", "val/accuracy", "response_length/mean", "actor/ppo_kl",
                "actor/entropy", "actor/grad_norm", "actor/pg_clipfrac", "critic/vf_loss",
                "checkpoint/saved", "checkpoint/blocked_s", "timing/rollout_s",
                "timing/update_s")
"""What the light step card shows (those the step has)."""

_CSS = """<style>
.verl-report { font-family: Helvetica, Arial, sans-serif; color: #222; }
.verl-report h2 { font-size: 20px; margin: 0 0 4px 0; }
.verl-report h3 { font-size: 16px; margin: 20px 0 8px 0; border-bottom: 1px solid #ddd; }
.verl-report .sub { color: #666; font-size: 13px; margin: 0 0 8px 0; }
.verl-report .plots { display: flex; flex-wrap: wrap; gap: 12px; }
.verl-report figure { margin: 0; width: 440px; border: 1px solid #eee; padding: 4px; }
.verl-report figure svg { width: 100%; height: auto; }
.verl-report figcaption { font-size: 13px; font-weight: bold; text-align: center; }
.verl-report figure.empty p { color: #888; font-size: 13px; padding: 12px; }
.verl-report table { border-collapse: collapse; font-size: 13px; margin-bottom: 8px; }
.verl-report th, .verl-report td { border: 1px solid #ddd; padding: 3px 8px; text-align: left;
  vertical-align: top; }
.verl-report th { background: #f4f4f4; }
.verl-report pre.verl-watch { font-size: 12px; background: #f8f8f8; padding: 6px;
  white-space: pre-wrap; max-width: 900px; }
.verl-samples td:nth-child(2), .verl-samples td:nth-child(3), .verl-events td:nth-child(9) {
  font-family: Menlo, Consolas, monospace; white-space: pre-wrap; max-width: 420px; }
</style>"""


# ---------------------------------------------------------------------- plots
def panel_columns(panel: Panel, table: pd.DataFrame) -> list[str]:
    """The columns of ``table`` that ``panel`` draws: those it names or prefixes with a value."""
    cols = [c for c in panel.columns if c in table]
    if panel.prefix:
        cols += sorted(c for c in table.columns if c.startswith(panel.prefix) and c not in cols)
    return [c for c in cols if table[c].notna().any()]


def _svg(fig) -> str:
    """A matplotlib figure as an inline ``<svg>`` element (text kept as text: small, no fonts)."""
    import matplotlib

    buf = io.StringIO()
    with matplotlib.rc_context({"svg.fonttype": "none", "svg.hashsalt": "verl-report"}):
        fig.savefig(buf, format="svg", bbox_inches="tight")
    text = buf.getvalue()
    return text[text.index("<svg"):]  # drop the XML prolog and DOCTYPE (not allowed inline)


def plot_panel(panel: Panel, table: pd.DataFrame, event_steps: Sequence[int] = ()) -> str:
    """One ``<figure>``: the panel's columns over ``step`` (markers where a column has few
    points, e.g. evaluations); a dotted red line at each of ``event_steps``. When the table
    has none of its columns, a note saying why instead of a plot."""
    cols = panel_columns(panel, table)
    caption = f"<figcaption>{html.escape(panel.title)}</figcaption>"
    if not cols:
        return (f'<figure class="empty" data-panel="{html.escape(panel.title)}">{caption}'
                f"<p>Not recorded: {html.escape(panel.missing)}.</p></figure>")
    # Figure directly (not pyplot): no global state, safe in any thread, nothing to close
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    fig = Figure(figsize=(5.2, 2.9), dpi=100)
    ax = fig.add_subplot()
    for c in cols:
        s = table[["step", c]]
        if c.startswith("val/"):  # evaluated every eval_every steps only: connect the points
            s = s.dropna()
        # elsewhere a NaN stays a gap in the line (a skipped update's gradient norm is NaN; a
        # line drawn across it would invent a value)
        ax.plot(s["step"], s[c], marker="o" if s[c].notna().sum() <= 12 else None,
                markersize=3.5, linewidth=1.4, label=c)
    for st in sorted(set(event_steps)):
        ax.axvline(st, color="#d62728", linestyle=":", linewidth=1.0)
    # every plot spans the run's steps, so plots line up and a lone point (one evaluation) sits
    # on an integer axis instead of a zoomed-in float one
    lo, hi = float(table["step"].min()), float(table["step"].max())
    pad = max(0.5, 0.03 * (hi - lo))
    ax.set_xlim(lo - pad, hi + pad)
    ax.set_xlabel("step (updates applied)")
    ax.set_ylabel(panel.unit)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7, loc="best", frameon=False)
    fig.tight_layout()
    return f'<figure data-panel="{html.escape(panel.title)}">{caption}{_svg(fig)}</figure>'


# ---------------------------------------------------------------------- tables
def _cell(v) -> str:
    """One table cell: escaped text, a float to 4 significant digits, missing or NaN empty."""
    if v is None:
        return ""
    if isinstance(v, numbers.Real) and not isinstance(v, numbers.Integral):
        return "" if math.isnan(v) else f"{v:.4g}"
    return html.escape(str(v))


def _table(rows: Sequence[Mapping], columns: Sequence[str], css_class: str) -> str:
    """``rows`` as an HTML table (the layout of pandas' ``to_html``, built directly: pandas' cost
    showed in every checkpoint phase for the step card: BENCHMARKS.md "Small costs")."""
    head = "".join(f"<th>{html.escape(c)}</th>" for c in columns)
    body = "".join("<tr>" + "".join(f"<td>{_cell(r.get(c))}</td>" for c in columns) + "</tr>"
                   for r in rows)
    return (f'<table border="0" class="dataframe {html.escape(css_class)}">'
            f'<thead><tr style="text-align: right;">{head}</tr></thead>'
            f"<tbody>{body}</tbody></table>")


WATCH_FIELDS = ("prompt", "response", "ground_truth", "score")
"""What :func:`sample_lines` prints of a held-out sample, in verl's reward manager's order."""


OBSERVATION_MARKS = ("«", "»")
"""What :func:`visible_text` puts around the ids a multi-turn rollout appended (the tools'
responses and the template's tokens between turns), which the loss skips."""


def _as_list(x) -> list:
    return x.tolist() if hasattr(x, "tolist") else list(x)


def visible_text(tokenizer, ids, mask=None, sampled=None) -> str:
    """Token ids decoded as the model read or wrote them: padding (``mask`` 0) stripped, special
    tokens kept, so a doubled BOS, a missing EOS or a pad inside the text shows at once.
    ``ids``, ``mask``: (L,) (a tensor or a list; ``mask`` None: every id is kept). ``sampled``
    (L,): a multi-turn response's loss mask; the spans at 0 are marked with
    :data:`OBSERVATION_MARKS`."""
    ids = [int(t) for t in _as_list(ids)]
    keep = _as_list(mask) if mask is not None else [1] * len(ids)
    if sampled is None:
        return tokenizer.decode([t for t, m in zip(ids, keep) if m], skip_special_tokens=False)
    runs: list[tuple[bool, list[int]]] = []  # (sampled?, ids) of consecutive kept ids
    for t, m, s in zip(ids, keep, _as_list(sampled)):
        if not m:
            continue
        if runs and runs[-1][0] == bool(s):
            runs[-1][1].append(t)
        else:
            runs.append((bool(s), [t]))
    left, right = OBSERVATION_MARKS
    return "".join(tokenizer.decode(r, skip_special_tokens=False) if s
                   else left + tokenizer.decode(r, skip_special_tokens=False) + right
                   for s, r in runs)


def sample_lines(sample: Mapping) -> str:
    """One held-out sample as verl's reward manager prints it (``[prompt] …``, ``[response] …``,
    ``[ground_truth] …``, ``[score] …``): what each evaluation prints and its Deck shows."""
    return "\n".join(f"[{k}] {sample.get(k)}" for k in WATCH_FIELDS)


def watched_sample(samples: Sequence[Mapping]) -> Mapping | None:
    """The sample an evaluation prints: the first held-out row of the newest step's samples."""
    if not samples:
        return None
    newest = max(s.get("step", 0) for s in samples)
    return next(s for s in samples if s.get("step", 0) == newest)


def samples_table(samples: Sequence[Mapping]) -> str:
    if not samples:
        return '<p class="sub">No held-out samples stored for these steps.</p>'
    # an empty response (EOS at once) would look like a rendering fault as an empty cell
    shown = [{**s, "response": s.get("response") or "(empty)"} for s in samples]
    return _table(shown, SAMPLE_COLUMNS, "verl-samples")


def events_table(events: Sequence[Mapping]) -> str:
    if not events:
        return '<p class="sub">No guard events: no detector fired.</p>'
    return _table(events, EVENT_COLUMNS, "verl-events")


def _fmt(v) -> str:
    if isinstance(v, float):
        return "nan" if math.isnan(v) else f"{v:.4g}"
    return str(v)


# ---------------------------------------------------------------------- reports
def run_report(table: pd.DataFrame, *, title: str, subtitle: str = "",
               samples: Sequence[Mapping] = (), events: Sequence[Mapping] = (),
               validations: Sequence[Mapping] = ()) -> str:
    """The full report: a latest-values line, the plots of :data:`PANELS`, the held-out samples,
    the guard events and the data validation reports (``validation.ValidationReport`` dicts).
    ``table``: the per-step metrics table (one row per ``step``)."""
    if "step" not in table:
        raise ValueError(f"metrics table without a 'step' column (columns: {list(table.columns)})")
    table = table.sort_values("step")
    # an event of RL step s (0-based) belongs to the update that makes row s + 1 of the table
    event_steps = [int(e["step"]) + 1 for e in events]
    parts = [f'<div class="verl-report">{_CSS}<h2>{html.escape(title)}</h2>']
    if subtitle:
        parts.append(f'<p class="sub">{html.escape(subtitle)}</p>')
    parts.append(f'<p class="sub">{_latest_line(table)}</p>')
    parts.append('<h3>Metrics over steps</h3><div class="plots">')
    parts += [plot_panel(p, table, event_steps) for p in PANELS]
    parts.append("</div>")
    parts.append("<h3>Held-out samples (greedy)</h3>")
    watched = watched_sample(samples)
    if watched is not None:  # what the evaluation printed, special tokens visible
        parts.append(f'<p class="sub">First held-out row after {int(watched.get("step", 0))} '
                     f'steps, as printed:</p><pre class="verl-watch">'
                     f"{html.escape(sample_lines(watched))}</pre>")
    parts.append(samples_table(samples))
    parts.append("<h3>Guard events</h3>")
    if events:
        parts.append('<p class="sub">step: the RL step (0-based) whose phase fired; its metrics '
                     "are the table's step + 1, marked by dotted red lines in the plots.</p>")
    parts.append(events_table(events))
    parts.append("<h3>Data validation</h3>")
    if validations:
        from verl_core.validation import report_html

        parts += [report_html(v) for v in validations]
    else:
        parts.append('<p class="sub">No validation reports stored (validation.mode=off, or no '
                     "validated step yet).</p>")
    parts.append("</div>")
    return "\n".join(parts)


def _latest_line(table: pd.DataFrame) -> str:
    if table.empty:
        return "No step recorded yet."
    bits = [f"steps {int(table['step'].min())}-{int(table['step'].max())}"]
    for col, name in (("reward/mean", "reward"), ("val/accuracy", "held-out accuracy")):
        if col in table and table[col].notna().any():
            s = table[col].dropna()
            bits.append(f"{name} {_fmt(float(s.iloc[0]))} &rarr; {_fmt(float(s.iloc[-1]))}")
    return "; ".join(bits)


def step_card(step: int, metrics: Mapping[str, float], *, events: Sequence[Mapping] = ()) -> str:
    """The light per-step card (the checkpoint phase's deck, on the steps where one is due): the
    step's key metrics and its guard events, one small table each, no plots."""
    rows = [{"metric": k, "value": _fmt(float(metrics[k]))} for k in CARD_METRICS if k in metrics]
    parts = [f'<div class="verl-report">{_CSS}<h2>Step {int(step)}</h2>',
             _table(rows, ("metric", "value"), "verl-card")]
    if events:
        parts.append(f"<h3>Guard events</h3>{events_table(events)}")
    parts.append("</div>")
    return "\n".join(parts)


def for_run(spec, *, title: str, sample_steps: Sequence[int] = ()) -> str:
    """:func:`run_report` of a prepared run (a :class:`~verl_core.types.RunSpec`) from its store:
    the metrics table so far, the samples stored by the evaluations of ``sample_steps`` and
    every guard event of the trajectory."""
    from verl_core import runlog

    samples = [s for step in sample_steps for s in runlog.eval_samples(spec, step)]
    return run_report(runlog.metrics_table(spec), title=title, samples=samples,
                      events=runlog.guard_events(spec), validations=validation_reports(spec),
                      subtitle=f"run store {spec.store} · trajectory "
                               f"{layout.short_hash(spec.trajectory_hash, layout.LABEL_CHARS)}")


def validation_reports(spec) -> list[dict]:
    """The data validation reports worth showing: every failed one, then those of the newest
    validated step (rollout, reward, advantage), from the run store."""
    from verl_core.validation import STAGES, read_reports

    st = spec.open_store()
    names = st.list_json(layout.validation_folder(spec.trajectory_hash))
    steps = sorted({int(n.rsplit("/", 1)[-1].split("-", 1)[0]) for n in names})
    if not steps:
        return []
    failed = [d for n in names for d in [st.get_json(n, default=None)]
              if d is not None and not d.get("success", True)]
    failed.sort(key=lambda d: (d.get("step", 0), STAGES.index(d["stage"])
                               if d.get("stage") in STAGES else 0))
    newest = [d for d in read_reports(st, spec.trajectory_hash, steps[-1])
              if d.get("success", True)]
    return failed + newest
