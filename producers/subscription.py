"""A de-duplicating Kafka subscription: what the decisions and questions subscribers share.

Why a look-back: a repeat is recognised by the last position handed out for its session, which a
process knows only for what it read itself. A subscriber restarted, or given a partition another
member read (a rebalance), would hand out again a copy published after the position its group
committed of an original before it. So before it hands out the first record of a partition it
was given, it reads the records published within `lookback_s` before that record (from the
committed position back) and learns their sessions' positions, handing none of them out. The
guarantee: a copy published within `lookback_s` of its original is dropped, across restarts and
rebalances; one published later (a worker that was down longer than that) may be handed out
again. A worker republishes what it may not have had acknowledged when it starts on a
partition, so `lookback_s` is to be longer than a worker may stay down.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Iterable, Iterator, Mapping
from typing import Any, Final, Generic, TypeVar

from kafka import ConsumerRebalanceListener, KafkaConsumer, TopicPartition
from kafka.errors import KafkaError
from kafka.structs import OffsetAndMetadata

from producers.kafka_access import KafkaAccess
from schemas.codec import EventCodec
from schemas.errors import CodecError, LogError

T = TypeVar("T")

LOOKBACK_S: Final = 900.0  # how long before a partition's first record handed out to read back
LOOKBACK_TIMEOUT_S: Final = 60.0  # how long reading back may take before the poll fails


class _Forget(ConsumerRebalanceListener):  # type: ignore[misc]
    """Forgets that a revoked partition was read back: if it comes back, another member may
    have handed out its records meanwhile."""

    def __init__(self, primed: set[TopicPartition]) -> None:
        self._primed = primed

    def on_partitions_revoked(self, revoked: Iterable[TopicPartition]) -> None:
        self._primed.difference_update(revoked)

    def on_partitions_assigned(self, assigned: Iterable[TopicPartition]) -> None:
        pass


class Subscription(ABC, Generic[T]):
    """Iterate a topic's records with your own consumer group; repeats are dropped for you.

    Records are published at least once. `order(record)` gives a record's session and its
    position in that session's stream; a record not beyond the last one yielded for its session
    is a repeat. Before the first record of each partition it is given, the subscription reads
    back `lookback_s` seconds of that partition (see the module's docstring), so copies of what
    this group handed out before a restart or a rebalance are repeats too. Undecodable records
    are counted (`undecodable`) and skipped. `commit()` commits what was handed out: all of a
    `poll()`, or, iterating, up to the item last yielded (a poll's later records are read again
    after a restart, never lost).
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
        lookback_s: float = LOOKBACK_S,
    ) -> None:
        self.codec = codec or EventCodec()
        self.topic = topic
        self.poll_timeout_ms = poll_timeout_ms
        self.lookback_s = lookback_s
        self.undecodable = 0
        self.read_back = 0  # records read back (never handed out) before partitions' first
        self._access = KafkaAccess.of(bootstrap)
        self._last: dict[str, tuple[int, ...]] = {}
        self._handed: dict[TopicPartition, int] = {}  # the next offset to commit, per partition
        self._pending: deque[tuple[T | None, TopicPartition, int]] = deque()
        self._primed: set[TopicPartition] = set()  # read back since they were given to us
        try:
            self._consumer = KafkaConsumer(
                **self._access.kafka_python(),
                group_id=group_id,
                auto_offset_reset="earliest" if from_beginning else "latest",
                enable_auto_commit=False,
            )
            self._consumer.subscribe([topic], listener=_Forget(self._primed))
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
        firsts = {tp: rs[0] for tp, rs in batches.items() if rs and tp not in self._primed}
        if firsts:
            try:
                self._read_back(firsts)
            except LogError:
                # Nothing of this poll was handed out: the next poll reads it again.
                for tp, records in batches.items():
                    if records:
                        self._consumer.seek(tp, records[0].offset)
                raise
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
        return item if self._beyond(item) else None

    def _beyond(self, item: T) -> bool:
        """Whether the item is beyond the last one seen of its session (it is then the last)."""
        session, position = self.order(item)
        last = self._last.get(session)
        if last is not None and position <= last:
            return False
        self._last[session] = position
        return True

    def _read_back(self, firsts: Mapping[TopicPartition, Any]) -> None:
        """Learn the sessions' positions in the `lookback_s` seconds of each partition before its
        first record polled (`firsts`), with a consumer of no group; hand none of them out."""
        if self.lookback_s <= 0:
            self._primed.update(firsts)
            return
        ends = {tp: record.offset for tp, record in firsts.items()}
        since = {
            tp: max(
                0,
                (record.timestamp if record.timestamp >= 0 else int(time.time() * 1000))
                - int(self.lookback_s * 1000),
            )
            for tp, record in firsts.items()
        }
        try:
            reader = KafkaConsumer(
                **self._access.kafka_python(), group_id=None, enable_auto_commit=False
            )
        except KafkaError as e:
            raise LogError(f"cannot read {self.topic} back: {e}") from e
        try:
            self._read_range(reader, since, ends)
        except KafkaError as e:
            raise LogError(f"reading {self.topic} back failed: {e}") from e
        finally:
            reader.close()
        self._primed.update(firsts)

    def _read_range(
        self,
        reader: KafkaConsumer,
        since: Mapping[TopicPartition, int],
        ends: Mapping[TopicPartition, int],
    ) -> None:
        """Read each partition from its first record at or after `since` (ms) up to `ends`."""
        reader.assign(list(ends))
        found = reader.offsets_for_times(dict(since))
        todo: dict[TopicPartition, int] = {}
        for tp, end in ends.items():
            at = found.get(tp)
            start = end if at is None else min(at.offset, end)
            if start < end:
                reader.seek(tp, start)
                todo[tp] = end
        reader.pause(*(tp for tp in ends if tp not in todo))
        deadline = time.monotonic() + LOOKBACK_TIMEOUT_S
        while todo:
            if time.monotonic() > deadline:
                raise LogError(
                    f"reading {self.topic} back ({len(todo)} partitions) took over "
                    f"{LOOKBACK_TIMEOUT_S:g} s"
                )
            for tp, records in reader.poll(timeout_ms=self.poll_timeout_ms).items():
                until = todo.get(tp)
                for record in records:
                    if until is None or record.offset >= until:
                        break
                    self.read_back += 1
                    try:
                        item = self.decode(record.value)
                    except (CodecError, KeyError, TypeError, ValueError):
                        continue
                    self._beyond(item)
            for tp, end in list(todo.items()):
                if reader.position(tp) >= end:
                    del todo[tp]
                    reader.pause(tp)

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
