"""A search's pictures on one self-contained HTML page: `NIGHTSHIFT_HOME/search/<pipeline>/<study>/report.html`.

Optuna's plotly figures: the optimisation history, the intermediate values (the objective per epoch) of
the completed and of the pruned trials apart, the parameter importances (fANOVA, seeded) and the
parallel coordinates; then a table of every trial. plotly.js is inlined once, so the page opens
offline and nothing is fetched when it is viewed (its Content-Security-Policy allows no request at
all). A figure that cannot be drawn (no completed trial yet, importances with fewer than two) says so
in its place. Everything from the study (its name, parameter values, errors) is escaped: plotly
escapes `</` in the figure JSON, the rest goes through `html.escape`.

Written by `finish_search` (the CLI and the DAG's `finish`); the Airflow plugin serves it at
`/nightshift/search/<pipeline>/<study folder>/report.html`, and the `finish` task links to it.
"""

from __future__ import annotations

import html
import json
import logging
import re
import warnings
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from nightshift.fsutil import atomic_write_bytes
from nightshift.search.pipeline import DEFAULT_PIPELINE
from nightshift.search.study import SearchSettings, study_dir, trial_summary

if TYPE_CHECKING:
    import optuna
    import plotly.graph_objects as go

log = logging.getLogger("nightshift.search")

REPORT_NAME = "report.html"
STATES = ("COMPLETE", "PRUNED", "FAIL", "RUNNING", "WAITING")
# Inline scripts and styles only; no request of any kind (plotly.js needs eval for its WebGL traces).
CSP = ("default-src 'none'; script-src 'unsafe-inline' 'unsafe-eval'; style-src 'unsafe-inline'; "
       "img-src data: blob:; font-src data:; worker-src blob:")
PLOT_CONFIG = {"displaylogo": False, "responsive": True}


class Unavailable(Exception):
    """A figure that cannot be drawn for this study; the message says why, on the page."""


def report_path(study: str, pipeline: str = DEFAULT_PIPELINE) -> Path:
    return study_dir(study, pipeline) / REPORT_NAME


def write_report(study: optuna.Study, settings: SearchSettings, path: Path | None = None) -> Path:
    """Render the page of `study` and write it atomically to `path` (default `report_path`)."""
    path = path or report_path(study.study_name, settings.pipeline)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(path, render_report(study, settings).encode())
    return path


def render_report(study: optuna.Study, settings: SearchSettings) -> str:
    import optuna
    import plotly
    import plotly.io as pio
    import plotly.offline

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    trials = study.get_trials(deepcopy=False)
    sections = []
    for key, title, build in _figures(settings):
        try:
            with warnings.catch_warnings():  # Optuna warns about empty figures; the page says why instead
                warnings.simplefilter("ignore")
                figure = build(study, trials)
            body = pio.to_html(figure, full_html=False, include_plotlyjs=False, div_id=f"plot-{key}",
                               config=PLOT_CONFIG, default_height="440px")
        except Unavailable as why:
            body = f"<p class='unavailable'>Not drawn: {_text(why)}</p>"
        except Exception as err:  # a picture that fails must not hide the others or the table
            log.warning("study %s: the %s figure failed: %s: %s", study.study_name, key, type(err).__name__, err)
            body = f"<p class='unavailable'>Not drawn: {_text(type(err).__name__)}: {_text(err)}</p>"
        sections.append(f"<section id='{key}'><h2>{_text(title)}</h2>\n{body}</section>")
    return PAGE.format(
        csp=html.escape(CSP, quote=True), title=_text(f"Model search {study.study_name}"),
        plotlyjs=plotly.offline.get_plotlyjs(), header=_header(study, settings, trials),
        sections="\n".join(sections), table=_table(trials, settings.objective),
        footer=_text(f"Written {datetime.now(UTC).isoformat(timespec='seconds')} with Optuna "
                     f"{optuna.__version__} and plotly {plotly.__version__}."))


# --- figures -----------------------------------------------------------------------------------------


def _figures(settings: SearchSettings) -> list[tuple[str, str, Callable[[optuna.Study, list[Any]], go.Figure]]]:
    objective = settings.objective
    return [
        ("history", "Optimisation history", lambda study, trials: _history(study, trials, objective)),
        ("intermediate-complete", f"Intermediate values ({objective} per epoch): completed trials",
         lambda study, trials: _intermediate(study, trials, "COMPLETE", settings)),
        ("intermediate-pruned", f"Intermediate values ({objective} per epoch): pruned trials",
         lambda study, trials: _intermediate(study, trials, "PRUNED", settings)),
        ("importances", "Parameter importances (fANOVA)",
         lambda study, trials: _importances(study, trials, objective)),
        ("parallel", "Parallel coordinates (completed trials)",
         lambda study, trials: _parallel(study, trials, objective)),
    ]


def _complete(trials: list[Any]) -> list[Any]:
    return [t for t in trials if t.state.name == "COMPLETE"]


def _history(study: optuna.Study, trials: list[Any], objective: str) -> go.Figure:
    from optuna.visualization import plot_optimization_history

    if not _complete(trials):
        raise Unavailable("no trial has completed yet")
    return plot_optimization_history(study, target_name=objective)


def _intermediate(study: optuna.Study, trials: list[Any], state: str, settings: SearchSettings) -> go.Figure:
    """Optuna's intermediate-values figure of the trials in `state` only (a copy of them in memory)."""
    import optuna
    from optuna.visualization import plot_intermediate_values

    chosen = [t for t in trials if t.state.name == state and t.intermediate_values]
    if not chosen:
        raise Unavailable(f"no {state} trial reported an intermediate value")
    subset = optuna.create_study(direction=settings.direction, study_name=f"{study.study_name} {state}")
    subset.add_trials(chosen)  # numbered 0, 1, ... again: the legend gets the study's numbers back below
    figure = plot_intermediate_values(subset)
    for trace in figure.data:
        copied = re.fullmatch(r"Trial\s*(\d+)", str(trace.name or ""))
        if copied and int(copied.group(1)) < len(chosen):
            trace.name = f"Trial {chosen[int(copied.group(1))].number}"
    figure.update_layout(xaxis_title="epoch", yaxis_title=settings.objective, showlegend=True)
    return figure


def _importances(study: optuna.Study, trials: list[Any], objective: str) -> go.Figure:
    from optuna.importance import FanovaImportanceEvaluator
    from optuna.visualization import plot_param_importances

    done = _complete(trials)
    if len(done) < 2:
        raise Unavailable(f"parameter importances need at least 2 completed trials; this study has {len(done)}")
    if not any(len({json.dumps(t.params.get(name), sort_keys=True) for t in done}) > 1
               for name in {name for t in done for name in t.params}):
        raise Unavailable("every completed trial has the same parameters, so none can matter more")
    return plot_param_importances(study, evaluator=FanovaImportanceEvaluator(seed=0), target_name=objective)


def _parallel(study: optuna.Study, trials: list[Any], objective: str) -> go.Figure:
    from optuna.visualization import plot_parallel_coordinate

    if not _complete(trials):
        raise Unavailable("no trial has completed yet")
    if not any(t.params for t in _complete(trials)):
        raise Unavailable("the completed trials have no parameters")
    return plot_parallel_coordinate(study, target_name=objective)


# --- text --------------------------------------------------------------------------------------------


def _text(value: Any) -> str:
    return html.escape("" if value is None else str(value), quote=True)


def _value(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.6g}"
    return json.dumps(value) if isinstance(value, (dict, list)) else str(value)


def _header(study: optuna.Study, settings: SearchSettings, trials: list[Any]) -> str:
    counts = {state: sum(t.state.name == state for t in trials) for state in STATES}
    states = ", ".join(f"{n} {state}" for state, n in counts.items() if n)
    lines = [
        f"<p>Pipeline <b>{_text(settings.pipeline)}</b>. Objective: <b>{_text(settings.objective)}</b>, "
        f"{settings.direction[:-2]}sed. Pruner <b>{_text(settings.pruner)}</b> "
        f"(min_epochs {settings.min_epochs}, reduction_factor {settings.reduction_factor}), sampler "
        f"<b>{_text(settings.sampler)}</b> (seed {settings.seed}), max_epochs {settings.max_epochs}.</p>",
        f"<p class='counts'>{len(trials)} trials: {_text(states or 'none yet')}; "
        f"{sum(len(t.intermediate_values) for t in trials)} epochs trained.</p>",
    ]
    done = _complete(trials)
    if done:
        best = study.best_trial
        params = ", ".join(f"{_text(k)}={_text(_value(v))}" for k, v in best.params.items())
        lines.append(f"<p class='best'>Best: trial {best.number}, {_text(settings.objective)} "
                     f"{_text(_value(best.value))} ({params}).</p>")
    else:
        lines.append("<p class='best'>No trial has completed yet: there is no best configuration.</p>")
    return "\n".join(lines)


def _table(trials: list[Any], objective: str) -> str:
    names = sorted({name for t in trials for name in t.params})
    head = "".join(f"<th>{_text(h)}</th>" for h in ("trial", "state", "epochs", objective, *names, "error"))
    rows = []
    for trial in trials:
        summary = trial_summary(trial)
        value = "" if summary["value"] is None else _value(summary["value"])
        cells = [str(summary["number"]), summary["state"], str(summary["epochs"]), value,
                 *(_value(trial.params[n]) if n in trial.params else "" for n in names), summary.get("error", "")]
        rows.append(f"<tr class='{_text(summary['state'])}' data-trial='{summary['number']}'>"
                    + "".join(f"<td>{_text(c)}</td>" for c in cells) + "</tr>")
    body = "\n".join(rows) or f"<tr><td colspan='{5 + len(names)}'>No trials yet.</td></tr>"
    return f"<table id='trials'><tr>{head}</tr>\n{body}</table>"


PAGE = """<!doctype html>
<html><head><meta charset="utf-8">
<meta http-equiv="Content-Security-Policy" content="{csp}">
<title>{title}</title>
<style>body{{font-family:sans-serif;margin:1.5em;max-width:1400px}}
section{{margin-bottom:1.5em}} h2{{font-size:1.1em;margin:0.6em 0}}
p.unavailable{{color:#666;font-style:italic}}
table{{border-collapse:collapse}} td,th{{border-bottom:1px solid #ddd;padding:3px 8px;text-align:left;font-size:13px}}
tr.PRUNED td{{color:#777}} tr.FAIL td{{color:#a00}}</style>
<script>{plotlyjs}</script></head>
<body><h1>{title}</h1>
{header}
{sections}
<section id='trial-table'><h2>Trials</h2>
{table}</section>
<p class='footer'>{footer}</p>
</body></html>
"""
