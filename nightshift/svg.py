"""Small inline SVG figures for Nightshift's pages: line and point plots, horizontal bars, heatmaps.

Standard library only (the Airflow plugin draws with it in the API server). Every figure is a string of SVG
to put inline in an HTML page: no script, no stylesheet, nothing fetched, so it shows under a
Content-Security-Policy that allows no script at all. Every text that reaches a figure (a column or a class
name, a tooltip) is escaped here; a point's tooltip is an SVG `<title>`, which a browser shows on hover.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from html import escape
from typing import TypeGuard

FONT = "font-family='sans-serif' font-size='11'"
GOOD, BAD, NEUTRAL = "#2e7d32", "#c62828", "#9e9e9e"
LABEL_CHARS = 22  # longer names are cut on the axis; the full name is the tooltip


def text(value: object) -> str:
    """`value` as escaped text for an SVG or HTML page (quotes included: safe in an attribute too)."""
    return escape("" if value is None else str(value), quote=True)


def short(value: object, chars: int = LABEL_CHARS) -> str:
    name = str(value)
    return name if len(name) <= chars else name[:chars - 1] + "…"


def finite(value: object) -> TypeGuard[float]:
    """Whether `value` is a finite number (not a bool)."""
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def number(value: object, digits: int = 4) -> str:
    """A metric as text: fixed `digits` decimals, an int as it is, "—" for a missing or non-finite value."""
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    return f"{value:.{digits}f}" if finite(value) else "—"


def ticks(low: float, high: float, count: int = 5) -> list[float]:
    """Round values from `low` to `high` (about `count` of them) for an axis."""
    if not (math.isfinite(low) and math.isfinite(high)) or high <= low:
        return [low] if math.isfinite(low) else []
    raw = (high - low) / max(count, 1)
    if not math.isfinite(raw) or raw <= 0:  # a span beyond the largest float, or below the smallest step
        return [low]
    magnitude = 10 ** math.floor(math.log10(raw))
    step = next(m * magnitude for m in (1, 2, 2.5, 5, 10) if m * magnitude >= raw)
    first = math.ceil(low / step - 1e-9) * step
    return [round(first + i * step, 12) for i in range(int((high - first) / step + 1e-9) + 1)]


def _tick_text(value: float) -> str:
    return f"{value:.6g}"


@dataclass(frozen=True)
class Series:
    """One series of a plot: `points` (x, y) joined by a line and/or marked; `tips`: a tooltip per point."""

    name: str
    points: Sequence[tuple[float, float]]
    color: str
    line: bool = True
    marker: str = "circle"  # circle, square, cross, triangle or none
    dashed: bool = False
    tips: Sequence[str] | None = None


def marker(shape: str, x: float, y: float, color: str, tip: str = "", size: float = 4.0) -> str:
    """One point's mark, with its tooltip."""
    if shape == "none":
        return ""
    if shape == "square":
        body = (f"<rect x='{x - size:.1f}' y='{y - size:.1f}' width='{2 * size:.1f}' height='{2 * size:.1f}' "
                f"fill='{color}'/>")
    elif shape == "cross":
        body = (f"<path d='M{x - size:.1f},{y - size:.1f}L{x + size:.1f},{y + size:.1f}M{x - size:.1f},"
                f"{y + size:.1f}L{x + size:.1f},{y - size:.1f}' stroke='{color}' stroke-width='2.5'/>")
    elif shape == "triangle":
        body = (f"<path d='M{x:.1f},{y - size:.1f}L{x + size:.1f},{y + size:.1f}L{x - size:.1f},{y + size:.1f}Z' "
                f"fill='none' stroke='{color}' stroke-width='1.5'/>")
    else:
        body = f"<circle cx='{x:.1f}' cy='{y:.1f}' r='{size:.1f}' fill='{color}'/>"
    return f"<g>{f'<title>{text(tip)}</title>' if tip else ''}{body}</g>"


def _frame(width: int, height: int, title: str, body: str, label: str | None = None) -> str:
    return (f"<svg xmlns='http://www.w3.org/2000/svg' width='{width}' height='{height}' "
            f"viewBox='0 0 {width} {height}' role='img' aria-label='{text(label or title)}' {FONT}>"
            f"<text x='4' y='14' font-size='13' font-weight='bold'>{text(title)}</text>{body}</svg>")


def legend(items: Sequence[tuple[str, str, str]], x: float, y: float) -> str:
    """(name, color, marker shape) entries side by side from (x, y)."""
    parts, at = [], x
    for name, color, shape in items:
        parts.append(marker(shape if shape != "none" else "square", at + 5, y - 4, color, size=4)
                     + f"<text x='{at + 13:.1f}' y='{y:.1f}'>{text(name)}</text>")
        at += 22 + 6.5 * len(name)
    return "".join(parts)


def plot(series: Sequence[Series], *, title: str, x_label: str = "", y_label: str = "", width: int = 460,
         height: int = 260, x_ticks: Sequence[tuple[float, str]] | None = None, zero_line: bool = False) -> str:
    """Points and lines on shared axes, with a legend; an empty plot says it has nothing to draw."""
    points = [(x, y) for s in series for x, y in s.points if finite(x) and finite(y)]
    if not points:
        return _frame(width, 40, title, "<text x='4' y='32' fill='#666'>nothing to draw</text>")
    left, right, top, bottom = 58, 12, 40, 36
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    x0, x1 = min(xs), max(xs)
    y0, y1 = min(ys + ([0.0] if zero_line else [])), max(ys + ([0.0] if zero_line else []))
    if x1 == x0:
        x0, x1 = x0 - 1, x1 + 1
    pad = (y1 - y0) * 0.08 or abs(y0) * 0.05 or 1.0
    y0, y1 = y0 - pad, y1 + pad
    inner_w, inner_h = width - left - right, height - top - bottom

    def px(x: float) -> float:
        return left + (x - x0) / (x1 - x0) * inner_w

    def py(y: float) -> float:
        return top + (y1 - y) / (y1 - y0) * inner_h

    parts = [f"<rect x='{left}' y='{top}' width='{inner_w}' height='{inner_h}' fill='none' stroke='#ccc'/>"]
    for value in ticks(y0, y1):
        parts.append(f"<line x1='{left}' x2='{left + inner_w}' y1='{py(value):.1f}' y2='{py(value):.1f}' "
                     f"stroke='#eee'/><text x='{left - 4}' y='{py(value) + 4:.1f}' text-anchor='end'>"
                     f"{_tick_text(value)}</text>")
    for value, name in (x_ticks if x_ticks is not None else [(v, _tick_text(v)) for v in ticks(x0, x1)]):
        parts.append(f"<text x='{px(value):.1f}' y='{top + inner_h + 14}' text-anchor='middle'>{text(name)}</text>")
    if zero_line:
        parts.append(f"<line x1='{left}' x2='{left + inner_w}' y1='{py(0):.1f}' y2='{py(0):.1f}' stroke='#555'/>")
    for s in series:
        shown = [(x, y, i) for i, (x, y) in enumerate(s.points) if finite(x) and finite(y)]
        if s.line and len(shown) > 1:
            path = "".join(f"{'M' if n == 0 else 'L'}{px(x):.1f},{py(y):.1f}" for n, (x, y, _) in enumerate(shown))
            dash = " stroke-dasharray='5,3'" if s.dashed else ""
            parts.append(f"<path d='{path}' fill='none' stroke='{s.color}' stroke-width='1.8'{dash}/>")
        size = 3.5 if len(shown) <= 40 else 2.2  # a long curve's points would hide its line
        for x, y, i in shown:
            tip = s.tips[i] if s.tips is not None else f"{s.name}: {_tick_text(x)}, {_tick_text(y)}"
            parts.append(marker(s.marker, px(x), py(y), s.color, tip, size=size))
    parts.append(f"<text x='{left + inner_w / 2:.1f}' y='{height - 4}' text-anchor='middle'>{text(x_label)}</text>")
    parts.append(f"<text x='12' y='{top + inner_h / 2:.1f}' text-anchor='middle' "
                 f"transform='rotate(-90 12 {top + inner_h / 2:.1f})'>{text(y_label)}</text>")
    parts.append(legend([(s.name, s.color, s.marker if s.marker != "none" else "square") for s in series],
                        left, 30))
    return _frame(width, height, title, "".join(parts))


def hbars(rows: Sequence[tuple[str, Sequence[float | None]]], names: Sequence[str], colors: Sequence[str], *,
          title: str, diverging: bool = False, digits: int = 3, width: int = 460) -> str:
    """Horizontal bars, one group per row (a label and a value per series). `diverging`: around zero, a gain
    green and a loss red whatever the series; else from zero to the right, in the series' colours."""
    if not rows:
        return _frame(width, 40, title, "<text x='4' y='32' fill='#666'>nothing to draw</text>")
    label_w, value_w, bar_h, gap, top = 150, 58, 11, 6, 40
    group_h = bar_h * len(names) + gap
    height = top + group_h * len(rows) + 8
    values = [abs(v) for _, vs in rows for v in vs if finite(v)]
    scale = max(values, default=0.0) or 1.0
    span = width - label_w - value_w
    zero = label_w + (span / 2 if diverging else 0)
    reach = span / 2 if diverging else span
    parts = [f"<line x1='{zero:.1f}' x2='{zero:.1f}' y1='{top - 4}' y2='{height - 6}' stroke='#888'/>"]
    for r, (label, vs) in enumerate(rows):
        y = top + r * group_h
        parts.append(f"<g><title>{text(label)}</title><text x='{label_w - 6}' y='{y + bar_h * len(names) / 2 + 4:.1f}' "
                     f"text-anchor='end'>{text(short(label))}</text></g>")
        for k, value in enumerate(vs):
            top_k = y + k * bar_h
            if not finite(value):
                parts.append(f"<text x='{zero + 3:.1f}' y='{top_k + 9:.1f}' fill='#666'>—</text>")
                continue
            assert value is not None
            length = abs(value) / scale * reach
            x = zero - length if value < 0 else zero
            color = (GOOD if value > 0 else BAD if value < 0 else NEUTRAL) if diverging else colors[k]
            shown = f"{value:+.{digits}f}" if diverging else f"{value:.{digits}f}"
            parts.append(f"<g><title>{text(label)} {text(names[k])}: {shown}</title><rect x='{x:.1f}' "
                         f"y='{top_k:.1f}' width='{max(length, 0.5):.1f}' height='{bar_h - 1}' fill='{color}'/></g>"
                         f"<text x='{width - value_w + 4}' y='{top_k + 9:.1f}'>{shown}</text>")
    body = "".join(parts) + (legend([(n, c, "square") for n, c in zip(names, colors, strict=True)], 4, 30)
                             if len(names) > 1 else "")
    return _frame(width, height, title, body)


def heatmap(matrix: Sequence[Sequence[float]], labels: Sequence[str], *, title: str, difference: bool = False,
            cell: int = 30) -> str:
    """A confusion matrix (rows: true class, columns: predicted) with its counts. `difference`: a matrix of
    changes, coloured by what they mean: more on the diagonal or fewer off it green, the reverse red."""
    n = len(labels)
    left, top = 70, 52
    width, height = max(left + n * cell + 10, 8 + 7 * len(title)), top + n * cell + 10
    peak = max((abs(v) for row in matrix for v in row), default=0) or 1
    parts = [f"<text x='{left + n * cell / 2:.1f}' y='{top - 22}' text-anchor='middle'>predicted</text>",
             f"<text x='12' y='{top + n * cell / 2:.1f}' text-anchor='middle' "
             f"transform='rotate(-90 12 {top + n * cell / 2:.1f})'>true</text>"]
    for i, name in enumerate(labels):
        parts.append(f"<g><title>{text(name)}</title><text x='{left + i * cell + cell / 2:.1f}' y='{top - 6}' "
                     f"text-anchor='middle'>{text(short(name, 5))}</text></g>"
                     f"<g><title>{text(name)}</title><text x='{left - 4}' y='{top + i * cell + cell / 2 + 4:.1f}' "
                     f"text-anchor='end'>{text(short(name, 8))}</text></g>")
    for i, row in enumerate(matrix):
        for j, value in enumerate(row):
            share = abs(value) / peak
            if difference:
                good = (value > 0) == (i == j)
                fill = "#fff" if value == 0 else (f"rgba(46,125,50,{0.15 + 0.75 * share:.2f})" if good
                                                  else f"rgba(198,40,40,{0.15 + 0.75 * share:.2f})")
                shown = f"{value:+g}" if value else "0"
            else:
                fill = f"rgba(21,101,192,{0.04 + 0.9 * share:.2f})"
                shown = f"{value:g}"
            ink = "#fff" if share > 0.6 else "#000"
            x, y = left + j * cell, top + i * cell
            parts.append(f"<g><title>true {text(labels[i])}, predicted {text(labels[j])}: {shown}</title>"
                         f"<rect x='{x}' y='{y}' width='{cell}' height='{cell}' fill='{fill}' stroke='#ddd'/>"
                         f"<text x='{x + cell / 2:.1f}' y='{y + cell / 2 + 4:.1f}' text-anchor='middle' "
                         f"fill='{ink}'>{shown}</text></g>")
    return _frame(width, height, title, "".join(parts))
