"""The load of the expiry figures under load is a share of the same run's worker capacity."""

from __future__ import annotations

from bench.figures.expiry import LOAD_SHARE_OF_CAPACITY, _median_round, load_rate


def test_a_slower_machine_gets_the_share_of_its_own_capacity_the_asked_rate_was() -> None:
    per_s, why = load_rate(12_000, 10_000.0)
    assert per_s == int(10_000 * LOAD_SHARE_OF_CAPACITY) == 8_153
    assert "10,000" in why


def test_a_faster_machine_never_gets_more_than_asked() -> None:
    assert load_rate(12_000, 30_000.0)[0] == 12_000


def test_without_a_capacity_figure_in_the_run_the_configured_rate_stands() -> None:
    per_s, why = load_rate(12_000, None)
    assert per_s == 12_000
    assert "no projector_events_per_s_per_worker_1w" in why
    assert load_rate(12_000, 0.0)[0] == 12_000


def test_the_share_is_what_12k_was_of_the_machine_it_was_asked_on() -> None:
    assert load_rate(12_000, 14_718.0)[0] == 12_000


def test_the_median_round_is_a_round_that_measured_it_with_every_round_in_its_params() -> None:
    rounds = [{"p99": p, "params": {"n": i}} for i, p in enumerate((11.6, 3.9, 19.8))]
    chosen = _median_round(rounds, "p99")
    assert chosen["p99"] == 11.6
    assert chosen["params"] == {"n": 0, "rounds_p99_ms": [11.6, 3.9, 19.8]}
