"""A de-duplicating Kafka subscription: what the decisions and questions subscribers share.

Why a look-back: a repeat is recognised by the last position handed out for its session, which a
process knows only for what it handed out itself. A subscriber restarted, or given a partition
another member read (a rebalance), would hand out again a copy published after the position its
group committed of an original before it. So when a poll brings a partition's records from past
what this process last read of it (or it never read it), it first reads the records before them
that it did not see, back to `lookback_s` seconds before the first of them, and learns their
sessions' positions, handing none of them out. A partition that comes back to the process where
it left it, or earlier, is not read back: everything before was seen here.

The guarantee: a copy published within `lookback_s` of its original, after the group committed
the original, is dropped, across restarts and rebalances; one published later (a worker that was
down longer than that) may be handed out again. A worker republishes what it may not have had
acknowledged when it starts on a partition, so `lookback_s` is to be longer than a worker may
stay down. What a member handed out but did not commit is handed out again by the next owner, as
with any at-least-once subscription.
"""

from __future__ import annotations

import contextlib
import logging
import time
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Iterator, Mapping
from typing import Any, Final, Generic, TypeVar

from kafka import KafkaConsumer, TopicPartition
from kafka.errors import KafkaError
from kafka.structs import OffsetAndMetadata

from producers.kafka_access import KafkaAccess
from schemas.codec import EventCodec
from schemas.errors import CodecError, LogError

log = logging.getLogger(__name__)

T = TypeVar("T")

LOOKBACK_S: Final = 900.0  # how far before a partition's first unseen record to read back
LOOKBACK_TIMEOUT_S: Final = 60.0  # how long reading back may take before the poll fails
# How old the partition metadata may get. kafka-python loses a metadata update asked for while
# another is in flight (a subscribe during its bootstrap): without the topic's partitions, the
# group's leader assigns nothing, until the next refresh. Its default is 5 minutes.
METADATA_MAX_AGE_MS: Final = 5_000


class Subscription(ABC, Generic[T]):
    """Iterate a topic's records with your own consumer group; repeats are dropped for you.

    Records are published at least once. `order(record)` gives a record's session and its
    position in that session's stream; a record not beyond the last one handed out for its
    session is a repeat. Before a partition's records from past what this process read of it,
    the subscription reads back up to `lookback_s` seconds of what it did not see (see the
    module's docstring), so copies of what this group handed out before a restart or a
    rebalance are repeats too. Undecodable records are counted (`undecodable`) and skipped.
    `commit()` commits what was handed out: all of a `poll()`, or, iterating, up to the item
    last yielded (a poll's later records are read again after a restart, never lost).
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
        lookback_timeout_s: float = LOOKBACK_TIMEOUT_S,
    ) -> None:
        self.codec = codec or EventCodec()
        self.topic = topic
        self.poll_timeout_ms = poll_timeout_ms
        self.lookback_s = lookback_s
        self.lookback_timeout_s = lookback_timeout_s
        self.undecodable = 0
        self.read_back = 0  # records read back (never handed out)
        self._access = KafkaAccess.of(bootstrap)
        self._last: dict[str, tuple[int, ...]] = {}  # per session, the last position handed out
        self._handed: dict[TopicPartition, int] = {}  # the next offset to commit, per partition
        self._pending: deque[tuple[T | None, TopicPartition, int]] = deque()
        self._seen: dict[TopicPartition, int] = {}  # the offset after the last record read here
        try:
            self._consumer = KafkaConsumer(
                **self._access.kafka_python(),
                group_id=group_id,
                auto_offset_reset="earliest" if from_beginning else "latest",
                enable_auto_commit=False,
                metadata_max_age_ms=METADATA_MAX_AGE_MS,
            )
        except KafkaError as e:
            raise LogError(f"cannot subscribe to {topic}: {e}") from e
        try:
            self._consumer.subscribe([topic])
            # Know the partitions before the first join (see METADATA_MAX_AGE_MS).
            self._consumer.partitions_for_topic(topic)
        except BaseException as e:
            with contextlib.suppress(Exception):  # (its thread and connections; e is what counts)
                self._consumer.close()
            if isinstance(e, KafkaError):
                raise LogError(f"cannot subscribe to {topic}: {e}") from e
            raise

    def poll(self) -> list[T]:
        """One poll: new records in log order (possibly none), all handed out at once; what an
        iteration left of its poll comes first, without polling."""
        return list(self._hand_out())

    def _hand_out(self) -> Iterator[T]:
        """The pending items (a new poll's if none are), each marked handed out as it goes.

        They wait on the subscription until handed out: an iteration the caller ends (a break,
        an error) leaves the rest to the next iteration or poll, never skipped as repeats. A
        repeat is told when an item would be handed out, so `_last` holds only what was.
        """
        pending = self._pending
        if not pending:
            pending.extend(self._read())
        while pending:
            item, tp, following = pending.popleft()
            self._handed[tp] = following  # handed out (or skipped) once the caller has it
            if item is not None and self._beyond(item):
                yield item

    def _read(self) -> list[tuple[T | None, TopicPartition, int]]:
        """One poll's records: (the item, or None for an undecodable one; its partition; the
        offset after it)."""
        try:
            batches = self._consumer.poll(timeout_ms=self.poll_timeout_ms)
        except KafkaError as e:
            raise LogError(f"polling {self.topic} failed: {e}") from e
        unseen = {  # (nothing precedes a partition's offset 0)
            tp: records[0]
            for tp, records in batches.items()
            if records and self._seen.get(tp, 0) < records[0].offset
        }
        if unseen:
            try:
                self._read_back(unseen)
            except LogError:
                # Nothing of this poll was handed out: the next poll reads it again.
                for tp, records in batches.items():
                    if records:
                        self._consumer.seek(tp, records[0].offset)
                raise
        out: list[tuple[T | None, TopicPartition, int]] = []
        for tp, records in batches.items():
            for record in records:
                out.append((self._decoded(record.value), tp, record.offset + 1))
            if records:
                self._seen[tp] = max(self._seen.get(tp, 0), records[-1].offset + 1)
        return out

    def _decoded(self, raw: bytes) -> T | None:
        try:
            return self.decode(raw)
        except (CodecError, KeyError, TypeError, ValueError):
            self.undecodable += 1
            return None

    def _beyond(self, item: T) -> bool:
        """Whether the item is beyond the last one of its session (it is then the last)."""
        session, position = self.order(item)
        last = self._last.get(session)
        if last is not None and position <= last:
            return False
        self._last[session] = position
        return True

    def _read_back(self, firsts: Mapping[TopicPartition, Any]) -> None:
        """Learn the sessions' positions from what precedes each partition's first record polled
        (`firsts`) and was not read here: from the later of `lookback_s` before it and what was
        read here, with a consumer of no group; hand none of it out."""
        if self.lookback_s <= 0:
            return
        since: dict[TopicPartition, int] = {}
        for tp, record in firsts.items():
            if record.timestamp < 0:
                log.warning(
                    "%s[%d] has records without a timestamp: it is not read back, and copies "
                    "of what the group handed out before may be handed out again",
                    tp.topic,
                    tp.partition,
                )
                continue
            since[tp] = max(0, record.timestamp - int(self.lookback_s * 1000))
        if not since:
            return
        ends = {tp: firsts[tp].offset for tp in since}
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

    def _read_range(
        self,
        reader: KafkaConsumer,
        since: Mapping[TopicPartition, int],
        ends: Mapping[TopicPartition, int],
    ) -> None:
        """Read each partition from its first record at or after `since` (ms), or after what was
        read here if that is later, up to `ends`."""
        timeout_ms = int(self.lookback_timeout_s * 1000)
        reader.assign(list(ends))
        found = reader.offsets_for_times(dict(since), timeout_ms=timeout_ms)
        todo: dict[TopicPartition, int] = {}
        for tp, end in ends.items():
            at = found.get(tp)
            start = end if at is None else max(min(at.offset, end), self._seen.get(tp, 0))
            if start < end:
                reader.seek(tp, start)
                todo[tp] = end
        reader.pause(*(tp for tp in ends if tp not in todo))
        deadline = time.monotonic() + self.lookback_timeout_s
        while todo:
            left_ms = int((deadline - time.monotonic()) * 1000)
            if left_ms <= 0:
                raise LogError(
                    f"reading {self.topic} back ({len(todo)} partitions) took over "
                    f"{self.lookback_timeout_s:g} s"
                )
            for tp, records in reader.poll(timeout_ms=min(self.poll_timeout_ms, left_ms)).items():
                until = todo.get(tp)
                for record in records:
                    if until is None or record.offset >= until:
                        break
                    self.read_back += 1
                    item = self._decoded(record.value)
                    if item is not None:
                        self._beyond(item)
            for tp, end in list(todo.items()):
                if reader.position(tp, timeout_ms=left_ms) >= end:
                    del todo[tp]
                    reader.pause(tp)

    @abstractmethod
    def decode(self, raw: bytes) -> T:
        """One record's value, read."""

    @abstractmethod
    def order(self, item: T) -> tuple[str, tuple[int, ...]]:
        """The record's session and its position in that session's stream."""

    def commit(self) -> None:
        """Commit what has been handed out (call after handling it).

        A commit the group refuses (this member lost its partitions) drops what this member has
        not handed out yet: their new owner hands them out.
        """
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
                self._handed.clear()
                self._pending.clear()
                raise LogError(f"committing {self.topic} offsets failed: {e}") from e
        self._handed.clear()

    def __iter__(self) -> Iterator[T]:
        while True:
            yield from self._hand_out()

    def close(self) -> None:
        """Leave the group."""
        self._consumer.close()
