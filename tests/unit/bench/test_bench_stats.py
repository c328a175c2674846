"""The benchmark harness's pure helpers: percentiles, ratios, targets, JSON lines, histograms.

No timing is asserted anywhere: these only check the arithmetic and the output format.
"""

from __future__ import annotations

import json
import math

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.registry import Collector

from bench.stats import (
    Figure,
    Target,
    extrapolate,
    median_item,
    median_low,
    percentile,
    rate,
    ratio,
    summary,
    table,
)
from deploy.metrics import histogram_bucket, histogram_quantile, parse_counter, parse_histogram
from processors.histogram import LATENESS_MS_BUCKETS, Histogram
from processors.metrics import histogram_family

KEYS = ["figure", "value", "unit", "baseline", "ratio", "target", "met", "params"]


# -- percentiles -----------------------------------------------------------------------------------


def test_percentile_interpolates_linearly_between_closest_ranks() -> None:
    samples = [1, 2, 3, 4]
    assert percentile(samples, 0) == 1
    assert percentile(samples, 100) == 4
    assert percentile(samples, 50) == 2.5
    assert percentile(samples, 25) == pytest.approx(1.75)
    assert percentile(range(1, 101), 99) == pytest.approx(99.01)


def test_percentile_ignores_input_order_and_handles_one_or_no_sample() -> None:
    assert percentile([9, 1, 5], 50) == 5
    assert percentile([7.5], 99) == 7.5
    assert percentile([], 50) is None


@pytest.mark.parametrize("q", [-1, 100.5])
def test_percentile_refuses_a_rank_outside_0_100(q: float) -> None:
    with pytest.raises(ValueError, match=r"within 0\.\.100"):
        percentile([1, 2], q)


def test_summary_gives_count_percentiles_max_and_mean() -> None:
    s = summary([10.0, 20.0, 30.0, 40.0, 50.0])
    assert s == {"count": 5, "p50": 30.0, "p90": 46.0, "p99": 49.6, "max": 50.0, "mean": 30.0}
    assert summary([]) == {
        "count": 0,
        "p50": None,
        "p90": None,
        "p99": None,
        "max": None,
        "mean": None,
    }


# -- ratios and rates ----------------------------------------------------------------------------


def test_ratio_is_value_over_baseline_or_none() -> None:
    assert ratio(30_000, 1_500) == 20
    assert ratio(None, 10) is None
    assert ratio(10, None) is None
    assert ratio(10, 0) is None


def test_rate_is_count_per_second_or_none_for_no_time() -> None:
    assert rate(200_000, 8) == 25_000
    assert rate(10, 0) is None
    assert rate(10, -1) is None


def test_extrapolate_scales_linearly() -> None:
    assert extrapolate(250_000_000, 100_000, 1_000_000) == 2_500_000_000
    with pytest.raises(ValueError, match="nothing was measured"):
        extrapolate(1, 0, 10)


# -- targets ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "op", "bound"),
    [(">= 15000", ">=", 15000), ("<=40", "<=", 40), (" > 1.7 ", ">", 1.7), ("<0.5", "<", 0.5)],
)
def test_target_parse(text: str, op: str, bound: float) -> None:
    assert Target.parse(text) == Target(op, bound)


def test_target_met_compares_and_is_unknown_without_a_value() -> None:
    at_least = Target(">=", 15_000)
    assert at_least.met(15_000) is True
    assert at_least.met(14_999.9) is False
    assert at_least.met(None) is None
    at_most = Target("<=", 40)
    assert at_most.met(40) is True
    assert at_most.met(40.1) is False


def test_target_refuses_unknown_comparisons() -> None:
    with pytest.raises(ValueError, match="unknown comparison"):
        Target("==", 1)
    with pytest.raises(ValueError, match="a target starts with"):
        Target.parse("about 3")


def test_target_prints_readably() -> None:
    assert str(Target(">=", 15_000)) == ">= 15,000"
    assert str(Target("<=", 0.5)) == "<= 0.5"
    assert str(Target(">=", 1.7)) == ">= 1.70"


# -- figures and their JSON lines ----------------------------------------------------------------


def test_a_json_line_has_every_field_in_order_with_ratio_and_met_derived() -> None:
    f = Figure(
        "projector_events_per_s_per_worker_1w",
        18_000.123456,
        "events/s",
        baseline=1_500.0,
        target=Target(">=", 15_000),
        params={"workers": 1, "seconds": 11.11111, "nested": {"p99": 3.14159}, "list": [0.12345]},
    )
    line = f.json_line()
    assert "\n" not in line
    record = json.loads(line)
    assert list(record) == KEYS
    assert record["value"] == 18_000.123
    assert record["baseline"] == 1_500.0
    assert record["ratio"] == 12.0
    assert record["target"] == ">= 15,000"
    assert record["met"] is True
    assert record["params"] == {
        "workers": 1,
        "seconds": 11.111,
        "nested": {"p99": 3.142},
        "list": [0.123],
    }


def test_without_baseline_or_target_those_fields_are_null() -> None:
    record = json.loads(Figure("redis_ceiling_events_per_s", 30_000.0, "events/s").json_line())
    assert record["baseline"] is None
    assert record["ratio"] is None
    assert record["target"] is None
    assert record["met"] is None
    assert record["params"] == {}


def test_a_figure_that_was_not_measured_is_null_and_says_why() -> None:
    f = Figure("e2e_failed", None, "", target=Target("<=", 40), error="TimeoutError: no worker")
    record = json.loads(f.json_line())
    assert record["value"] is None
    assert record["met"] is None
    assert record["error"] == "TimeoutError: no worker"


def test_nan_and_infinity_become_null_so_the_line_stays_valid_json() -> None:
    f = Figure("x", math.nan, "ms", baseline=math.inf, params={"y": math.nan})
    line = f.json_line()
    assert "NaN" not in line and "Infinity" not in line
    record = json.loads(line)
    assert record["value"] is None
    assert record["baseline"] is None
    assert record["params"] == {"y": None}


def test_ratio_of_a_figure_with_a_zero_baseline_is_null() -> None:
    assert Figure("x", 5.0, "events/s", baseline=0.0).ratio is None


def test_the_table_has_a_row_per_figure_with_ratio_target_and_verdict() -> None:
    figures = [
        Figure("producer_events_per_s", 17_078.2, "events/s", 1_194.1, Target(">=", 12_000)),
        Figure("e2e_latency_p99_ms", 153.6, "ms", target=Target("<=", 40)),
        Figure("redis_ceiling_events_per_s", 30_022.0, "events/s"),
        Figure("memory_failed", None, "", error="boom"),
    ]
    lines = table(figures).splitlines()
    assert lines[0].split() == ["figure", "value", "unit", "baseline", "ratio", "target", "met"]
    assert len(lines) == 2 + len(figures)
    assert lines[2].split() == [
        "producer_events_per_s",
        "17,078",
        "events/s",
        "1,194",
        "14.30×",
        ">=",
        "12,000",
        "yes",
    ]
    assert lines[3].split()[-1] == "NO"
    assert lines[4].split()[-1] == "—"
    assert lines[5].split()[-1] == "ERROR"


# -- Prometheus histograms -------------------------------------------------------------------------


def test_histogram_quantile_interpolates_inside_the_bucket() -> None:
    buckets = [(1.0, 0.0), (2.0, 50.0), (5.0, 90.0), (10.0, 100.0), (math.inf, 100.0)]
    assert histogram_quantile(0.5, buckets) == 2.0
    assert histogram_quantile(0.25, buckets) == pytest.approx(1.5)
    assert histogram_quantile(0.7, buckets) == pytest.approx(3.5)
    assert histogram_quantile(0.99, buckets) == pytest.approx(9.5)


def test_histogram_quantile_in_the_first_bucket_starts_from_zero() -> None:
    assert histogram_quantile(0.5, [(10.0, 10.0), (math.inf, 10.0)]) == 5.0


def test_histogram_quantile_past_the_last_finite_bound_returns_that_bound() -> None:
    buckets = [(10.0, 1.0), (100.0, 2.0), (math.inf, 10.0)]
    assert histogram_quantile(0.99, buckets) == 100.0


def test_histogram_bucket_is_the_bucket_holding_the_quantile() -> None:
    buckets = [(1.0, 0.0), (2.0, 50.0), (5.0, 90.0), (10.0, 100.0), (math.inf, 100.0)]
    assert histogram_bucket(0.5, buckets) == (1.0, 2.0)
    assert histogram_bucket(0.9, buckets) == (2.0, 5.0)
    assert histogram_bucket(0.99, buckets) == (5.0, 10.0)
    assert histogram_bucket(0.99, [(10.0, 1.0), (math.inf, 10.0)]) == (10.0, math.inf)
    assert histogram_bucket(0.5, []) is None


def test_histogram_quantile_without_observations_is_none() -> None:
    assert histogram_quantile(0.5, []) is None
    assert histogram_quantile(0.5, [(1.0, 0.0), (math.inf, 0.0)]) is None
    with pytest.raises(ValueError, match=r"within 0\.\.1"):
        histogram_quantile(1.5, [(1.0, 1.0)])


class _Lateness(Collector):
    def __init__(self, samples: list[float]) -> None:
        self.histogram = Histogram(LATENESS_MS_BUCKETS)
        self.histogram.observe_many(samples)

    def collect(self):  # type: ignore[no-untyped-def]
        yield histogram_family("milpa_expiry_lateness_ms", "lateness", self.histogram)


def test_the_workers_own_exposition_parses_into_buckets_and_counters() -> None:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Lateness([0.5, 3.0, 3.0, 8.0, 12.0, 12000.0]))
    text = generate_latest(registry).decode()
    buckets = parse_histogram(text, "milpa_expiry_lateness_ms")
    assert len(buckets) == len(LATENESS_MS_BUCKETS) + 1
    as_dict = dict(buckets)
    assert as_dict[1.0] == 1
    assert as_dict[5.0] == 3
    assert as_dict[10.0] == 4
    assert as_dict[15.0] == 5
    assert as_dict[math.inf] == 6
    assert parse_counter(text, "milpa_expiry_lateness_ms_count") == 6
    assert parse_counter(text, "milpa_expiry_lateness_ms_sum") == pytest.approx(12026.5)
    # rank 3 of 6 is the last sample of the (2, 3] bucket: its upper bound (the samples' 3.0).
    assert histogram_quantile(0.5, buckets) == 3.0


def test_parse_counter_reads_the_total_suffix_and_misses_as_none() -> None:
    text = "# HELP milpa_records x\n# TYPE milpa_records counter\nmilpa_records_total 47500.0\n"
    assert parse_counter(text, "milpa_records") == 47500
    assert parse_counter(text, "milpa_batches") is None


def test_a_ratio_target_is_met_by_the_ratio_to_the_baseline() -> None:
    target = Target(">=", 10, of_ratio=True)
    assert str(target).startswith("ratio >= 10")
    assert Figure("f", 20_000, "events/s", baseline=1_000, target=target).met is True
    assert Figure("f", 20_000, "events/s", baseline=4_000, target=target).met is False
    assert Figure("f", 20_000, "events/s", target=target).met is None  # no baseline, no ratio


def test_the_median_of_rounds_is_the_lower_middle_and_skips_rounds_that_measured_nothing() -> None:
    assert median_low([9.0, 3.0, 20.0]) == 9.0
    assert median_low([4.0, None, 8.0]) == 4.0
    assert median_low([None]) is None


def test_the_median_item_is_the_first_at_the_median_and_the_first_if_none_measured() -> None:
    rounds = [("a", 9.0), ("b", None), ("c", 3.0), ("d", 20.0), ("e", 9.0)]
    assert median_item(rounds, lambda r: r[1]) == ("a", 9.0)
    assert median_item([("x", None), ("y", None)], lambda r: r[1]) == ("x", None)
