"""A de-duplicating Kafka subscription: what the decisions and questions subscribers share."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Iterator
from typing import Generic, TypeVar

from kafka import KafkaConsumer, TopicPartition
from kafka.errors import KafkaError
from kafka.structs import OffsetAndMetadata

from producers.kafka_access import KafkaAccess
from schemas.codec import EventCodec
from schemas.errors import CodecError, LogError

T = TypeVar("T")


class Subscription(ABC, Generic[T]):
    """Iterate a topic's records with your own consumer group; repeats are dropped for you.

    Records are published at least once. `order(record)` gives a record's session and its
    position in that session's stream; a record not beyond the last one yielded for its session
    is a repeat. Undecodable records are counted (`undecodable`) and skipped. `commit()`
    commits what was handed out: all of a `poll()`, or, iterating, up to the item last yielded
    (a poll's later records are read again after a restart, never lost).
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
        self._handed: dict[TopicPartition, int] = {}  # the next offset to commit, per partition
        self._pending: deque[tuple[T | None, TopicPartition, int]] = deque()
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
        """One poll: new records in log order (possibly none), all handed out at once; what an
        iteration left of its poll comes first, without polling."""
        return list(self._hand_out())

    def _hand_out(self) -> Iterator[T]:
        """The pending items (a new poll's if none are), each marked handed out as it goes.

        They wait on the subscription until handed out: an iteration the caller ends (a break,
        an error) leaves the rest to the next iteration or poll, never skipped as repeats.
        """
        pending = self._pending
        if not pending:
            pending.extend(self._read())
        while pending:
            item, tp, following = pending.popleft()
            self._handed[tp] = following  # handed out (or skipped) once the caller has it
            if item is not None:
                yield item

    def _read(self) -> list[tuple[T | None, TopicPartition, int]]:
        """One poll's records: (the item, or None for a repeat or an undecodable one; its
        partition; the offset after it)."""
        try:
            batches = self._consumer.poll(timeout_ms=self.poll_timeout_ms)
        except KafkaError as e:
            raise LogError(f"polling {self.topic} failed: {e}") from e
        out: list[tuple[T | None, TopicPartition, int]] = []
        for tp, records in batches.items():
            for record in records:
                out.append((self._new(record.value), tp, record.offset + 1))
        return out

    def _new(self, raw: bytes) -> T | None:
        try:
            item = self.decode(raw)
        except (CodecError, KeyError, TypeError, ValueError):
            self.undecodable += 1
            return None
        session, position = self.order(item)
        last = self._last.get(session)
        if last is not None and position <= last:
            return None
        self._last[session] = position
        return item

    @abstractmethod
    def decode(self, raw: bytes) -> T:
        """One record's value, read."""

    @abstractmethod
    def order(self, item: T) -> tuple[str, tuple[int, ...]]:
        """The record's session and its position in that session's stream."""

    def commit(self) -> None:
        """Commit what has been handed out (call after handling it)."""
        owned = self._consumer.assignment()
        offsets = {
            tp: OffsetAndMetadata(offset, "", -1)
            for tp, offset in self._handed.items()
            if tp in owned  # (a partition another member took since: its own to commit)
        }
        if offsets:
            try:
                self._consumer.commit(offsets)
            except KafkaError as e:
                raise LogError(f"committing {self.topic} offsets failed: {e}") from e
        self._handed.clear()

    def __iter__(self) -> Iterator[T]:
        while True:
            yield from self._hand_out()

    def close(self) -> None:
        """Leave the group."""
        self._consumer.close()
