"""The decision page of a night: what `evaluate` decided, shown as one self-contained HTML page.

The challenger beside the champion on the same split: every metric of the task with the gate's rule for it and
its verdict; the confusion matrices side by side with their difference and the per-class recall deltas
(classification) or the residuals against the predictions (regression); each feature's drift (the share of rows
outside the training range, from `evaluate`, and the Kolmogorov-Smirnov distance between the training split and
the evaluated one) with the worst feature's two distributions drawn; the training curves of both runs. Figures
are inline SVG (nightshift.svg): the page runs no script and fetches nothing (CSP below).

`publish` (called by nightshift.evaluate.evaluate) logs it to the training run as `evaluation/decision.html`
and, for a run a pipeline trained (its `nightshift.run_key` tag is `<dag_id>/<run id>`), writes a copy to
NIGHTSHIFT_HOME/decisions/<dag_id>/<MLflow run id>/decision.html, which the Airflow plugin serves to the
readers of that DAG's runs and links from the `evaluate` task and the lineage page.
"""

from __future__ import annotations

import itertools
import logging
import math
import re
import tempfile
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from nightshift import settings, svg
from nightshift.errors import DataError, EvaluationError, UsageError
from nightshift.tasks import REGRESSION, metric, metric_names

if TYPE_CHECKING:  # numpy is imported where it is used: the Airflow plugin imports page_path from here
    import numpy as np

logger = logging.getLogger(__name__)
PAGE_NAME = "decision.html"
ARTIFACT_DIR = "evaluation"
CSP = "default-src 'none'; style-src 'unsafe-inline'; base-uri 'none'; form-action 'none'"
RUN_ID_PATTERN = re.compile(r"[A-Za-z0-9_-]{1,64}")  # an MLflow run id: 32 hex digits
RESIDUAL_POINTS = 400  # of the evaluated rows, evenly spaced: enough to see a residual pattern
DRIFT_ROWS = 20_000  # per split and column, evenly spaced, for the distribution distance
DRAWN_COLUMNS = 20  # the worst columns drawn as bars; the table below lists every column
BINS = 20
GONE = frozenset({"RESOURCE_DOES_NOT_EXIST", "NOT_FOUND", "PERMISSION_DENIED"})  # MLflow's error codes
CHALLENGER, CHAMPION = "#ef6c00", "#1565c0"


def page_path(dag_id: str, run_id: str) -> Path:
    """NIGHTSHIFT_HOME/decisions/<dag_id>/<run_id>/decision.html; UsageError (DagIdInvalid) for an id that would
    name another folder."""
    if not RUN_ID_PATTERN.fullmatch(str(run_id)):
        raise UsageError(f"{str(run_id)[:80]!r} is not an MLflow run id (letters, digits, '_' or '-')")
    return settings.home() / "decisions" / settings.checked_dag_id(dag_id) / run_id / PAGE_NAME


def residual_sample(target: np.ndarray, predicted: np.ndarray) -> dict[str, list[float]]:
    """Up to RESIDUAL_POINTS (prediction, target - prediction) pairs of evenly spaced rows: the residual plot's."""
    import numpy as np

    rows = np.unique(np.linspace(0, len(target) - 1, min(len(target), RESIDUAL_POINTS)).astype(int))
    return {"predicted": [float(v) for v in predicted[rows]],
            "residual": [float(v) for v in (target - predicted)[rows]]}


def ks_distance(reference: np.ndarray, current: np.ndarray) -> float:
    """The two-sample Kolmogorov-Smirnov statistic: the largest gap between the two empirical distributions
    (0: alike, 1: apart). NaN when either side has no finite value."""
    import numpy as np

    a, b = np.sort(reference[np.isfinite(reference)]), np.sort(current[np.isfinite(current)])
    if not len(a) or not len(b):
        return math.nan
    values = np.concatenate([a, b])
    gap = np.searchsorted(a, values, side="right") / len(a) - np.searchsorted(b, values, side="right") / len(b)
    return float(np.abs(gap).max())


def _spaced(values: np.ndarray) -> np.ndarray:
    import numpy as np

    return values[np.linspace(0, len(values) - 1, DRIFT_ROWS).astype(int)] if len(values) > DRIFT_ROWS else values


class _ColumnReader:
    """A split's Parquet file read one column at a time: a training split larger than the evaluate task's
    memory is never held whole (evaluate holds the evaluated split's table already)."""

    def __init__(self, data_dir: str | Path, split: str) -> None:
        import pyarrow.parquet as pq

        from nightshift.datasets import split_path

        self.path = split_path(data_dir, split)
        if not self.path.is_file():
            raise DataError(f"{self.path} is missing: no {split} split to compare with")
        try:
            self.file = pq.ParquetFile(self.path)
        except Exception as err:  # pyarrow raises several unrelated types for unreadable files
            raise DataError(f"{self.path} is not a readable Parquet file ({type(err).__name__}: {err})") from err
        index = {c for c in (self.file.schema_arrow.pandas_metadata or {}).get("index_columns", [])
                 if isinstance(c, str)}  # a pandas index saved as a column (__index_level_0__): not data
        self.columns = [str(c) for c in self.file.schema_arrow.names if c not in index]

    def values(self, column: str) -> np.ndarray:
        """The column as float64 (nulls NaN); TypeError or ValueError for a column of text."""
        import numpy as np

        return np.asarray(self.file.read(columns=[column]).column(0).to_pandas().to_numpy(np.float64))


def column_drift(data_dir: str | Path, split: str, label_column: str, result: dict[str, Any]
                 ) -> tuple[list[dict[str, Any]], dict[str, Any] | None]:
    """(each numeric feature's drift, worst first; the worst column's two histograms, or None). The features:
    the challenger's (`evaluate`'s drift names them), else every column but the label. A feature's
    drift: the KS distance between the training split and `split`, and the shares of rows outside the
    challenger's and the champion's training ranges (`evaluate`'s figures)."""
    import numpy as np

    train, tonight = _ColumnReader(data_dir, "train"), _ColumnReader(data_dir, split)
    # A model that records no training range (drift None, a pyfunc of another kind): its shares are unknown, not 0.
    drift, their_drift = ((result.get(who) or {}).get("drift") for who in ("challenger", "champion"))
    outside = (drift or {}).get("columns") or {}
    features = set(drift["features"]) if drift and drift.get("features") else None  # else: all but the label
    theirs = (their_drift or {}).get("columns") or {}
    columns: list[dict[str, Any]] = []
    for name in tonight.columns:
        if name == label_column or name not in train.columns or (features and name not in features):
            continue  # an id, a timestamp the model never reads: its drift is no model's
        try:
            reference, current = _spaced(train.values(name)), _spaced(tonight.values(name))
        except (TypeError, ValueError):  # a text column: no distance of this kind
            continue
        columns.append({"column": name, "distance": ks_distance(reference, current),
                        "outside": float(outside.get(name, 0.0)) if drift is not None else None,
                        "outside_champion": float(theirs.get(name, 0.0)) if their_drift is not None else None})
    columns.sort(key=lambda c: (-(c["distance"] if math.isfinite(c["distance"]) else -1), c["column"]))
    if not columns or not math.isfinite(columns[0]["distance"]):
        return columns, None
    worst = columns[0]["column"]
    reference, current = train.values(worst), tonight.values(worst)
    reference, current = reference[np.isfinite(reference)], current[np.isfinite(current)]
    low, high = float(min(reference.min(), current.min())), float(max(reference.max(), current.max()))
    if not math.isfinite(high - low):  # values near ±1.8e308 (a sentinel): no bins span them; the table has it
        return columns, None
    edges = np.linspace(low, high if high > low else low + 1.0, BINS + 1)
    return columns, {"column": worst, "edges": edges.tolist(),
                     "train": (np.histogram(reference, edges)[0] / len(reference)).tolist(),
                     "tonight": (np.histogram(current, edges)[0] / len(current)).tolist()}


def training_curves(run_id: str) -> dict[str, list[list[float]]]:
    """The per-epoch metrics the trainer logged to run `run_id` (step = epoch): {metric: [[epoch, value]]}, for
    each metric with two epochs or more."""
    from nightshift import tracking

    mlflow_client = tracking.client()
    curves = {}
    for key in sorted(mlflow_client.get_run(run_id).data.metrics):
        history = {int(m.step): float(m.value) for m in mlflow_client.get_metric_history(run_id, key)}
        if len(history) > 1:
            curves[key] = [[step, value] for step, value in sorted(history.items())]
    return curves


def gather(result: dict[str, Any], *, data_dir: str | Path, label_column: str) -> dict[str, Any]:
    """What the page draws: `evaluate`'s result, each feature's drift and both runs' training curves."""
    from nightshift import tracking

    page = {**result, "label_column": label_column, "written_at": datetime.now(UTC).isoformat(timespec="seconds"),
            "drift_columns": [], "worst": None, "drift_note": None, "curves": {}}
    try:
        page["drift_columns"], page["worst"] = column_drift(data_dir, str(result["split"]), label_column, result)
    except DataError as err:  # a data folder without its training split (an evaluation by hand)
        page["drift_note"] = f"no distribution distance: {err}"
    except (ValueError, TypeError, ArithmeticError) as err:  # a column this code cannot measure: a bug, as below
        logger.exception("the drift of the decision page of MLflow run %s could not be computed", result["run_id"])
        page["drift_note"] = (f"no distribution distance: it could not be computed ({type(err).__name__}: "
                              f"{str(err)[:300]}), a Nightshift bug; please report it")
    page["curves"]["challenger"] = training_curves(str(result["run_id"]))
    champion = result.get("champion")
    if champion is not None:
        from mlflow.exceptions import MlflowException

        version = tracking.client().get_model_version(str(result["model_name"]), str(champion["version"]))
        try:
            if version.run_id:
                page["curves"]["champion"] = training_curves(str(version.run_id))
        except MlflowException as err:
            # The champion's training run is gone (`mlflow gc`) or not ours to read, while its model still
            # serves: every night would fail on it until a challenger won, and none can win if evaluate fails.
            if err.error_code not in GONE:
                raise
            page["curves_note"] = (f"the champion's training run {version.run_id} cannot be read "
                                   f"({err.error_code}): its curves are not drawn")
    return page


def publish(result: dict[str, Any], *, data_dir: str | Path, label_column: str) -> dict[str, Any]:
    """Draw the decision page of `evaluate`'s `result`, log it to the training run (`evaluation/decision.html`)
    and keep the copy the Airflow plugin serves. {"artifact": path in the run, "path": the copy or None (a run
    no pipeline trained)}. EvaluationError when MLflow or the copy's folder fails (external systems: loud, and
    the task's retry tries again); what the page's own code cannot draw or measure, or a champion's training
    run that is gone, the page says instead, and the night goes on (the champion would stay, and every night
    fail alike)."""
    from nightshift import tracking

    run_id = str(result["run_id"])
    try:
        page = render(gather(result, data_dir=data_dir, label_column=label_column))
        mlflow_client = tracking.client()
        with tempfile.TemporaryDirectory() as tmp:
            local = Path(tmp) / PAGE_NAME
            local.write_text(page, encoding="utf-8")
            mlflow_client.log_artifact(run_id, str(local), artifact_path=ARTIFACT_DIR)
        run_key = str(mlflow_client.get_run(run_id).data.tags.get(tracking.RUN_KEY_TAG) or "")
        dag_id, by_a_pipeline, _ = run_key.partition("/")
        copy = None
        try:
            copy = page_path(dag_id, run_id) if by_a_pipeline else None
        except UsageError:
            pass  # not a pipeline's run: the page is in MLflow only
        if copy is not None:
            from nightshift.fsutil import atomic_write_bytes

            copy.parent.mkdir(parents=True, exist_ok=True)
            atomic_write_bytes(copy, page.encode())
    except Exception as err:
        raise EvaluationError(f"the decision page of MLflow run {run_id} could not be written "
                              f"({type(err).__name__}: {err})") from err
    return {"artifact": f"{ARTIFACT_DIR}/{PAGE_NAME}", "path": str(copy) if copy else None}


# --- the page -------------------------------------------------------------------------------------------------

def metric_rows(result: dict[str, Any]) -> list[dict[str, Any]]:
    """Each metric of the task: both values, the change (positive: the challenger is better), the gate's rule
    for it and its verdict ("pass", "fail", or "" when not gated), with the gate's own sentence about it."""
    gate = result.get("gate") or {}
    task = str(gate.get("task"))
    primary, guards = gate.get("primary"), gate.get("guards") or {}
    challenger, champion = result.get("challenger") or {}, result.get("champion")
    reasons = [str(r) for r in result.get("reasons") or []]
    rows = []
    for name in metric_names(task):
        ours, theirs = challenger.get(name), (champion or {}).get(name)
        change = metric(task, name).gain(ours, theirs) if svg.finite(ours) and svg.finite(theirs) else None
        better = "higher" if metric(task, name).higher_is_better else "lower"
        said = ""
        if name == primary:
            role = "primary"
            if champion is not None:
                rule = f"must beat the champion by at least {gate.get('min_improvement', 0):.4f} ({better} is better)"
                said = next((r for r in reasons if r.startswith(f"{name} ") and "vs champion" in r), "")
            elif gate.get("floor") is not None:
                rule = f"no champion: must reach the floor {float(gate['floor']):.4f} ({better} is better)"
                said = next((r for r in reasons if r.startswith("no champion")), "")
            else:
                rule = "no champion and no floor: accepted"
                said = next((r for r in reasons if r.startswith("no champion")), "")
            verdict = ("pass" if re.search(r">= min_improvement|meets the floor|is accepted", said) else
                       "fail" if said else "")
        elif name in guards:
            role = "guard"
            rule = f"may fall behind the champion by at most {float(guards[name]):.4f} ({better} is better)"
            said = next((r for r in reasons if r.startswith(f"guard {name} ")), "")
            verdict = "pass" if " within tolerance" in said else "fail" if said else ""
            if champion is None:
                rule += "; not checked without a champion"
        else:
            role, rule, verdict = "reported", f"not gated ({better} is better)", ""
        broken = next((r for r in reasons if r.startswith("the challenger's ")), "") if name in challenger else ""
        if broken and not svg.finite(ours):  # decide rejects a challenger with any metric not a finite number
            verdict, said = "fail", broken
        rows.append({"metric": name, "role": role, "challenger": ours, "champion": theirs, "change": change,
                     "rule": rule, "verdict": verdict, "reason": said})
    return rows


STYLE = """body{font-family:sans-serif;margin:1.5em;color:#222;max-width:1500px}
h1{font-size:22px}h2{font-size:17px;margin-top:1.6em;border-bottom:1px solid #ddd}
table{border-collapse:collapse}td,th{border-bottom:1px solid #e4e4e4;padding:4px 8px;text-align:left;font-size:14px}
td.num{text-align:right;font-variant-numeric:tabular-nums}.pass{color:#2e7d32;font-weight:bold}
.fail{color:#c62828;font-weight:bold}.banner{padding:.6em 1em;border-radius:4px;font-size:17px;margin:.8em 0}
.banner.passed{background:#e8f5e9}.banner.refused{background:#ffebee}.banner.person{background:#fff8e1}
.figures{display:flex;flex-wrap:wrap;gap:18px;align-items:flex-start}.note{color:#555}
ul.reasons li{margin:.2em 0}details{margin-top:.6em}"""


def render(page: dict[str, Any]) -> str:
    """The page's HTML from `gather`'s dict (pure: the same dict gives the same page)."""
    gate = page.get("gate") or {}
    champion = page.get("champion")
    model, run_id = str(page.get("model_name", "")), str(page.get("run_id", ""))
    title = f"Decision: {model} run {run_id[:12]}"
    sections = [_summary(page), _metrics_table(metric_rows(page))]
    try:
        sections += [_residuals(page) if gate.get("task") == REGRESSION else _classes(page), _drift(page),
                     _curves(page)]
    except Exception as err:  # a figure this night's data draws wrong (a bug): see below
        # The gate decided and evaluate logged it; a drawing must not fail the night (the champion stays, and
        # with it the same drawing, so every night would fail). The page says what went wrong, and so does
        # the log.
        logger.exception("the figures of the decision page of MLflow run %s could not be drawn", page.get("run_id"))
        sections.append(f"<h2>Figures</h2><p class='fail'>The figures could not be drawn "
                        f"({svg.text(type(err).__name__)}: {svg.text(str(err)[:500])}): a Nightshift bug, "
                        f"please report it. The decision above is the gate's.</p>")
    champion_text = f"champion v{champion['version']}" if champion else "no champion to compare with"
    return f"""<!doctype html>
<html><head><meta charset="utf-8"><meta http-equiv="Content-Security-Policy" content="{svg.text(CSP)}">
<title>{svg.text(title)}</title><style>{STYLE}</style></head>
<body><h1>{svg.text(title)}</h1>
<p class='note'>The challenger (MLflow run <code>{svg.text(run_id)}</code>) beside the {svg.text(champion_text)}
on the <b>{svg.text(page.get('split'))}</b> split ({svg.text(page.get('challenger', {}).get('rows'))} rows),
task {svg.text(gate.get('task'))}. Written {svg.text(page.get('written_at'))}.</p>
{''.join(sections)}
</body></html>"""


def _summary(page: dict[str, Any]) -> str:
    if page.get("needs_approval"):
        kind, verdict = "person", "Goes to a person: approve or reject the new model in the approval step"
    elif page.get("passed"):
        kind, verdict = "passed", "Passed the gate: the challenger goes on to be registered and deployed"
    else:
        kind, verdict = "refused", "Refused by the gate: the champion keeps serving"
    reasons = "".join(f"<li>{svg.text(r)}</li>" for r in page.get("reasons") or [])
    return f"<div class='banner {kind}'>{svg.text(verdict)}</div><ul class='reasons'>{reasons}</ul>"


def _signed(value: Any) -> str:
    return f"{value:+.4f}" if svg.finite(value) else "—"


def _metrics_table(rows: list[dict[str, Any]]) -> str:
    body = "".join(
        f"<tr><td><b>{svg.text(r['metric'])}</b></td><td>{r['role']}</td>"
        f"<td class='num'>{svg.number(r['challenger'])}</td><td class='num'>{svg.number(r['champion'])}</td>"
        f"<td class='num'>{_signed(r['change'])}</td><td>{svg.text(r['rule'])}</td>"
        f"<td class='{r['verdict']}' title='{svg.text(r['reason'])}'>{r['verdict'] or '—'}</td></tr>" for r in rows)
    return ("<h2>Metrics</h2><table><tr><th>metric</th><th>role</th><th>challenger</th><th>champion</th>"
            "<th>change (+ better)</th><th>the gate's rule</th><th>verdict</th></tr>" + body + "</table>")


def _figures(*figures: str) -> str:
    return "<div class='figures'>" + "".join(f"<div>{f}</div>" for f in figures) + "</div>"


def _classes(page: dict[str, Any]) -> str:
    import numpy as np

    challenger: dict[str, Any] = page.get("challenger") or {}
    champion: dict[str, Any] = page.get("champion") or {}
    labels = [str(c) for c in challenger.get("classes") or []]
    ours = challenger.get("confusion_matrix")
    if not labels or not ours:
        return ""
    cell = max(16, min(32, 420 // len(labels)))
    matrices = [svg.heatmap(ours, labels, title="challenger: confusion matrix", cell=cell)]
    theirs = champion.get("confusion_matrix") or []
    same = bool(theirs) and [str(c) for c in champion.get("classes") or []] == labels
    if same:
        difference = (np.asarray(ours) - np.asarray(theirs)).tolist()
        matrices += [svg.heatmap(theirs, labels, title=f"champion v{champion['version']}: confusion matrix",
                                 cell=cell),
                     svg.heatmap(difference, labels, title="difference (challenger − champion)", cell=cell,
                                 difference=True)]
    recall = challenger.get("per_class_recall") or {}
    if same:
        before = champion.get("per_class_recall") or {}
        deltas = [(c, [recall[c] - before[c] if svg.finite(recall.get(c)) and svg.finite(before.get(c)) else None])
                  for c in labels]
        bars = svg.hbars(deltas, ["recall change"], [CHALLENGER], title="per-class recall: challenger − champion",
                         diverging=True)
        both = svg.hbars([(c, [recall.get(c), before.get(c)]) for c in labels], ["challenger", "champion"],
                         [CHALLENGER, CHAMPION], title="per-class recall")
        recalls = _figures(bars, both)
    else:
        recalls = _figures(svg.hbars([(c, [recall.get(c)]) for c in labels], ["challenger"], [CHALLENGER],
                                     title="per-class recall (no champion to compare with)"))
    note = ("In the difference, green is better (more right on the diagonal, fewer wrong off it)." if same else
            "No champion was scored on this split: the challenger alone.")
    return ("<h2>Where the errors are</h2><p class='note'>Rows: the true class; columns: the predicted one. "
            f"{note}</p>" + _figures(*matrices) + recalls)


def _residuals(page: dict[str, Any]) -> str:
    plots = []
    for who, scores, color in (("challenger", page.get("challenger") or {}, CHALLENGER),
                               ("champion", page.get("champion") or {}, CHAMPION)):
        residuals = scores.get("residuals")
        if not residuals:
            continue
        name = f"champion v{scores['version']}" if who == "champion" else who
        points = list(zip(residuals["predicted"], residuals["residual"], strict=True))
        plots.append(svg.plot([svg.Series(name, points, color, line=False)], zero_line=True,
                              title=f"{name}: residuals (rmse {svg.number(scores.get('rmse'))})",
                              x_label="predicted", y_label="target − predicted"))
    if not plots:
        return ""
    return ("<h2>Residuals</h2><p class='note'>Each point a row of the split (up to "
            f"{RESIDUAL_POINTS}, evenly spaced); a good model's scatter is a flat band around zero.</p>"
            + _figures(*plots))


def _drift(page: dict[str, Any]) -> str:
    columns = page.get("drift_columns") or []
    rows = [((page.get("challenger") or {}).get("drift") or {}).get("rows"),
            ((page.get("champion") or {}).get("drift") or {}).get("rows")]
    share = "; ".join(f"{who}'s: {svg.number(v)}" for who, v in zip(("challenger", "champion"), rows, strict=True)
                      if svg.finite(v))
    head = ("<h2>Drift</h2><p class='note'>Per feature: the Kolmogorov-Smirnov distance between the training split "
            "and this split (0: alike, 1: apart) and the share of rows outside each model's training range. "
            f"Rows with any value outside the training range: {svg.text(share or 'not recorded')}.</p>")
    if page.get("drift_note"):
        head += f"<p class='note'>{svg.text(page['drift_note'])}</p>"
    if not columns:
        return head
    champion = page.get("champion") is not None
    names = ["KS distance", "outside challenger's range", *(["outside champion's range"] if champion else [])]
    colors = ["#6a1b9a", CHALLENGER, CHAMPION][:len(names)]
    drawn = [(c["column"], [c["distance"], c["outside"], *([c["outside_champion"]] if champion else [])])
             for c in columns[:DRAWN_COLUMNS]]
    bars = svg.hbars(drawn, names, colors, title=f"the {len(drawn)} most drifted of {len(columns)} features",
                     width=520)
    figures = [bars]
    worst = page.get("worst")
    if worst:
        edges = worst["edges"]
        centres = [(a + b) / 2 for a, b in itertools.pairwise(edges)]
        figures.append(svg.plot([svg.Series("training split", list(zip(centres, worst["train"], strict=True)),
                                            CHAMPION),
                                 svg.Series(f"{page.get('split')} split", list(zip(centres, worst["tonight"],
                                                                                   strict=True)), CHALLENGER)],
                                title=f"worst: {svg.short(worst['column'], 40)}", x_label=str(worst["column"]),
                                y_label="share of rows"))
    table = "".join(f"<tr><td>{svg.text(c['column'])}</td><td class='num'>{svg.number(c['distance'], 3)}</td>"
                    f"<td class='num'>{svg.number(c['outside'], 3)}</td>"
                    f"<td class='num'>{svg.number(c['outside_champion'], 3)}</td></tr>" for c in columns)
    return (head + _figures(*figures) + "<details><summary>every feature</summary><table><tr><th>feature</th>"
            "<th>KS distance</th><th>outside challenger's range</th><th>outside champion's range</th></tr>"
            + table + "</table></details>")


def _curves(page: dict[str, Any]) -> str:
    curves = page.get("curves") or {}
    ours, theirs = curves.get("challenger") or {}, curves.get("champion") or {}
    keys = sorted(set(ours) | set(theirs))
    groups = [("loss per epoch", [k for k in keys if "loss" in k]),
              ("validation metric per epoch", [k for k in keys if k.startswith("val_") and "loss" not in k])]
    palette = ["#ef6c00", "#6a1b9a", "#2e7d32", "#00838f"]
    plots = []
    for title, names in groups:
        series = []
        for i, key in enumerate(names):
            color = palette[i % len(palette)]
            if key in ours:
                series.append(svg.Series(key, [(p[0], p[1]) for p in ours[key]], color, marker="circle"))
            if key in theirs:
                series.append(svg.Series(f"{key} (champion)", [(p[0], p[1]) for p in theirs[key]], color,
                                         marker="triangle", dashed=True))
        if series:
            plots.append(svg.plot(series, title=title, x_label="epoch", y_label="value", width=520))
    note = f"<p class='note'>{svg.text(page['curves_note'])}</p>" if page.get("curves_note") else ""
    if not plots:
        return f"<h2>Training</h2><p class='note'>The training runs logged no per-epoch metrics.</p>{note}"
    return ("<h2>Training</h2><p class='note'>Per-epoch metrics the trainer logged; the champion's run dashed.</p>"
            + note + _figures(*plots))
