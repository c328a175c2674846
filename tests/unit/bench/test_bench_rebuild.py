"""The rebuild figure's rounds: each against the faster calibration around it, the median kept."""

from __future__ import annotations

from bench.figures.rebuild import _Round
from bench.stats import median_item


def _round(records: int, seconds: float, before: float, after: float) -> _Round:
    return _Round(records, 1, records, seconds, (before, after), {})


def test_a_round_is_read_against_the_faster_calibration_around_it() -> None:
    r = _round(40_000, 1.0, 50_000.0, 80_000.0)
    assert r.events_per_s == 40_000
    assert r.reference == 80_000
    assert r.ratio == 0.5


def test_the_figure_is_the_round_of_the_median_ratio_not_of_the_median_rate() -> None:
    slow_machine = _round(30_000, 1.0, 40_000.0, 45_000.0)  # 0.667
    fast_machine = _round(45_000, 1.0, 70_000.0, 60_000.0)  # 0.643
    slowed_rebuild = _round(40_000, 1.0, 80_000.0, 75_000.0)  # 0.5, the median rate
    rounds = [slow_machine, fast_machine, slowed_rebuild]
    chosen = median_item(rounds, lambda r: r.ratio)
    assert chosen is fast_machine
    assert median_item(rounds, lambda r: r.events_per_s) is slowed_rebuild
