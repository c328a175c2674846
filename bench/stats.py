"""Pure helpers of the harness: percentiles, ratios, targets, the JSON lines and the table.

No I/O and no clocks here, so they are unit-tested (tests/unit/test_bench_stats.py).
"""

from __future__ import annotations

import json
import math
import operator
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

T = TypeVar("T")

_OPS: dict[str, Callable[[float, float], bool]] = {
    ">=": operator.ge,
    "<=": operator.le,
    ">": operator.gt,
    "<": operator.lt,
}


def percentile(samples: Iterable[float], q: float) -> float | None:
    """The q-th percentile (0..100) with linear interpolation between closest ranks.

    The same definition as numpy's default (`linear`); None for no samples.
    """
    if not 0 <= q <= 100:
        raise ValueError(f"percentile must be within 0..100, not {q}")
    ordered = sorted(samples)
    if not ordered:
        return None
    rank = (len(ordered) - 1) * q / 100
    low = math.floor(rank)
    high = math.ceil(rank)
    if low == high:
        return float(ordered[low])
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def summary(samples: Sequence[float]) -> dict[str, float | int | None]:
    """count, p50, p90, p99, max and mean of samples (None where there are none)."""
    return {
        "count": len(samples),
        "p50": percentile(samples, 50),
        "p90": percentile(samples, 90),
        "p99": percentile(samples, 99),
        "max": max(samples) if samples else None,
        "mean": sum(samples) / len(samples) if samples else None,
    }


def by_slice(samples: Iterable[tuple[int, float]], upper: str) -> list[list[Any]]:
    """`[slice, count, p50, <upper>, max]` of the samples of each slice, by slice."""
    slices: dict[int, list[float]] = {}
    for key, value in samples:
        slices.setdefault(key, []).append(value)
    return [
        [k, len(v), summary(v)["p50"], summary(v)[upper], max(v)] for k, v in sorted(slices.items())
    ]


def ratio(value: float | None, baseline: float | None) -> float | None:
    """value / baseline, or None when either is missing or the baseline is zero."""
    if value is None or baseline is None or baseline == 0:
        return None
    return value / baseline


def median_low(values: Iterable[float | None]) -> float | None:
    """The median of the values measured (the lower of the middle two: always one of them),
    None if none was; how a figure measured in rounds picks its round."""
    done = sorted(v for v in values if v is not None)
    return done[(len(done) - 1) // 2] if done else None


def median_item(items: Sequence[T], key: Callable[[T], float | None]) -> T:
    """The item whose `key` is `median_low` of the items' keys (the first such item); the first
    item if none was measured."""
    chosen = median_low(key(i) for i in items)
    if chosen is None:
        return items[0]
    return next(i for i in items if key(i) == chosen)


def rate(count: float, seconds: float) -> float | None:
    """count per second, or None for a non-positive duration."""
    if seconds <= 0:
        return None
    return count / seconds


def cpu_per_event(
    usage: Mapping[str, Any],
    events_per_s: float | None,
    at_rest: Mapping[str, float] | None = None,
) -> dict[str, float]:
    """µs of CPU per event of each process (or group) a CPU report names (`<name>_cpu_pct`, % of
    a core) while `events_per_s` were processed; the machine's too, not what was unaccounted.

    With `at_rest` (the same report's keys, taken while nothing was processed), only the
    processes it names, and only what they used beyond it: what one more event costs them.
    """
    if not events_per_s or events_per_s <= 0:
        return {}
    out: dict[str, float] = {}
    for key, used in usage.items():
        name = key.removesuffix("_cpu_pct")
        if name in (key, "unaccounted") or isinstance(used, bool):
            continue
        if at_rest is not None and key not in at_rest:
            continue
        if isinstance(used, int | float):
            beyond = used - (at_rest[key] if at_rest is not None else 0.0)
            out[name] = beyond / 100 * 1e6 / events_per_s
    return out


@dataclass(frozen=True)
class Target:
    """A target such as `>= 15000` (events/s) or `<= 40` (ms); with `of_ratio`, a bound on the
    figure's ratio to its baseline measured in the same run (`ratio >= 10`), which travels
    between machines of different speed."""

    op: str
    bound: float
    of_ratio: bool = False

    def __post_init__(self) -> None:
        if self.op not in _OPS:
            raise ValueError(f"unknown comparison {self.op!r}")

    @classmethod
    def parse(cls, text: str) -> Target:
        """Read `">= 15000"`, `"<=40"`, ..."""
        stripped = text.strip()
        for op in sorted(_OPS, key=len, reverse=True):
            if stripped.startswith(op):
                return cls(op, float(stripped[len(op) :].strip()))
        raise ValueError(f"a target starts with one of {sorted(_OPS)}: {text!r}")

    def met(self, value: float | None) -> bool | None:
        """Whether value meets it (None when nothing was measured)."""
        if value is None:
            return None
        return _OPS[self.op](value, self.bound)

    def __str__(self) -> str:
        return ("ratio " if self.of_ratio else "") + f"{self.op} {_number(self.bound)}"


@dataclass
class Figure:
    """One measured figure, printed as one JSON line."""

    figure: str
    value: float | None
    unit: str
    baseline: float | None = None
    target: Target | None = None
    params: dict[str, Any] = field(default_factory=dict)
    error: str | None = None

    @property
    def ratio(self) -> float | None:
        """value / baseline."""
        return ratio(self.value, self.baseline)

    @property
    def met(self) -> bool | None:
        """Whether the target is met (by the value, or by the ratio for a ratio target); None
        without a target or without a value."""
        if self.target is None:
            return None
        return self.target.met(self.ratio if self.target.of_ratio else self.value)

    def record(self) -> dict[str, Any]:
        """The JSON object: figure, value, unit, baseline, ratio, target, met, params."""
        out: dict[str, Any] = {
            "figure": self.figure,
            "value": _round(self.value),
            "unit": self.unit,
            "baseline": _round(self.baseline),
            "ratio": _round(self.ratio),
            "target": None if self.target is None else str(self.target),
            "met": self.met,
            "params": _rounded(self.params),
        }
        if self.error is not None:
            out["error"] = self.error
        return out

    def json_line(self) -> str:
        """The record as one line of JSON."""
        return json.dumps(self.record(), ensure_ascii=False, sort_keys=False, default=str)


def _round(value: float | None, digits: int = 3) -> float | None:
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, int):
        return value
    if math.isnan(value) or math.isinf(value):
        return None
    return round(value, digits)


def _rounded(value: Any) -> Any:
    if isinstance(value, float):
        return _round(value)
    if isinstance(value, Mapping):
        return {str(k): _rounded(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_rounded(v) for v in value]
    return value


def _number(value: float | None) -> str:
    if value is None:
        return "—"
    if value == 0:
        return "0"
    magnitude = abs(value)
    if magnitude >= 1000:
        return f"{value:,.0f}"
    if magnitude >= 100:
        return f"{value:.0f}"
    if magnitude >= 10:
        return f"{value:.1f}"
    if magnitude >= 1:
        return f"{value:.2f}"
    return f"{value:.3g}"


def table(figures: Sequence[Figure]) -> str:
    """A plain-text table of the figures (for people; the JSON lines are for machines)."""
    header = ("figure", "value", "unit", "baseline", "ratio", "target", "met")
    rows = [header]
    for f in figures:
        met = {True: "yes", False: "NO", None: "—"}[f.met]
        if f.error is not None:
            met = "ERROR"
        rows.append(
            (
                f.figure,
                _number(f.value),
                f.unit,
                _number(f.baseline),
                "—" if f.ratio is None else f"{f.ratio:.2f}×",
                "—" if f.target is None else str(f.target),
                met,
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    numeric = {1, 3, 4}

    def line(row: Sequence[str]) -> str:
        cells = [
            cell.rjust(widths[i]) if i in numeric else cell.ljust(widths[i])
            for i, cell in enumerate(row)
        ]
        return "  ".join(cells).rstrip()

    rule = "  ".join("-" * w for w in widths)
    return "\n".join([line(rows[0]), rule, *(line(r) for r in rows[1:])])


def extrapolate(measured: float, measured_count: int, to_count: int) -> float:
    """Scale a total measured over `measured_count` items linearly to `to_count` items."""
    if measured_count <= 0:
        raise ValueError("nothing was measured")
    return measured / measured_count * to_count
