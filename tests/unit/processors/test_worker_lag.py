"""How far a worker's projection trails the log: a batch's oldest record's age when the worker
holds the batch, and when its commit made it readable."""

from __future__ import annotations

import asyncio
import dataclasses
import time

from processors.metrics import StatsCollector
from processors.worker import ProjectionWorker
from projections.memory import InMemoryProjectionStore
from session_model.projection import BatchFolder
from tests.unit.builders import started, turn
from tests.unit.processors.test_worker_expired import _AsyncStore, _raw, _Sink


def _worker() -> ProjectionWorker:
    store = InMemoryProjectionStore()
    return ProjectionWorker(_AsyncStore(store), BatchFolder(), _Sink(), _Sink())  # type: ignore[arg-type]


def _counted(histogram: object, above_ms: float) -> tuple[int, int]:
    """(observations, those above `above_ms`) of a worker histogram."""
    counts, _ = histogram.snapshot()  # type: ignore[attr-defined]
    bounds = histogram.bounds  # type: ignore[attr-defined]
    over = sum(c for b, c in zip((*bounds, float("inf")), counts, strict=True) if b > above_ms)
    return sum(counts), over


def test_a_batch_is_timed_from_its_oldest_record_to_held_and_to_readable() -> None:
    worker = _worker()
    now_ms = int(time.time() * 1000)
    events = [started(session_id="a"), turn("user", "go", session_id="a")]
    # The first record is a minute old (a worker catching up), the second fresh.
    stamps = [now_ms - 60_000, now_ms]
    raws = [
        dataclasses.replace(_raw(e, i), timestamp=t)
        for i, (e, t) in enumerate(zip(events, stamps, strict=True))
    ]
    asyncio.run(worker.process(raws))
    for histogram in (worker.stats.fetched_lag_ms, worker.stats.visible_lag_ms):
        assert _counted(histogram, 30_000) == (1, 1)  # one batch, timed from its oldest record
        assert 60_000 <= histogram.snapshot()[1] < 70_000  # the sum: its age, in ms
    found = {
        s.name
        for family in StatsCollector(lambda: worker.stats, lambda: None, dict).collect()
        for s in family.samples
    }
    assert {"milpa_batch_fetched_lag_ms_count", "milpa_batch_visible_lag_ms_count"} <= found


def test_records_without_a_timestamp_are_not_timed() -> None:
    worker = _worker()
    asyncio.run(worker.process([_raw(started(session_id="a"), 0)]))
    assert worker.stats.fetched_lag_ms.snapshot()[0] == [0] * (
        len(worker.stats.fetched_lag_ms.bounds) + 1
    )
    assert worker.stats.batches == 1


def test_a_batch_stamped_ahead_of_the_worker_s_clock_is_counted_not_hidden_as_no_lag() -> None:
    worker = _worker()
    now_ms = int(time.time() * 1000)
    ahead = [
        dataclasses.replace(_raw(started(session_id="a"), 0), timestamp=now_ms + 60_000),
    ]
    asyncio.run(worker.process(ahead))
    assert worker.stats.timestamps_ahead == 1
    assert worker.stats.fetched_lag_ms.snapshot()[1] == 0  # read as no lag: hence the count
    fresh = [dataclasses.replace(_raw(turn("user", "go", session_id="a"), 1), timestamp=now_ms)]
    asyncio.run(worker.process(fresh))  # (within the second: not counted)
    assert worker.stats.timestamps_ahead == 1
    samples = {
        s.name: s.value
        for family in StatsCollector(lambda: worker.stats, lambda: None, dict).collect()
        for s in family.samples
    }
    assert samples["milpa_batch_timestamps_ahead_total"] == 1
