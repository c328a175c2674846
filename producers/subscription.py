"""A de-duplicating Kafka subscription: what the decisions and questions subscribers share."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator
from typing import Generic, TypeVar

from kafka import KafkaConsumer
from kafka.errors import KafkaError

from producers.kafka_access import KafkaAccess
from schemas.codec import EventCodec
from schemas.errors import CodecError, LogError

T = TypeVar("T")


class Subscription(ABC, Generic[T]):
    """Iterate a topic's records with your own consumer group; repeats are dropped for you.

    Records are published at least once. `order(record)` gives a record's session and its
    position in that session's stream; a record not beyond the last one yielded for its session
    is a repeat. Undecodable records are counted (`undecodable`) and skipped.
    """

    def __init__(
        self,
        bootstrap: str | KafkaAccess,
        topic: str,
        group_id: str,
        *,
        codec: EventCodec | None = None,
        from_beginning: bool = True,
        poll_timeout_ms: int = 500,
    ) -> None:
        self.codec = codec or EventCodec()
        self.topic = topic
        self.poll_timeout_ms = poll_timeout_ms
        self.undecodable = 0
        self._last: dict[str, tuple[int, ...]] = {}
        try:
            self._consumer = KafkaConsumer(
                topic,
                **KafkaAccess.of(bootstrap).kafka_python(),
                group_id=group_id,
                auto_offset_reset="earliest" if from_beginning else "latest",
                enable_auto_commit=False,
            )
        except KafkaError as e:
            raise LogError(f"cannot subscribe to {topic}: {e}") from e

    def poll(self) -> list[T]:
        """One poll: new records in log order (possibly none)."""
        try:
            batches = self._consumer.poll(timeout_ms=self.poll_timeout_ms)
        except KafkaError as e:
            raise LogError(f"polling {self.topic} failed: {e}") from e
        out: list[T] = []
        for records in batches.values():
            for record in records:
                try:
                    item = self.decode(record.value)
                except (CodecError, KeyError, TypeError, ValueError):
                    self.undecodable += 1
                    continue
                session, position = self.order(item)
                last = self._last.get(session)
                if last is not None and position <= last:
                    continue
                self._last[session] = position
                out.append(item)
        return out

    @abstractmethod
    def decode(self, raw: bytes) -> T:
        """One record's value, read."""

    @abstractmethod
    def order(self, item: T) -> tuple[str, tuple[int, ...]]:
        """The record's session and its position in that session's stream."""

    def commit(self) -> None:
        """Commit what has been polled (call after handling it)."""
        try:
            self._consumer.commit()
        except KafkaError as e:
            raise LogError(f"committing {self.topic} offsets failed: {e}") from e

    def __iter__(self) -> Iterator[T]:
        while True:
            yield from self.poll()

    def close(self) -> None:
        """Leave the group."""
        self._consumer.close()
