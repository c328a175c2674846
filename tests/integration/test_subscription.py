"""A decisions subscriber restarted in its group drops the copies a worker republished of what the
group handed out before the restart (it reads the partitions back first): real Kafka."""

from __future__ import annotations

from datetime import UTC, datetime

from kafka import KafkaProducer

from deploy.harness import wait_for
from milpa_sessions.settings import Settings
from producers.decisions import DecisionSubscriber, PublishedDecision
from schemas.codec import EventCodec

CODEC = EventCodec()


def publish(producer: KafkaProducer, topic: str, session_id: str, seq: int) -> None:
    """One decision of `session_id` at `seq`, keyed as the workers key them."""
    record = {
        "session_id": session_id,
        "question_id": f"q{seq}",
        "question": "go on?",
        "reason": "permission",
        "why": None,
        "answer": "yes",
        "by": None,
        "executor": None,
        "decided_at": datetime(2026, 3, 1, tzinfo=UTC),
        "expired_at": None,
        "seq": seq,
        "event_id": f"{session_id}-{seq}",
    }
    producer.send(topic, key=session_id.encode(), value=CODEC.encode_decision(record))


def received(subscriber: DecisionSubscriber, count: int) -> list[tuple[str, int]]:
    """What the subscriber hands out until it has `count`, and two polls more."""
    got: list[PublishedDecision] = []
    wait_for(lambda: got.extend(subscriber.poll()) or len(got) >= count, timeout=60)
    for _ in range(2):
        got.extend(subscriber.poll())
    return [(d.session_id, d.seq) for d in got]


def test_a_restarted_subscriber_drops_the_copies_of_what_its_group_handed_out(
    settings: Settings, raw_producer: KafkaProducer
) -> None:
    topic, group = settings.decisions_topic, f"{settings.consumer_group}-sub"
    for session_id, seq in [("s-1", 1), ("s-1", 2), ("s-2", 1)]:
        publish(raw_producer, topic, session_id, seq)
    raw_producer.flush()

    first = DecisionSubscriber(settings.kafka_access(), topic, group, poll_timeout_ms=200)
    assert sorted(received(first, 3)) == [("s-1", 1), ("s-1", 2), ("s-2", 1)]
    first.commit()
    first.close()

    # A worker that had not had these acknowledged publishes them again, then a new one.
    for session_id, seq in [("s-1", 2), ("s-2", 1), ("s-1", 3)]:
        publish(raw_producer, topic, session_id, seq)
    raw_producer.flush()

    second = DecisionSubscriber(settings.kafka_access(), topic, group, poll_timeout_ms=200)
    try:
        assert received(second, 1) == [("s-1", 3)]
        assert second.read_back == 3  # the three originals, before the committed position
    finally:
        second.close()

    # The same restart without reading back (the second committed nothing): the copies come again.
    third = DecisionSubscriber(
        settings.kafka_access(), topic, group, poll_timeout_ms=200, lookback_s=0
    )
    try:
        assert sorted(received(third, 3)) == [("s-1", 2), ("s-1", 3), ("s-2", 1)]
    finally:
        third.close()
