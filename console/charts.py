"""The overview's charts as SVG geometry (bars stacked per reason), drawn by the templates.

The templates draw rectangles and text with presentation attributes only (no inline styles or
scripts), so the pages keep a strict Content-Security-Policy.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from projections.analytics import floor_hour, tta_bound, tta_labels

WIDTH, HEIGHT = 720, 220
LEFT, RIGHT, TOP, BOTTOM = 36, 8, 12, 28
COLOURS = 8  # reason colour classes `c0` … `c7` (console.css)


@dataclass(frozen=True, slots=True)
class Bar:
    """One rectangle of a stacked bar."""

    x: float
    y: float
    width: float
    height: float
    css: str
    title: str


@dataclass(frozen=True, slots=True)
class Label:
    """One piece of axis text."""

    x: float
    y: float
    text: str
    anchor: str = "middle"


@dataclass(frozen=True, slots=True)
class Chart:
    """An SVG bar chart: view box, bars, axis labels, legend (css class, reason)."""

    width: int
    height: int
    bars: tuple[Bar, ...]
    labels: tuple[Label, ...]
    legend: tuple[tuple[str, str], ...]
    total: int

    @property
    def empty(self) -> bool:
        """Whether there is nothing to draw."""
        return self.total == 0

    @property
    def baseline(self) -> float:
        """The y of the x axis."""
        return float(HEIGHT - BOTTOM)


def reason_classes(reasons: Sequence[str]) -> dict[str, str]:
    """A colour class per reason, stable for a sorted set of reasons."""
    return {r: f"c{i % COLOURS}" for i, r in enumerate(sorted(set(reasons)))}


def stacked(
    columns: Sequence[str],
    column_labels: Sequence[str],
    cells: Mapping[tuple[str, str], int],
    unit: str,
    *,
    label_every: int = 1,
    palette: Mapping[str, str] | None = None,
) -> Chart:
    """Bars per column, stacked per reason; `cells` maps (column, reason) to a count.

    `palette` gives each reason its colour class (share one between charts so a reason has one
    colour on the page); by default the reasons of this chart, sorted.
    """
    reasons = sorted({reason for (_, reason), n in cells.items() if n > 0})
    css = {**reason_classes(reasons), **(palette or {})}
    totals = [sum(cells.get((c, r), 0) for r in reasons) for c in columns]
    top = max(totals, default=0)
    plot_w, plot_h = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM
    slot = plot_w / max(len(columns), 1)
    bars: list[Bar] = []
    labels: list[Label] = []
    for i, (column, text) in enumerate(zip(columns, column_labels, strict=True)):
        x = LEFT + i * slot + slot * 0.1
        y = float(HEIGHT - BOTTOM)
        for reason in reasons:
            n = cells.get((column, reason), 0)
            if n <= 0:
                continue
            h = plot_h * n / top
            y -= h
            title = f"{text}: {n} {unit}{'' if n == 1 else 's'} ({reason})"
            bars.append(
                Bar(round(x, 1), round(y, 1), round(slot * 0.8, 1), round(h, 1), css[reason], title)
            )
        if i % label_every == 0:
            labels.append(Label(round(x + slot * 0.4, 1), HEIGHT - BOTTOM + 16, text))
    if top:
        labels.append(Label(LEFT - 6, TOP + 8, str(top), "end"))
        labels.append(Label(LEFT - 6, HEIGHT - BOTTOM, "0", "end"))
    legend = tuple((css[r], r) for r in reasons)
    return Chart(WIDTH, HEIGHT, tuple(bars), tuple(labels), legend, sum(totals))


def pauses_chart(
    rows: Sequence[Mapping[str, Any]],
    now: datetime,
    hours: int = 24,
    palette: Mapping[str, str] | None = None,
) -> Chart:
    """Pauses per reason in each of the last `hours` UTC hours (rows: `{hour, reason, count}`)."""
    last = floor_hour(now)
    starts = [last - timedelta(hours=hours - 1 - i) for i in range(hours)]
    columns = [s.isoformat() for s in starts]
    cells: dict[tuple[str, str], int] = {}
    for row in rows:
        key = (str(row["hour"]), str(row["reason"]))
        cells[key] = cells.get(key, 0) + int(row["count"])
    labels = [s.strftime("%H") for s in starts]
    return stacked(columns, labels, cells, "pause", label_every=3, palette=palette)


def _tta_label(bucket: str) -> str:
    bound = tta_bound(bucket)
    if bound is None:
        return "more"
    for size, suffix in ((86400, "d"), (3600, "h"), (60, "m")):
        if bound >= size and bound % size == 0:
            return f"≤{bound // size}{suffix}"
    return f"≤{bound}s"


def tta_chart(rows: Sequence[Mapping[str, Any]], palette: Mapping[str, str] | None = None) -> Chart:
    """The time-to-answer histogram, stacked per reason (rows: `{reason, bucket, count}`)."""
    columns = list(tta_labels())
    for row in rows:
        if row["bucket"] not in columns:
            columns.append(str(row["bucket"]))
    cells: dict[tuple[str, str], int] = {}
    for row in rows:
        key = (str(row["bucket"]), str(row["reason"]))
        cells[key] = cells.get(key, 0) + int(row["count"])
    return stacked(columns, [_tta_label(c) for c in columns], cells, "answer", palette=palette)
