"""Analytics without a network: hour windows, durations, outcome arithmetic, buckets, metrics."""

from __future__ import annotations

import fnmatch
import threading
from collections import Counter
from datetime import UTC, datetime, timedelta, timezone
from typing import Any

import click
import pytest
from prometheus_client.exposition import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from milpa_sessions.stats_cli import describe_window, parse_since, pause_rows_json
from processors.histogram import LATENESS_MS_BUCKETS, Histogram
from processors.metrics import Metrics, consumer_lag
from processors.scheduler import SchedulerStats
from processors.worker import WorkerStats
from projections.analytics import (
    Analytics,
    Count,
    PausesByHour,
    PausesByOutcome,
    PausesByReason,
    TimeToAnswer,
    by_outcome,
    by_reason,
    floor_hour,
    parse_hour,
    tta_bound,
    tta_labels,
    window_hours,
)
from projections.indexes import TTA_BUCKETS, hour_of, tta_bucket
from projections.keys import Keys
from schemas.errors import ProjectionError
from session_model.session import OTHER_NAMES, PAUSE_REASONS

NOW = datetime(2026, 3, 10, 10, 15, 30, tzinfo=UTC)


# -- the --since window → hour keys ---------------------------------------------------------------


def test_a_thirty_minute_window_that_crosses_the_hour_reads_two_buckets() -> None:
    assert window_hours(timedelta(minutes=30), NOW) == ("2026031009", "2026031010")


def test_a_thirty_minute_window_inside_one_hour_reads_one_bucket() -> None:
    at = datetime(2026, 3, 10, 10, 45, tzinfo=UTC)
    assert window_hours(timedelta(minutes=30), at) == ("2026031010",)


def test_a_day_reads_twenty_five_overlapping_buckets_oldest_first() -> None:
    hours = window_hours(timedelta(hours=24), NOW)
    assert len(hours) == 25
    assert (hours[0], hours[-1]) == ("2026030910", "2026031010")
    assert list(hours) == sorted(hours) and len(set(hours)) == 25


def test_the_window_crosses_days_months_and_years() -> None:
    at = datetime(2026, 1, 1, 0, 5, tzinfo=UTC)
    assert window_hours(timedelta(hours=2), at) == ("2025123122", "2025123123", "2026010100")


def test_window_hours_are_utc_whatever_the_zone_of_now() -> None:
    local = NOW.astimezone(timezone(timedelta(hours=-5)))
    assert window_hours(timedelta(days=7), local) == window_hours(timedelta(days=7), NOW)
    assert len(window_hours(timedelta(days=7), NOW)) == 7 * 24 + 1


def test_window_hours_use_the_same_bucket_names_as_the_counters() -> None:
    for h in window_hours(timedelta(hours=5), NOW):
        assert hour_of(parse_hour(h)) == h
    assert hour_of(NOW) == window_hours(timedelta(minutes=1), NOW)[-1]


def test_an_empty_or_negative_window_and_a_naive_now_are_refused() -> None:
    with pytest.raises(ValueError, match="positive"):
        window_hours(timedelta(0), NOW)
    with pytest.raises(ValueError, match="positive"):
        window_hours(timedelta(hours=-1), NOW)
    with pytest.raises(ValueError, match="naive"):
        floor_hour(datetime(2026, 1, 1, 10, 30))


# -- --since parsing ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("30m", timedelta(minutes=30)),
        ("24h", timedelta(hours=24)),
        ("7d", timedelta(days=7)),
        ("1h", timedelta(hours=1)),
        (" 12H ", timedelta(hours=12)),
        ("all", None),
        ("ALL", None),
    ],
)
def test_durations_parse(text: str, expected: timedelta | None) -> None:
    assert parse_since(text) == expected


@pytest.mark.parametrize("text", ["", "24", "h", "1.5h", "-1h", "0h", "0m", "3w", "24 hours", "x"])
def test_bad_durations_are_bad_parameters(text: str) -> None:
    with pytest.raises(click.BadParameter):
        parse_since(text)


@pytest.mark.parametrize("text", ["367d", "8785h", "999999d", "999999999999d"])
def test_a_window_beyond_a_year_is_a_bad_parameter_not_a_crash(text: str) -> None:
    with pytest.raises(click.BadParameter, match="--since all"):
        parse_since(text)
    assert parse_since("366d") == timedelta(days=366)


def test_the_window_is_described_in_whole_utc_hours() -> None:
    assert describe_window(None, NOW) == "all time"
    assert describe_window(timedelta(minutes=30), NOW) == (
        "since 2026-03-10 09:00 UTC (2 hour buckets)"
    )


# -- outcome arithmetic ---------------------------------------------------------------------------


def test_still_open_is_pauses_minus_answered_minus_expired_per_reason() -> None:
    rows = by_reason(
        {"permission": 5, "signature": 2, "unspecified": 1},
        {
            "permission|answered": 2,
            "permission|expired": 1,
            "signature|answered": 2,
            "unspecified|expired": 1,
        },
    )
    assert rows == (
        PausesByReason("permission", 5, 2, 1, 2),
        PausesByReason("signature", 2, 2, 0, 0),
        PausesByReason("unspecified", 1, 0, 1, 0),
    )


def test_a_reason_with_outcomes_but_no_pauses_in_the_window_still_shows_and_never_negative() -> (
    None
):
    rows = by_reason({}, {"target_not_named|answered": 1})
    assert rows == (PausesByReason("target_not_named", 0, 1, 0, 0),)


def test_outcome_fields_split_on_the_last_bar_and_ignore_unknown_outcomes() -> None:
    rows = by_reason({"a|b": 2}, {"a|b|answered": 1, "a|b|mystery": 7})
    assert rows == (PausesByReason("a|b", 2, 1, 0, 1),)


def test_by_outcome_regroups_the_reason_rows_and_leaves_out_zeros() -> None:
    rows = (PausesByReason("permission", 3, 1, 1, 1), PausesByReason("signature", 1, 1, 0, 0))
    assert by_outcome(rows) == (
        PausesByOutcome("answered", "permission", 1),
        PausesByOutcome("answered", "signature", 1),
        PausesByOutcome("expired", "permission", 1),
        PausesByOutcome("still_open", "permission", 1),
    )


# -- time-to-answer buckets -----------------------------------------------------------------------


def test_tta_labels_cover_every_bucket_the_fold_can_write_in_order() -> None:
    labels = tta_labels()
    assert labels[0] == "le_1s" and labels[-1] == "gt_86400s"
    assert len(labels) == len(TTA_BUCKETS) + 1
    written = [tta_bucket(s) for s in (0, 0.5, 1, 1.001, 4, 29, 59, 299, 1799, 3599, 21599, 86399)]
    assert set(written) <= set(labels)
    assert tta_bucket(10**6) == labels[-1]
    assert [labels.index(w) for w in written] == sorted(labels.index(w) for w in written)


def test_tta_bounds_read_back_from_labels() -> None:
    assert [tta_bound(label) for label in tta_labels()] == [*TTA_BUCKETS, None]
    assert tta_bound("le_xs") is None


# -- the reader over a fake client (the query plan: one pipelined round trip) ----------------------


class _Pipe:
    def __init__(self, client: _FakeRedis) -> None:
        self.client = client
        self.queued: list[str] = []

    def execute_command(self, name: str, key: str, *fields: str) -> None:
        assert name in ("HGETALL", "HGET")
        self.queued.append(key)

    def execute(self) -> list[Any]:
        self.client.round_trips.append(list(self.queued))
        return [
            self.client.generations.get(k)
            if k in self.client.generations or ":generation:" in k
            else self.client.hashes.get(k, {})
            for k in self.queued
        ]


class _FakeRedis:
    def __init__(self, hashes: dict[str, dict[str, int]]) -> None:
        self.hashes = {
            k: {f.encode(): str(n).encode() for f, n in h.items()} for k, h in hashes.items()
        }
        self.round_trips: list[list[str]] = []
        self.generations: dict[str, bytes] = {}  # generation hash -> its `g` field

    def pipeline(self, transaction: bool = True) -> _Pipe:
        return _Pipe(self)

    def scan_iter(self, match: str, count: int) -> Any:
        return iter(k.encode() for k in self.hashes if fnmatch.fnmatchcase(k, match))


KEYS = Keys("t", partitions=2)  # each counter is sharded per partition: readers add them up


def _fake() -> _FakeRedis:
    return _FakeRedis(
        {
            KEYS.stat("pauses", 0): {"permission": 5, "signature": 1},
            KEYS.stat("pauses", 1): {"permission": 4},
            KEYS.stat("outcomes", 1): {"permission|answered": 4, "permission|expired": 2},
            KEYS.stat_hour("pauses", "2026031009", 0): {"permission": 2},
            KEYS.stat_hour("pauses", "2026031009", 1): {"unspecified": 1},
            KEYS.stat_hour("pauses", "2026031010", 1): {"permission": 1},
            KEYS.stat_hour("pauses", "2026030101", 0): {"permission": 6, "signature": 1},
            KEYS.stat_hour("outcomes", "2026031009", 0): {"permission|answered": 1},
            KEYS.stat_hour("outcomes", "2026031010", 0): {"permission|expired": 1},
            KEYS.stat("tta", 0): {"permission|le_5s": 2, "permission|gt_86400s": 1},
            KEYS.stat("tta", 1): {"permission|le_5s": 1},
            KEYS.stat("rejections", 0): {"stale_question": 1, "no_open_question": 4},
            KEYS.stat("downgrades", 1): {"principal": 2},
        }
    )


def test_since_reads_only_the_window_hours_in_one_round_trip() -> None:
    fake = _fake()
    rows = Analytics(fake, KEYS, follow=False).pauses(timedelta(minutes=30), NOW)  # type: ignore[arg-type]
    assert fake.round_trips == [
        [
            *KEYS.stat_shards("pauses", "2026031009"),
            *KEYS.stat_shards("pauses", "2026031010"),
            *KEYS.stat_shards("outcomes", "2026031009"),
            *KEYS.stat_shards("outcomes", "2026031010"),
        ]
    ]
    assert rows == (
        PausesByReason("permission", 3, 1, 1, 1),
        PausesByReason("unspecified", 1, 0, 0, 1),
    )


def test_all_time_reads_the_totals() -> None:
    fake = _fake()
    analytics = Analytics(fake, KEYS, follow=False)  # type: ignore[arg-type]
    assert analytics.pauses(None, NOW) == (
        PausesByReason("permission", 9, 4, 2, 3),
        PausesByReason("signature", 1, 0, 0, 1),
    )
    assert fake.round_trips == [[*KEYS.stat_shards("pauses"), *KEYS.stat_shards("outcomes")]]
    assert analytics.pauses(None, NOW, "outcome")[0] == PausesByOutcome("answered", "permission", 4)


def test_by_hour_lists_each_hour_and_reason() -> None:
    analytics = Analytics(_fake(), KEYS, follow=False)  # type: ignore[arg-type]
    h9, h10 = parse_hour("2026031009"), parse_hour("2026031010")
    assert analytics.pauses(timedelta(hours=2), NOW, "hour") == (
        PausesByHour(h9, "permission", 2),
        PausesByHour(h9, "unspecified", 1),
        PausesByHour(h10, "permission", 1),
    )
    everything = analytics.pauses(None, NOW, "hour")
    assert [r.hour for r in everything] == [parse_hour("2026030101")] * 2 + [h9, h9, h10]
    assert pause_rows_json(everything[:1]) == [
        {"hour": "2026-03-01T01:00:00+00:00", "reason": "permission", "count": 6}
    ]


def test_tta_rejections_and_downgrades() -> None:
    analytics = Analytics(_fake(), KEYS, follow=False)  # type: ignore[arg-type]
    tta = analytics.time_to_answer()
    assert [r.bucket for r in tta] == list(tta_labels())
    assert tta[1] == TimeToAnswer("permission", "le_5s", 5, 3)
    assert tta[-1] == TimeToAnswer("permission", "gt_86400s", None, 1)
    assert sum(r.count for r in tta) == 4
    assert analytics.rejections() == (Count("no_open_question", 4), Count("stale_question", 1))
    assert analytics.downgrades() == (Count("principal", 2),)


def test_an_unknown_grouping_and_a_corrupt_counter_are_errors() -> None:
    analytics = Analytics(_fake(), KEYS, follow=False)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="grouping"):
        analytics.pauses(None, NOW, "weekday")  # type: ignore[call-overload]
    broken = _FakeRedis({})
    broken.hashes[KEYS.stat("rejections", 1)] = {b"late_answer": b"many"}
    with pytest.raises(ProjectionError, match="late_answer"):
        Analytics(broken, KEYS, follow=False).rejections()  # type: ignore[arg-type]


# -- metrics --------------------------------------------------------------------------------------


def test_lag_is_highwater_minus_last_offset_minus_one_for_known_partitions() -> None:
    assert consumer_lag({0: 10, 1: 5, 2: 7}, {0: 9, 1: 1, 3: 4}) == {0: 0, 1: 3}
    assert consumer_lag({0: 3}, {0: 5}) == {0: 0}  # a stale highwater never reads negative


def test_a_histogram_counts_each_value_in_its_bucket_in_bounded_memory() -> None:
    h = Histogram(LATENESS_MS_BUCKETS)
    h.observe_many([0.5, 3.0, 9.9, 10.0])
    h.observe_many([12.0, 99999.0])
    for _ in range(10_000):
        h.observe(1.0)
    assert len(h.counts) == len(LATENESS_MS_BUCKETS) + 1  # whatever was observed
    assert h.count == 10_006
    assert h.counts[LATENESS_MS_BUCKETS.index(10)] == 2  # 9.9 and 10.0: le="10"
    assert h.counts[0] == 10_001  # 0.5 and the 1.0s: le="1"
    assert h.counts[-1] == 1  # +Inf only
    assert h.total == pytest.approx(0.5 + 3 + 9.9 + 10 + 12 + 99999 + 10_000)


def _scrape(metrics: Metrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = generate_latest(metrics.registry).decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_the_collector_reads_the_stats_when_scraped() -> None:
    w = WorkerStats(batches=2, records=7, applied=6, decisions=1, downgrades=1)
    w.outcomes.update({"applied": 6, "rejected": 1})
    w.pauses.update({"permission": 2, "unspecified": 1})
    w.rejections.update({"stale_question": 1})
    w.refused.update({"decoder_failed": 2})
    w.batch_sizes.observe_many([3, 4])
    w.last_offsets.update({0: 9, 2: 1})
    s = SchedulerStats(closings=2)
    s.lateness.observe_many([1.5, 8.0])
    state: dict[str, Any] = {"w": None}
    metrics = Metrics(lambda: state["w"], lambda: s, lambda: {0: 10, 2: 5, 4: 1})
    assert _scrape(metrics)[("milpa_batches_total", ())] == 0  # no worker yet: zeros
    state["w"] = w
    got = _scrape(metrics)
    assert got[("milpa_pauses_total", (("reason", "permission"),))] == 2
    assert got[("milpa_pauses_total", (("reason", "unspecified"),))] == 1
    assert got[("milpa_events_total", (("outcome", "applied"),))] == 6
    assert got[("milpa_rejections_total", (("code", "stale_question"),))] == 1
    assert got[("milpa_refused_total", (("code", "decoder_failed"),))] == 2
    assert got[("milpa_refused_total", (("code", "wrong_partition"),))] == 0  # there from the start
    assert got[("milpa_principal_downgrades_total", ())] == 1
    assert got[("milpa_batch_size_count", ())] == 2
    assert got[("milpa_batch_size_sum", ())] == 7
    assert got[("milpa_scheduler_closings_total", ())] == 2
    assert got[("milpa_expiry_lateness_ms_count", ())] == 2
    assert got[("milpa_expiry_lateness_ms_bucket", (("le", "2.0"),))] == 1
    assert got[("milpa_expiry_lateness_ms_bucket", (("le", "10.0"),))] == 2
    assert got[("milpa_consumer_lag", (("partition", "0"),))] == 0
    assert got[("milpa_consumer_lag", (("partition", "2"),))] == 3
    assert ("milpa_consumer_lag", (("partition", "4"),)) not in got
    assert got[("milpa_snapshots_total", ())] == 0  # no snapshot rounds (yet): zeros
    w.pauses["permission"] += 1
    s.lateness.observe(20.0)
    again = _scrape(metrics)
    assert again[("milpa_pauses_total", (("reason", "permission"),))] == 3
    assert again[("milpa_expiry_lateness_ms_count", ())] == 3


def test_a_worker_labels_its_pauses_with_at_most_the_bound_of_reason_codes() -> None:
    w = WorkerStats()
    for i in range(PAUSE_REASONS + 10):
        w.count_pause(f"code_{i}")
    w.count_pause("code_0")
    got = _scrape(Metrics(lambda: w, lambda: None))
    labelled = {dict(k)["reason"]: v for (n, k), v in got.items() if n == "milpa_pauses_total"}
    assert len(labelled) == PAUSE_REASONS + 1
    assert labelled["code_0"] == 2 and labelled[OTHER_NAMES] == 10


def test_scrapes_tolerate_counters_growing_in_another_thread() -> None:
    c: Counter[str] = Counter()
    stop = threading.Event()

    def grow() -> None:
        n = 0
        while not stop.is_set():
            c[f"r{n % 500}"] += 1
            n += 1

    grower = threading.Thread(target=grow, daemon=True)
    grower.start()
    metrics = Metrics(lambda: WorkerStats(pauses=c), lambda: None)
    try:
        totals = [
            sum(v for (n, _), v in _scrape(metrics).items() if n == "milpa_pauses_total")
            for _ in range(20)
        ]
    finally:
        stop.set()
        grower.join()
    assert totals == sorted(totals) and totals[-1] > 0


def test_the_counters_are_read_in_each_partitions_current_generation() -> None:
    """After a live rebuild moved partition 1 to generation 2, its shard is read there."""
    fake = _fake()
    fake.generations[KEYS.generation_key(1)] = b"2"
    moved = KEYS.in_generations((0, 2))
    fake.hashes[moved.stat("pauses", 1)] = {b"permission": b"7"}
    assert Analytics(fake, KEYS).counter("pauses") == {"permission": 5 + 7, "signature": 1}
    assert fake.round_trips[0] == [KEYS.generation_key(0), KEYS.generation_key(1)]
