"""Poison records, unknown events and rebuilding projections from the topic, on the real stack."""

from __future__ import annotations

import json
import time
from datetime import UTC, datetime
from io import BytesIO
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from fastavro import parse_schema, schemaless_writer
from kafka import KafkaConsumer, KafkaProducer, TopicPartition

from milpa_sessions import wiring
from milpa_sessions.cli import main
from milpa_sessions.settings import Settings
from processors.replay import replay
from processors.worker import DEADLETTER_CUT, DEADLETTER_REASON, DEADLETTER_SOURCE
from producers.kafka_log import KafkaEventLog
from projections.redis_store import RedisProjectionStore
from schemas import events as ev
from schemas.codec import ENVELOPE_SCHEMA, MARKER, EventCodec, SchemaRegistry, schema_fingerprint
from schemas.errors import SessionRestoringError
from schemas.events import Event
from session_model.fold import fold
from session_model.partitioning import partition_for
from session_model.projection import Position
from session_model.signing import TrustedKeys
from tests.integration.conftest import damage_state
from tests.integration.expected import expected_projections
from tests.integration.test_scale_and_crash import (
    assert_equals_the_fold,
    dump,
    generate,
    records_in,
    send_all,
    wait_for_all,
)

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
OCCURRED = datetime(2026, 3, 2, 12, 0, tzinfo=UTC)


def _event(sid: str, n: int, type_: str, payload: dict[str, Any]) -> Event:
    return Event(f"{sid}-e{n}", sid, type_, OCCURRED, "it-agent", payload)


def _send_raw(
    producer: KafkaProducer, topic: str, key: bytes | None, value: bytes | None
) -> Position:
    metadata = producer.send(topic, key=key, value=value).get(timeout=30)
    return Position(metadata.partition, metadata.offset)


def _partitions(consumer: KafkaConsumer, topic: str) -> list[TopicPartition]:
    numbers = consumer.partitions_for_topic(topic)
    assert numbers, f"topic {topic} does not exist"
    return [TopicPartition(topic, p) for p in sorted(numbers)]


def _consume_all(settings: Settings, topic: str, count: int, timeout: float) -> list[Any]:
    """Read `topic` from the start until `count` records arrived (or fail after `timeout`)."""
    consumer = KafkaConsumer(
        **settings.kafka_access().kafka_python(),
        group_id=None,
        enable_auto_commit=False,
    )
    try:
        partitions = _partitions(consumer, topic)
        consumer.assign(partitions)
        consumer.seek_to_beginning(*partitions)
        records: list[Any] = []
        deadline = time.monotonic() + timeout
        while len(records) < count and time.monotonic() < deadline:
            for batch in consumer.poll(timeout_ms=200).values():
                records.extend(batch)
        assert len(records) >= count, f"{topic}: {len(records)} of {count} records in {timeout}s"
        return records
    finally:
        consumer.close()


def test_poison_records_land_in_the_dead_letter_topic_and_the_worker_stays_up(
    settings: Settings,
    kafka_log: KafkaEventLog,
    raw_producer: KafkaProducer,
    projections: RedisProjectionStore,
    start_worker: Any,
) -> None:
    worker = start_worker()
    codec = EventCodec()
    sid, key = "s-poison", b"s-poison"
    topic = settings.events_topic
    valid: list[Event] = []

    def append(event: Event) -> Position:
        valid.append(event)
        return kafka_log.append(event)

    append(_event(sid, 1, ev.STARTED, {"goal": "survive poison", "mode": "ask"}))
    append(_event(sid, 2, ev.TURN, {"role": "user", "content": "before"}))
    well_formed = codec.encode(_event(sid, 3, ev.TURN, {"role": "user", "content": "lost"}))
    unknown_fingerprint = MARKER + bytes.fromhex("deadbeefdeadbeef") + well_formed[10:]
    other = codec.encode(_event("s-other", 1, ev.STARTED, {"goal": "elsewhere", "mode": "ask"}))
    # Same key as the session: the poison sits in its partition, between its valid events.
    poison = {
        "garbage": (key, b"\x00\xffnot avro at all\x13"),
        "truncated": (key, well_formed[:-5]),
        "unknown fingerprint": (key, unknown_fingerprint),
        "key mismatch": (key, other),
        "empty value": (key, None),
    }
    sent = {name: _send_raw(raw_producer, topic, k, v) for name, (k, v) in poison.items()}
    append(_event(sid, 4, ev.TURN, {"role": "assistant", "content": "after"}))
    last = append(_event(sid, 5, ev.ENDED, {"because": "done"}))
    assert {p.partition for p in sent.values()} == {last.partition}

    wait_for_all(projections, {sid: last}, timeout=60, why="past the poison", workers=(worker,))
    session = projections.load(sid)
    assert session is not None and session.ended_because == "done"
    assert worker.alive(), worker.log()[-3000:]
    assert_equals_the_fold(projections, expected_projections(valid, TrustedKeys.none()))
    assert projections.load("s-other") is None

    dead = _consume_all(settings, settings.deadletter_topic, len(poison), timeout=30)
    assert len(dead) == len(poison), [r.value[:20] for r in dead]
    by_source = {}
    for record in dead:
        headers = dict(record.headers)
        by_source[headers[DEADLETTER_SOURCE].decode()] = (record, headers)
    expected_reason = {
        "garbage": "CorruptRecordError",
        "truncated": "CorruptRecordError",
        "unknown fingerprint": "UnknownFingerprintError",
        "key mismatch": "key_mismatch: ",
        "empty value": "no_value: ",
    }
    reasons = {}
    for name, (k, value) in poison.items():
        source = f"{topic}:{sent[name].partition}:{sent[name].offset}"
        assert source in by_source, f"{name} ({source}) was not dead-lettered: {sorted(by_source)}"
        record, headers = by_source[source]
        assert record.key == k, name
        assert record.value == (value or b""), f"{name}: the original bytes were not kept"
        reasons[name] = headers[DEADLETTER_REASON].decode()
        assert expected_reason[name] in reasons[name], f"{name}: reason {reasons[name]!r}"
    assert "deadbeefdeadbeef" in reasons["unknown fingerprint"]
    assert worker.alive(), worker.log()[-3000:]


def test_a_poison_record_at_the_broker_limit_is_dead_lettered_cut_and_the_worker_goes_on(
    settings: Settings,
    kafka_log: KafkaEventLog,
    raw_producer: KafkaProducer,
    projections: RedisProjectionStore,
    start_worker: Any,
) -> None:
    # The broker takes this record; with the dead letter's headers it would no longer fit in a
    # produce request, and the worker could not get past it (every redelivery failing alike).
    worker = start_worker()
    sid, key = "s-huge-poison", b"s-huge-poison"
    value = b"\x00\xff" + bytes(range(256)) * 4095 + b"x" * 118  # 1,048,440 bytes, not Avro
    poison = _send_raw(raw_producer, settings.events_topic, key, value)
    last = kafka_log.append(_event(sid, 1, ev.STARTED, {"goal": "after it", "mode": "ask"}))
    assert last.partition == poison.partition
    wait_for_all(projections, {sid: last}, timeout=60, why="past the poison", workers=(worker,))
    assert worker.alive(), worker.log()[-3000:]

    source = f"{settings.events_topic}:{poison.partition}:{poison.offset}"
    dead = [
        r
        for r in _consume_all(settings, settings.deadletter_topic, 1, timeout=30)
        if dict(r.headers)[DEADLETTER_SOURCE].decode() == source
    ]
    assert len(dead) == 1
    headers = dict(dead[0].headers)
    assert headers[DEADLETTER_CUT].decode() == f"key:{len(key)},value:{len(value)}"
    assert dead[0].key == key
    assert len(dead[0].value) < len(value) and value.startswith(dead[0].value)
    assert "CorruptRecordError" in headers[DEADLETTER_REASON].decode()


def _future_event_bytes(sid: str, event_id: str) -> bytes:
    """An event of a type this build does not know, its payload written with a schema it lacks."""
    envelope = SchemaRegistry.default().reader(ENVELOPE_SCHEMA)
    future = parse_schema(
        {
            "type": "record",
            "name": "Teleported",
            "namespace": "milpa.sessions.payload",
            "fields": [{"name": "destination", "type": "string"}],
        }
    )
    body = BytesIO()
    body.write(MARKER + schema_fingerprint(future))
    schemaless_writer(body, future, {"destination": "mars"})
    out = BytesIO()
    out.write(envelope.header)
    schemaless_writer(
        out,
        envelope.schema,
        {
            "event_id": event_id,
            "session_id": sid,
            "type": "session.teleported",
            "occurred_at": OCCURRED,
            "producer": "agent:from-the-future",
            "expected_seq": None,
            "payload": body.getvalue(),
        },
    )
    return out.getvalue()


def test_unknown_event_types_and_payload_schemas_are_skipped_and_counted_not_dead_lettered(
    settings: Settings,
    kafka_log: KafkaEventLog,
    raw_producer: KafkaProducer,
    projections: RedisProjectionStore,
    start_worker: Any,
) -> None:
    worker = start_worker()
    codec = EventCodec()
    topic = settings.events_topic
    # A newer writer's ToolCalled (a field this reader does not know: unknown payload fingerprint).
    newer = (REPO / "tests/fixtures/evolution/newer/session.tool_called.bin").read_bytes()
    sid = codec.decode(newer).session_id
    records: list[bytes] = [
        codec.encode(_event(sid, 1, ev.STARTED, {"goal": "meet the future", "mode": "auto"})),
        _future_event_bytes(sid, f"{sid}-future-1"),
        newer,
        codec.encode(_event(sid, 2, ev.TURN, {"role": "user", "content": "still here"})),
        _future_event_bytes(sid, f"{sid}-future-2"),
        codec.encode(_event(sid, 3, ev.TURN, {"role": "assistant", "content": "and here"})),
    ]
    last = Position(0, 0)
    for value in records:
        last = _send_raw(raw_producer, topic, sid.encode(), value)

    wait_for_all(projections, {sid: last}, timeout=60, why="unknown events", workers=(worker,))
    session = projections.load(sid)
    assert session is not None
    decoded = [codec.decode(v) for v in records]
    assert [e.payload_readable for e in decoded] == [True, False, False, True, False, True]
    assert session.skipped == 3
    assert session.seq == len(records)
    assert [t.content for t in projections.history(sid)] == ["still here", "and here"]
    assert_equals_the_fold(projections, expected_projections(decoded, TrustedKeys.none()))
    # Dead letters are acknowledged before the batch's commit: none were written.
    assert records_in(settings, settings.deadletter_topic) == 0


def _differences(before: dict[str, Any], after: dict[str, Any]) -> list[str]:
    """The first few keys whose values differ; for hashes, the differing fields (before, after)."""
    out = []
    for key in sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k)):
        b, a = before.get(key), after.get(key)
        if isinstance(b, dict) and isinstance(a, dict):
            fields = {f: (b.get(f), a.get(f)) for f in b.keys() | a.keys() if b.get(f) != a.get(f)}
            out.append(f"{key}: {fields}")
        else:
            out.append(f"{key}: {str(b)[:160]} != {str(a)[:160]}")
    return out[:4]


def _replay(settings: Settings, session_id: str | None = None, **options: Any) -> Any:
    store = wiring.projection_store_for_rebuild(settings)  # the store the `replay` command uses
    try:
        return replay(
            settings.kafka_access(),
            settings.events_topic,
            store,
            TrustedKeys.none(),
            session_id=session_id,
            **options,
        )
    finally:
        store.client.close()


def test_a_session_restore_that_dies_leaves_the_session_refused_until_one_ends(
    settings: Settings, kafka_log: KafkaEventLog, projections: RedisProjectionStore
) -> None:
    # In a generation other than the first, as after a live rebuild: the mark goes where
    # readers look.
    for p in range(settings.partitions):
        assert projections.switch_generation(p, 0, 1) == 1
    assert projections.refresh_generations() == (1,) * settings.partitions
    sid = "half-built"
    events = [_event(sid, 1, ev.STARTED, {"goal": "restore me", "mode": "ask"})]
    events += [
        _event(sid, n, ev.TURN, {"role": "user", "content": f"turn {n}"}) for n in range(2, 9)
    ]
    for event in events:
        kafka_log.append(event)
    _replay(settings, session_id=sid)
    assert projections.load(sid) == fold(sid, events)

    def killed(read: int, total: int) -> None:  # dies once the first batch is committed
        raise RuntimeError("killed")

    with pytest.raises(RuntimeError, match="killed"):
        _replay(settings, session_id=sid, batch_size=2, processes=1, progress=killed)
    folded = projections.folded([sid])[sid]
    assert 0 < folded.state.seq < len(events)  # what a reader would have taken for the session
    with pytest.raises(SessionRestoringError, match="replay --session half-built"):
        projections.load(sid)
    assert projections.facts(sid).seq == folded.state.seq  # what a replay reads refuses nothing
    result = CliRunner().invoke(main, ["show", sid], env=settings.to_env())
    assert result.exit_code == 1 and "is half rebuilt" in result.output, result.output
    result = CliRunner().invoke(main, ["--json", "list"], env=settings.to_env())
    assert [r["status"] for r in json.loads(result.output) if r["id"] == sid] == ["restoring"]

    _replay(settings, session_id=sid)  # run again, to its end
    assert projections.load(sid) == fold(sid, events)


def test_list_shows_a_damaged_session_as_unreadable_and_the_others_as_they_are(
    settings: Settings, kafka_log: KafkaEventLog, projections: RedisProjectionStore
) -> None:
    """Before, one session whose stored state does not decode failed the whole `list`."""
    for sid in ("list-fine", "list-damaged"):
        kafka_log.append(_event(sid, 1, ev.STARTED, {"goal": "g", "mode": "ask"}))
    _replay(settings)
    damage_state(projections, "list-damaged")
    result = CliRunner().invoke(main, ["--json", "list"], env=settings.to_env())
    assert result.exit_code == 0, result.output
    status = {r["id"]: r["status"] for r in json.loads(result.stdout)}
    assert status == {"list-fine": "runnable", "list-damaged": "unreadable"}
    assert "warning: list-damaged: the stored state has layout 9" in result.stderr
    assert "replay --session ID --force" in result.stderr


def test_redis_flushed_then_replay_gives_identical_projections(
    settings: Settings,
    kafka_log: KafkaEventLog,
    projections: RedisProjectionStore,
    start_worker: Any,
) -> None:
    worker = start_worker()
    sids, events = generate(300, prefix="r")
    last = send_all(kafka_log, events)
    expected = expected_projections(events, TrustedKeys.none())
    wait_for_all(projections, last, timeout=60, why="the worker", workers=(worker,))
    assert records_in(settings, settings.events_topic) == len(events)
    worker.stop()
    assert not worker.alive()
    incremental = dump(projections)
    sessions = {sid: projections.load(sid) for sid in sids}
    assert all(s is not None and s.started for s in sessions.values())

    decisions_published = records_in(settings, settings.decisions_topic)
    assert decisions_published == sum(len(e.state.decisions) for e in expected.values())

    projections.clear()
    assert projections.ids() == [] and dump(projections) == {}
    report = _replay(settings)
    assert records_in(settings, settings.decisions_topic) == decisions_published, (
        "a rebuild published decisions"
    )
    assert (report.records, report.applied_sessions, report.refused_total) == (
        len(events),
        len(sids),
        0,
    )
    assert sorted(projections.ids()) == sids
    differing = _differences(incremental, dump(projections))
    assert not differing, f"{len(differing)} keys differ after the rebuild: {differing}"

    # One session only: drop it and rebuild it alone from its partition.
    one = "r00016"  # two pauses, a decision and a question still open (a deadline indexed)
    assert expected[one].state.question is not None and len(expected[one].state.decisions) == 1
    projections.drop(one)
    assert projections.load(one) is None
    report = _replay(settings, session_id=one)
    assert report.applied_sessions == 1
    assert projections.folded([one])[one].mark == last[one]
    assert projections.load(one) == sessions[one]
    # Held at offset 0 in its partition's unsnapshotted index until a snapshot of it is taken
    # (its partition's checkpoint cannot pass it meanwhile); everything else as before.
    index = projections.keys.unsnapshotted(partition_for(one, settings.partitions))
    assert projections.client.zscore(index, one) == 0
    held = dict(incremental)
    held[index] = sorted(  # (member, score) by score, then member: as ZRANGE gives them
        [(m, 0.0 if m == one.encode() else score) for m, score in incremental[index]],
        key=lambda m: (m[1], m[0]),
    )
    differing = _differences(held, dump(projections))
    assert not differing, f"rebuilding {one} alone left keys different: {differing}"

    # And every rebuilt projection is the fold of the log.
    assert_equals_the_fold(projections, expected)
