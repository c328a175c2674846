"""A stored state that does not decode: the worker neither folds onto nothing nor skips its
events; it waits, counts it apart from Redis being away, and names the remedy in its log."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence

import pytest

from processors.metrics import StatsCollector
from processors.worker import ProjectionWorker
from projections.memory import InMemoryProjectionStore
from schemas.errors import CorruptProjectionError, ProjectionError
from session_model.projection import BatchFolder, Folded
from tests.unit.builders import started, turn
from tests.unit.processors.test_worker_expired import _AsyncStore, _raw, _Sink


class _Failing(_AsyncStore):
    """Reads fail with these errors first, then answer."""

    def __init__(self, inner: InMemoryProjectionStore, errors: list[Exception]) -> None:
        super().__init__(inner)
        self.errors = errors

    async def folded(self, session_ids: Sequence[str]) -> dict[str, Folded]:
        if self.errors:
            raise self.errors.pop(0)
        return await super().folded(session_ids)


def test_a_state_that_does_not_decode_is_waited_on_counted_and_named(
    caplog: pytest.LogCaptureFixture,
) -> None:
    store = InMemoryProjectionStore()
    errors: list[Exception] = [
        CorruptProjectionError("s1: the stored state cannot be read: bad zlib"),
        ProjectionError("reading states failed: ConnectionError"),
    ]
    worker = ProjectionWorker(
        _Failing(store, errors),  # type: ignore[arg-type]
        BatchFolder(),
        _Sink(),
        _Sink(),
        retry_initial=0.001,
        retry_max=0.001,
    )
    raws = [_raw(started(session_id="s1"), 0), _raw(turn("user", "hi", session_id="s1"), 1)]
    with caplog.at_level(logging.ERROR, logger="processors.worker"):
        committed = asyncio.run(worker.process(raws))

    assert [u.session_id for u in committed] == ["s1"]  # applied once the read succeeded
    loaded = store.load("s1")
    assert loaded is not None and loaded.turn_count == 1
    assert worker.stats.redis_retries == 2 and worker.stats.corrupt_reads == 1
    text = caplog.text
    assert "cannot be read" in text and "replay --session" in text
    assert "redis unavailable (reading states failed" in text  # Redis away: said as before
    assert text.count("replay --session") == 1
    scraped = StatsCollector(lambda: worker.stats, lambda: None, dict).collect()
    families = {f.name: f for f in scraped}
    assert families["milpa_corrupt_state_reads"].samples[0].value == 1
