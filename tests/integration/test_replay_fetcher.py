"""The rebuild's fetcher thread and processes: failures come out as the project's errors."""

from __future__ import annotations

import dataclasses
import threading
from datetime import UTC, datetime, timedelta

import pytest

from milpa_sessions.settings import Settings
from processors.replay import replay
from producers.kafka_log import KafkaEventLog
from projections.redis_store import RedisProjectionStore
from schemas import events as ev
from schemas.codec import EventCodec
from schemas.errors import BackendError, LogError, ProjectionError
from schemas.events import Event
from session_model.fold import fold
from session_model.signing import TrustedKeys

pytestmark = pytest.mark.integration
T0 = datetime(2025, 1, 1, tzinfo=UTC)


def _fetchers() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "replay-fetcher"]


def _events(sessions: int, turns: int) -> list[Event]:
    out = []
    for s in range(sessions):
        sid = f"rf-{s:03d}"
        out.append(Event(f"{sid}-0", sid, ev.STARTED, T0, "it", {"goal": "g", "mode": "ask"}))
        out.extend(
            Event(
                f"{sid}-{i}",
                sid,
                ev.TURN,
                T0 + timedelta(milliseconds=i),
                "it",
                {"role": "user", "content": f"turn {i}"},
            )
            for i in range(1, turns + 1)
        )
    return out


def test_a_missing_topic_is_a_log_error_and_is_not_created(
    settings: Settings, projections: RedisProjectionStore
) -> None:
    missing = f"{settings.events_topic}-missing"
    for _ in range(2):  # the second time, it still does not exist
        with pytest.raises(LogError, match="does not exist"):
            replay(settings.kafka_access(), missing, projections, TrustedKeys.none())
    assert not _fetchers()


def test_an_unreachable_broker_is_a_log_error(projections: RedisProjectionStore) -> None:
    with pytest.raises(LogError, match="cannot reach Kafka"):
        replay("127.0.0.1:1", "any", projections, TrustedKeys.none())
    assert not _fetchers()


def test_a_store_failure_stops_the_fetcher(settings: Settings, kafka_log: KafkaEventLog) -> None:
    for event in _events(3, 5):
        kafka_log.send(event)
    kafka_log.flush(timeout=30)
    unreachable = RedisProjectionStore.from_url("redis://127.0.0.1:1/0", settings.redis_keys())
    with pytest.raises(ProjectionError):
        replay(settings.kafka_access(), settings.events_topic, unreachable, TrustedKeys.none())
    assert not _fetchers()


def test_small_batches_report_progress_and_rebuild_every_session(
    settings: Settings, kafka_log: KafkaEventLog, projections: RedisProjectionStore
) -> None:
    events = _events(12, 9)
    for event in events:
        kafka_log.send(event)
    kafka_log.flush(timeout=30)
    seen: list[tuple[int, int]] = []
    report = replay(
        settings.kafka_access(),
        settings.events_topic,
        projections,
        TrustedKeys.none(),
        batch_size=7,
        progress=lambda read, total: seen.append((read, total)),
    )
    assert (report.records, report.applied_sessions, report.refused_total) == (len(events), 12, 0)
    assert len(seen) > 1
    assert [r for r, _ in seen] == sorted(r for r, _ in seen)
    assert seen[-1] == (len(events), len(events))
    for sid in {e.session_id for e in events}:
        assert projections.load(sid) == fold(sid, [e for e in events if e.session_id == sid])
    assert not _fetchers()


@pytest.mark.forks_in_process  # (see pyproject.toml)
def test_partitions_rebuilt_in_two_processes_give_what_one_process_gives(
    settings: Settings, kafka_log: KafkaEventLog, projections: RedisProjectionStore
) -> None:
    events = _events(30, 6)
    for event in events:
        kafka_log.send(event)
    kafka_log.flush(timeout=30)
    seen: list[tuple[int, int]] = []
    reports = []
    states = []
    for processes in (2, 1):
        reports.append(
            replay(
                settings.kafka_access(),
                settings.events_topic,
                projections,
                TrustedKeys.none(),
                batch_size=11,
                processes=processes,
                progress=lambda read, total: seen.append((read, total)),
            )
        )
        states.append({sid: projections.load(sid) for sid in projections.ids()})
    assert [r.processes for r in reports] == [2, 1]
    assert reports[0] == dataclasses.replace(reports[1], processes=2)
    assert (reports[0].records, reports[0].applied_sessions) == (len(events), 30)
    assert states[0] == states[1]
    for sid, state in states[0].items():
        assert state == fold(sid, [e for e in events if e.session_id == sid])
    assert seen[-1] == (len(events), len(events))


class _Exploding(EventCodec):
    def decode(self, data: bytes) -> Event:
        raise RuntimeError("boom")


@pytest.mark.forks_in_process  # (see pyproject.toml)
def test_a_failure_in_a_rebuild_process_comes_back_as_a_backend_error(
    settings: Settings,
    kafka_log: KafkaEventLog,
    projections: RedisProjectionStore,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for event in _events(12, 2):
        kafka_log.send(event)
    kafka_log.flush(timeout=30)

    def exploding(*args: object, **kwargs: object) -> None:
        raise RuntimeError("boom")

    monkeypatch.setattr(RedisProjectionStore, "commit", exploding)  # the forked children's too
    with pytest.raises(BackendError, match="RuntimeError: boom"):
        replay(
            settings.kafka_access(),
            settings.events_topic,
            projections,
            TrustedKeys.none(),
            processes=2,
        )


@pytest.mark.forks_in_process  # (see pyproject.toml)
def test_records_whose_decoding_raises_are_refused_not_a_failure_of_the_rebuild(
    settings: Settings, kafka_log: KafkaEventLog, projections: RedisProjectionStore
) -> None:
    events = _events(12, 2)
    for event in events:
        kafka_log.send(event)
    kafka_log.flush(timeout=30)
    report = replay(
        settings.kafka_access(),
        settings.events_topic,
        projections,
        TrustedKeys.none(),
        codec=_Exploding(),
        processes=2,
    )
    assert report.refused == {"decoder_failed": len(events)} and report.applied_sessions == 0
