"""The season view: a pipeline's run ledger drawn as one inline SVG chart, night by night.

From the ledger's records (nightshift.ledger): the primary metric of the champion and of the challenger on each
night's test split, each night's decision as a mark (promoted, refused, skipped, failed), and the data: which
dataset version each night ran on (a band per version) and its drift (the share of test rows outside the
challenger's training range). Standard library only: the Airflow plugin draws it above the lineage table.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from nightshift import svg
from nightshift.tasks import BINARY, DEFAULT_GATES, MULTICLASS, REGRESSION

DECISIONS = {  # kind: (colour, marker, what it means)
    "promoted": (svg.GOOD, "circle", "promoted: the challenger became the champion"),
    "refused": ("#e65100", "cross", "refused: the champion kept serving"),
    "skipped": (svg.NEUTRAL, "triangle", "skipped: nothing changed since the last run"),
    "failed": (svg.BAD, "square", "failed: a task failed"),
}
CHAMPION = "#1565c0"
WIDTH, LEFT, RIGHT = 960, 70, 20
METRIC_TOP, METRIC_HEIGHT = 52, 160
STRIP_Y = METRIC_TOP + METRIC_HEIGHT + 22
DRIFT_TOP, DRIFT_HEIGHT = STRIP_Y + 20, 56
HEIGHT = DRIFT_TOP + DRIFT_HEIGHT + 30


def decision(record: dict[str, Any]) -> str:
    """The night's decision: failed, skipped (training skipped), promoted, or refused (the gate or the approval
    said no, or nothing was deployed)."""
    outcome = str(record.get("outcome") or "")
    if record.get("status") == "failed":
        return "failed"
    if outcome.startswith("training skipped"):
        return "skipped"
    return "promoted" if outcome.startswith("promoted") else "refused"


def primary_metric(records: Sequence[dict[str, Any]]) -> str | None:
    """The gate's primary metric of the newest record that names it; for older records, the default primary
    metric of the task their scores show (rmse: regression, roc_auc: binary, else multiclass)."""
    gates = [r.get("gate") for r in reversed(records) if isinstance(r.get("gate"), dict)]
    for gate in gates:
        if gate.get("primary"):
            return str(gate["primary"])
    for gate in gates:
        scores = gate.get("challenger") or {}
        if scores:
            task = REGRESSION if "rmse" in scores else BINARY if "roc_auc" in scores else MULTICLASS
            return DEFAULT_GATES[task][0]
    return None


def _value(scores: Any, name: str | None) -> float | None:
    value = scores.get(name) if isinstance(scores, dict) and name else None
    return float(value) if svg.finite(value) else None


def nights(records: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """One entry per record, oldest first: when, decision, the champion's and the challenger's primary metric,
    dataset version, drift and a tooltip."""
    ordered = sorted(records, key=lambda r: str(r.get("recorded_at") or ""))
    name = primary_metric(ordered)
    out = []
    for r in ordered:
        gate: dict[str, Any] = r["gate"] if isinstance(r.get("gate"), dict) else {}
        kind = decision(r)
        drift = gate.get("rows_outside_train_range")
        entry: dict[str, Any] = {"when": str(r.get("recorded_at") or ""), "decision": kind,
                                 "run_id": str(r.get("run_id") or ""),
                                 "champion": _value(gate.get("champion"), name),
                                 "challenger": _value(gate.get("challenger"), name),
                                 "champion_version": (gate.get("champion") or {}).get("version"),
                                 "dataset": str(r.get("dataset_version") or ""),
                                 "drift": float(drift) if svg.finite(drift) else None}
        lines = [f"{entry['when'][:16].replace('T', ' ')} {entry['run_id']}: {kind}",
                 str(r.get("outcome") or "")]
        if entry["challenger"] is not None:
            lines.append(f"challenger {name} {svg.number(entry['challenger'])}")
        if entry["champion"] is not None:
            lines.append(f"champion v{entry['champion_version']} {name} {svg.number(entry['champion'])}")
        if entry["dataset"]:
            lines.append(f"dataset {entry['dataset'][:12]}")
        if entry["drift"] is not None:
            lines.append(f"rows outside the training range {entry['drift']:.3f}")
        if r.get("reason"):
            lines.append(str(r["reason"])[:300])
        entry["tip"] = "\n".join(line for line in lines if line)
        out.append(entry)
    return out


def season_svg(records: Sequence[dict[str, Any]]) -> str:
    """The season chart of `records` (any order); "" when there is none."""
    entries = nights(records)
    if not entries:
        return ""
    name = primary_metric(records) or "metric"
    inner = WIDTH - LEFT - RIGHT
    step = inner / len(entries)

    def px(i: int) -> float:
        return LEFT + (i + 0.5) * step

    parts = [_metric_panel(entries, name, px), _strip(entries, px), _data_panel(entries, px, step)]
    marks = max(1, len(entries) // 12)
    days = [e["when"][5:10] for e in entries]
    same_day = len(set(days)) < len(days)  # runs by hand between the nights: the time tells them apart
    for i, entry in enumerate(entries):
        if i % marks == 0:
            label = entry["when"][5:16].replace("T", " ") if same_day else days[i]
            parts.append(f"<text x='{px(i):.1f}' y='{HEIGHT - 12}' text-anchor='middle'>{svg.text(label)}</text>")
    legend = svg.legend([("champion", CHAMPION, "circle"),
                         *((kind, color, shape) for kind, (color, shape, _) in DECISIONS.items())], LEFT, 32)
    title = f"{name} night by night, decisions and data (oldest left, {len(entries)} runs)"
    return (f"<svg xmlns='http://www.w3.org/2000/svg' class='season' width='{WIDTH}' height='{HEIGHT}' "
            f"viewBox='0 0 {WIDTH} {HEIGHT}' role='img' aria-label='{svg.text(title)}' {svg.FONT}>"
            f"<text x='4' y='14' font-size='13' font-weight='bold'>{svg.text(title)}</text>{legend}"
            + "".join(parts) + "</svg>")


def _metric_panel(entries: list[dict[str, Any]], name: str, px: Any) -> str:
    values = [v for e in entries for v in (e["champion"], e["challenger"]) if v is not None]
    parts = [f"<rect x='{LEFT}' y='{METRIC_TOP}' width='{WIDTH - LEFT - RIGHT}' height='{METRIC_HEIGHT}' "
             f"fill='none' stroke='#ccc'/>",
             f"<text x='12' y='{METRIC_TOP + METRIC_HEIGHT / 2:.1f}' text-anchor='middle' "
             f"transform='rotate(-90 12 {METRIC_TOP + METRIC_HEIGHT / 2:.1f})'>test {svg.text(name)}</text>"]
    if not values:
        parts.append(f"<text x='{LEFT + 8}' y='{METRIC_TOP + 20}' fill='#666'>no night was scored yet</text>")
        return "".join(parts)
    low, high = min(values), max(values)
    pad = (high - low) * 0.1 or abs(high) * 0.02 or 0.01
    low, high = low - pad, high + pad

    def py(value: float) -> float:
        return METRIC_TOP + (high - value) / (high - low) * METRIC_HEIGHT

    for tick in svg.ticks(low, high, 4):
        parts.append(f"<line x1='{LEFT}' x2='{WIDTH - RIGHT}' y1='{py(tick):.1f}' y2='{py(tick):.1f}' stroke='#eee'/>"
                     f"<text x='{LEFT - 4}' y='{py(tick) + 4:.1f}' text-anchor='end'>{tick:.6g}</text>")
    path = "".join(f"{'M' if n == 0 else 'L'}{px(i):.1f},{py(e['champion']):.1f}"
                   for n, (i, e) in enumerate((i, e) for i, e in enumerate(entries) if e["champion"] is not None))
    if path.count("L"):
        parts.append(f"<path d='{path}' fill='none' stroke='{CHAMPION}' stroke-width='1.8'/>")
    for i, e in enumerate(entries):
        if e["champion"] is not None:
            parts.append(svg.marker("circle", px(i), py(e["champion"]), CHAMPION, e["tip"], size=3.5))
        if e["challenger"] is not None:
            color, shape, _ = DECISIONS[e["decision"]]
            parts.append(svg.marker(shape, px(i), py(e["challenger"]), color, e["tip"], size=4.5))
    return "".join(parts)


def _strip(entries: list[dict[str, Any]], px: Any) -> str:
    parts = [f"<text x='{LEFT - 4}' y='{STRIP_Y + 4}' text-anchor='end'>decision</text><g class='decisions'>"]
    for i, e in enumerate(entries):
        color, shape, _ = DECISIONS[e["decision"]]
        parts.append(svg.marker(shape, px(i), STRIP_Y, color, e["tip"], size=5))
    return "".join(parts) + "</g>"


def _data_panel(entries: list[dict[str, Any]], px: Any, step: float) -> str:
    parts = [f"<text x='{LEFT - 4}' y='{DRIFT_TOP + 12}' text-anchor='end'>data</text>",
             f"<text x='{LEFT - 4}' y='{DRIFT_TOP + 26}' text-anchor='end' fill='#666'>drift</text>"]
    start, band = 0, 0
    for i in range(1, len(entries) + 1):
        if i < len(entries) and entries[i]["dataset"] == entries[start]["dataset"]:
            continue
        band += 1
        version = entries[start]["dataset"]
        if version:
            x, width = px(start) - step / 2, step * (i - start)
            label = svg.text(version[:8]) if width >= 52 else ""
            parts.append(f"<g><title>dataset {svg.text(version)}</title><rect x='{x:.1f}' y='{DRIFT_TOP}' "
                         f"width='{width:.1f}' height='{DRIFT_HEIGHT}' fill='{'#eceff1' if band % 2 else '#e3f2fd'}' "
                         f"stroke='#fff'/><text x='{x + 3:.1f}' y='{DRIFT_TOP + 10}' font-size='9' fill='#455a64'>"
                         f"{label}</text></g>")
        start = i
    drifts = [e["drift"] for e in entries if e["drift"] is not None]
    scale = max([*drifts, 0.01])
    for i, e in enumerate(entries):
        if e["drift"] is None:
            continue
        height = e["drift"] / scale * (DRIFT_HEIGHT - 14)
        parts.append(f"<g><title>{svg.text(e['tip'])}</title><rect x='{px(i) - step * 0.3:.1f}' "
                     f"y='{DRIFT_TOP + DRIFT_HEIGHT - height:.1f}' width='{step * 0.6:.1f}' height='{height:.1f}' "
                     f"fill='#8e24aa'/></g>")
    parts.append(f"<text x='{WIDTH - RIGHT}' y='{DRIFT_TOP - 3}' text-anchor='end' fill='#666' font-size='10'>"
                 f"bars: share of test rows outside the training range (top of the band = {scale:.3f})</text>")
    return "".join(parts)
