"""What a worker tells about its cache: the sessions it holds and those it had to read."""

from __future__ import annotations

import asyncio

from processors.metrics import StatsCollector
from processors.worker import ProjectionWorker, WorkerStats
from projections.memory import InMemoryProjectionStore
from session_model.projection import BatchFolder
from tests.unit.builders import started, turn
from tests.unit.processors.test_worker_expired import _AsyncStore, _raw, _Sink


def test_the_worker_counts_the_states_it_reads_and_the_sessions_its_cache_holds() -> None:
    store = InMemoryProjectionStore()
    worker = ProjectionWorker(
        _AsyncStore(store),  # type: ignore[arg-type]
        BatchFolder(),
        _Sink(),
        _Sink(),
        cache_limit=2,
    )
    first = [started(session_id=sid) for sid in ("a", "b", "c")]
    asyncio.run(worker.process([_raw(e, i) for i, e in enumerate(first)]))
    assert worker.stats.state_reads == 3  # new to the worker: each one read (and not found)
    held = worker.stats.cached_sessions
    assert 1 <= held <= 2  # past its limit, the older half of the cache is dropped

    again = [turn("user", "go on", session_id=sid) for sid in ("a", "b", "c")]
    asyncio.run(worker.process([_raw(e, 3 + i) for i, e in enumerate(again)]))
    assert worker.stats.state_reads == 3 + (3 - held)  # those dropped are read back
    assert all(store.load(sid).seq == 2 for sid in ("a", "b", "c"))  # type: ignore[union-attr]


def test_the_cache_is_exported_as_metrics() -> None:
    stats = WorkerStats(state_reads=7, cached_sessions=5)
    found = {
        s.name: s.value
        for family in StatsCollector(lambda: stats, lambda: None, dict).collect()
        for s in family.samples
    }
    assert found["milpa_state_reads_total"] == 7 and found["milpa_cached_sessions"] == 5
