"""Following the questions feed live (the console's Server-Sent Events read it).

A plain consumer without a group: it reads every partition of the topic from its end, so each
console process sees every change from when it started, and nothing is committed. The feed is at
least once: the reader drops repeats by `QuestionChange.order` (the console's `Hub` does).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator

from aiokafka import AIOKafkaConsumer
from aiokafka.errors import KafkaError

from producers.kafka_access import KafkaAccess
from producers.questions import change_from_record
from schemas.codec import EventCodec
from schemas.errors import CodecError, LogError
from session_model.questions import QuestionChange

log = logging.getLogger(__name__)


async def follow_questions(
    bootstrap: str | KafkaAccess, topic: str, *, codec: EventCodec | None = None
) -> AsyncIterator[QuestionChange]:
    """Every question change published from now on, in log order per session (repeats included)."""
    access = KafkaAccess.of(bootstrap)
    codec = codec or EventCodec()
    consumer = AIOKafkaConsumer(
        **access.aiokafka(),
        group_id=None,  # without a group a subscription is every partition, from its end
        enable_auto_commit=False,
        auto_offset_reset="latest",
        fetch_max_wait_ms=10,  # a change reaches a browser in milliseconds, not half a second
    )
    try:
        try:
            await consumer.start()
            if topic not in await consumer.topics():  # before subscribing: never create it
                raise LogError(f"the questions topic {topic!r} does not exist")
            consumer.subscribe([topic])
        except KafkaError as e:
            raise LogError(f"cannot follow {topic} at {access.bootstrap}: {e}") from e
        while True:
            try:
                batches = await consumer.getmany(timeout_ms=1000)
            except KafkaError as e:
                raise LogError(f"following {topic} failed: {e}") from e
            for records in batches.values():
                for record in records:
                    try:
                        change = change_from_record(codec.decode_question_change(record.value))
                    except (CodecError, KeyError, TypeError, ValueError) as e:
                        log.warning("skipping an unreadable question change: %s", e)
                        continue
                    yield change
    finally:
        await consumer.stop()
