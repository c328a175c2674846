"""The e2e figure's watcher (`bench/figures/e2e.py`) on the real Redis: a mark it waits for is read
when the commit's keyspace notification arrives, not by its periodic sweep.

Plain stack only: it changes `notify-keyspace-events` (CONFIG SET), which the secured stack's
test users may not.
"""

from __future__ import annotations

import queue
import threading
import time
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
import redis

from bench.figures.e2e import NOTIFY_SETTING, enable_notifications, watch_marks
from milpa_sessions.settings import Settings
from projections.redis_store import RedisProjectionStore
from schemas import events as ev
from schemas.events import Event
from session_model.projection import BatchFolder, Position, Record

pytestmark = [pytest.mark.integration, pytest.mark.plain_stack]
T0 = datetime(2026, 1, 1, tzinfo=UTC)


def _records(sid: str, partition: int, n: int) -> list[Record]:
    specs = [(ev.STARTED, {"goal": "g", "mode": "ask"})]
    specs += [(ev.PLAN_SET, {"plan": f"plan {i}"}) for i in range(1, n)]
    return [
        Record(
            Event(
                event_id=f"{sid}-{i}",
                session_id=sid,
                type=type_,
                occurred_at=T0 + timedelta(seconds=i),
                producer="watcher-test",
                payload=payload,
            ),
            Position(partition, i),
        )
        for i, (type_, payload) in enumerate(specs)
    ]


def test_the_watcher_reads_a_mark_when_its_commit_is_notified_and_sets_the_setting_back(
    settings: Settings, projections: RedisProjectionStore
) -> None:
    server = redis.Redis.from_url(settings.redis_url)
    before = server.config_get(NOTIFY_SETTING)[NOTIFY_SETTING]
    undo = enable_notifications(settings)
    acked: queue.Queue[Any] = queue.Queue()
    results: queue.Queue[Any] = queue.Queue()
    # A sweep every minute: within this test only a notification can resolve the sample.
    watcher = threading.Thread(target=watch_marks, args=(settings, 60.0, acked, results))
    watcher.start()
    try:
        assert results.get(timeout=30) == "ready"
        assert set("Kh") <= set(server.config_get(NOTIFY_SETTING)[NOTIFY_SETTING])
        sid = "watched"
        partition = projections.keys.partition_of(sid)
        records = _records(sid, partition, 3)
        sent = time.perf_counter()
        acked.put((sid, partition, 2, sent, sent))  # waits for offset 2: not there yet
        time.sleep(0.3)
        assert results.empty()
        first = BatchFolder().fold({}, records[:2])
        assert not projections.commit(first).conflicts  # offsets 0-1: notified, not enough
        time.sleep(0.3)
        committed = time.perf_counter()
        second = BatchFolder().fold(projections.folded([sid]), records[2:])
        assert not projections.commit(second).conflicts
        acked.put(None)
        sent_at, from_send, from_ack, reads, _, swept = results.get(timeout=30)
    finally:
        acked.put(None)
        watcher.join(timeout=30)
        undo()
    assert sent_at == [sent]
    assert len(from_send) == len(from_ack) == 1
    # Read after the commit that reached offset 2, within a second of it (not the sweep's minute).
    assert committed - sent <= from_send[0] / 1000 < committed - sent + 1.0
    assert swept == 0
    assert reads >= 2  # once for the commit that did not reach it, once for the one that did
    assert server.config_get(NOTIFY_SETTING)[NOTIFY_SETTING] == before
    server.close()
