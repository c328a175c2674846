"""The two-worker CPU bound is computed from the 1-worker run's measured CPU per event."""

from __future__ import annotations

import os

import pytest

from bench.figures.projector import _two_worker_bound, fold_bound


def test_the_bound_is_two_worker_shares_of_the_cpu_one_event_costs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    one = {
        "cpu_us_per_event": {"worker0": 90.0, "harness": 4.0, "kafka": 20.0, "redis": 15.0},
        "cpu_us_per_event_above_rest": {"kafka": 2.0, "redis": 14.0},
    }
    out = _two_worker_bound(one, 1.5)
    assert out["cpu_bound"] == pytest.approx(2 * 90 / (90 + 2 + 14 + 4), abs=1e-3)
    assert out["share_of_cpu_bound"] == pytest.approx(1.5 / out["cpu_bound"], abs=1e-3)


def test_on_one_core_two_workers_can_at_most_match_one(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "cpu_count", lambda: 1)
    one = {
        "cpu_us_per_event": {"worker0": 50.0, "harness": 0.0},
        "cpu_us_per_event_above_rest": {"kafka": 0.0, "redis": 0.0},
    }
    assert _two_worker_bound(one, 0.9)["cpu_bound"] == pytest.approx(1.0)


def test_without_the_cpu_figures_there_is_no_bound() -> None:
    assert _two_worker_bound({}, 1.4) == {}
    assert _two_worker_bound({"cpu_us_per_event": {"worker0": 80.0}}, 1.4) == {}


def test_a_worker_that_also_folds_reaches_at_most_fold_over_fold_plus_ceiling() -> None:
    # 1/C per event fetching and decoding, 1/F folding: a rate of C F / (F + C), F / (F + C) of C.
    assert fold_bound(62_582.0, 102_303.0) == pytest.approx(0.380, abs=1e-3)
    assert fold_bound(100_000.0, 100_000.0) == 0.5
    assert fold_bound(None, 100_000.0) is None
