"""The Prometheus metrics of the processes the harness starts (`Proc.metrics()` scrapes them):
values from the text exposition, and quantiles estimated from a histogram's buckets."""

from __future__ import annotations

import math
from collections.abc import Sequence


def parse_histogram(text: str, name: str) -> list[tuple[float, float]]:
    """The `(le, cumulative count)` buckets of histogram `name` in a Prometheus text exposition."""
    prefix = f"{name}_bucket{{"
    out: list[tuple[float, float]] = []
    for raw in text.splitlines():
        if not raw.startswith(prefix):
            continue
        labels, _, value = raw[len(prefix) :].partition("} ")
        for label in labels.split(","):
            key, _, quoted = label.partition("=")
            if key.strip() == "le":
                le = quoted.strip().strip('"')
                out.append((math.inf if le == "+Inf" else float(le), float(value)))
    return out


def histogram_between(before: str, after: str, name: str) -> list[tuple[float, float]]:
    """The cumulative buckets of histogram `name` counted between two expositions of a process."""
    earlier = dict(parse_histogram(before, name))
    return [(le, count - earlier.get(le, 0.0)) for le, count in parse_histogram(after, name)]


def parse_counter(text: str, name: str) -> float | None:
    """The value of an unlabelled counter or gauge (`name` or `name_total`) in an exposition."""
    for raw in text.splitlines():
        metric, _, value = raw.partition(" ")
        if metric in (name, f"{name}_total"):
            return float(value)
    return None


def histogram_quantile(q: float, buckets: Sequence[tuple[float, float]]) -> float | None:
    """Estimate a quantile (0..1) from cumulative Prometheus buckets `(le, count)`.

    Linear interpolation inside the bucket, as PromQL's `histogram_quantile` does (the lowest
    bucket interpolates from 0; a quantile in the `+Inf` bucket returns the highest finite bound).
    """
    if not 0 <= q <= 1:
        raise ValueError(f"quantile must be within 0..1, not {q}")
    ordered = sorted(buckets)
    if not ordered:
        return None
    total = ordered[-1][1]
    if total <= 0:
        return None
    rank = q * total
    previous_bound, previous_count = 0.0, 0.0
    for bound, count in ordered:
        if count >= rank:
            if math.isinf(bound):
                return previous_bound
            in_bucket = count - previous_count
            if in_bucket <= 0:
                return bound
            return previous_bound + (bound - previous_bound) * (rank - previous_count) / in_bucket
        previous_bound, previous_count = bound, count
    return previous_bound


def histogram_bucket(
    q: float, buckets: Sequence[tuple[float, float]]
) -> tuple[float, float] | None:
    """The `(lower, upper)` bounds of the bucket a quantile (0..1) falls in (None if empty)."""
    ordered = sorted(buckets)
    if not ordered or ordered[-1][1] <= 0:
        return None
    rank = q * ordered[-1][1]
    lower = 0.0
    for bound, count in ordered:
        if count >= rank:
            return lower, bound
        lower = bound
    return lower, math.inf
