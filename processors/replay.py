"""Rebuilding projections from the topic: the same fold, the same store, from offset zero.

Run it with the workers stopped (or against a fresh key prefix): a worker committing while a
session is being rebuilt could fold its newest events onto an empty state. The rebuild reads every
partition up to the end offsets it found when it started, in batches, and publishes no decisions.

How it is made fast (issue #5: ≥ 25k events/s on the two-core bench machine):

- The records are fetched by aiokafka on a thread of its own (`_Fetcher`), a few batches ahead:
  its record parsing is compiled (≈ 1.2 µs of CPU per record; kafka-python's pure-Python parsing
  took ≈ 7) and its waiting on the broker overlaps the folding.
- The collector is tuned for the duration of the rebuild (`_bulk_collector`): the rebuild keeps
  every session's state, so CPython's default thresholds ran a full collection over an ever larger
  cache every few batches — 40 % of the rebuild's CPU. Nothing the rebuild makes is cyclic.
- The rebuild keeps the states it committed (`Projector(cache=True)`), bounded.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import gc
import queue
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Final

from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.errors import KafkaError
from kafka.partitioner.default import murmur2

from processors.redis_store import RedisProjectionStore
from producers.projector import Projector
from schemas.codec import EventCodec
from schemas.errors import CodecError, LogError
from session_model.projection import BatchFolder, Position, Record
from session_model.signing import TrustedKeys

Progress = Callable[[int, int], None]

# Sessions whose state the rebuild keeps between batches; beyond it the older half is dropped
# (a dropped session that shows up again is read back from Redis).
CACHE_LIMIT: Final = 200_000
# Batches fetched ahead of the fold.
_AHEAD: Final = 4
_ASSIGNMENT_TIMEOUT_S: Final = 30.0

RawRecord = tuple[int, int, bytes | None, bytes | None]
"""partition, offset, key, value."""


@dataclass(frozen=True, slots=True)
class ReplayReport:
    """What a rebuild read and applied."""

    records: int
    applied_sessions: int
    undecodable: int


def partition_for(session_id: str, partitions: int) -> int:
    """The partition the default (murmur2) partitioner gives a session id's key."""
    return int(murmur2(session_id.encode()) & 0x7FFFFFFF) % partitions


def replay(
    bootstrap: str,
    topic: str,
    store: RedisProjectionStore,
    keys: TrustedKeys,
    *,
    session_id: str | None = None,
    batch_size: int = 2000,
    progress: Progress | None = None,
    codec: EventCodec | None = None,
) -> ReplayReport:
    """Drop and rebuild every projection (or one session's) from the topic."""
    codec = codec or EventCodec()
    if session_id is not None:
        # The session's pauses and outcomes are already in the global counters: rebuilding its
        # projection must not count them a second time.
        store = dataclasses.replace(store, count_stats=False)
    # The rebuild owns the sessions it writes: keep their states instead of re-reading them.
    projector = Projector(store, BatchFolder(keys), cache=True, cache_limit=CACHE_LIMIT)
    wanted = None if session_id is None else session_id.encode()
    with _bulk_collector(), _Fetcher(bootstrap, topic, session_id, batch_size) as fetcher:
        if session_id is None:
            store.clear()
        else:
            store.drop(session_id)
        read = undecodable = 0
        applied: set[str] = set()
        decode = codec.decode
        for batch in fetcher.batches():
            records: list[Record] = []
            for partition, offset, key, value in batch:
                read += 1
                if wanted is not None and key != wanted:
                    continue
                try:
                    event = decode(value)  # type: ignore[arg-type] # None is refused as corrupt
                except CodecError:
                    undecodable += 1  # the live worker dead-lettered it already
                    continue
                records.append(Record(event, Position(partition, offset)))
            if records:
                applied.update([u.session_id for u in projector.project(records)])
            if progress is not None:
                progress(read, fetcher.total)
        return ReplayReport(read, len(applied), undecodable)


@contextlib.contextmanager
def _bulk_collector() -> Iterator[None]:
    """The collector's thresholds of the worker (`milpa-sessions worker`) while rebuilding.

    A young-generation collection every 100,000 net allocations instead of 700, and no full
    collection in practice: everything the rebuild allocates is freed by reference counting, and
    what it keeps (the states) is only ever traversed for nothing. Restored afterwards.
    """
    previous = gc.get_threshold()
    gc.set_threshold(100_000, 50, 1000)
    try:
        yield
    finally:
        gc.set_threshold(*previous)


class _Fetcher:
    """Reads the topic up to the end offsets it finds at start, on a thread with its own loop.

    The batches travel to the caller through a bounded queue, so the fetcher runs at most
    `_AHEAD` batches ahead. Kafka failures come out of `__enter__` or `batches()` as `LogError`.
    """

    def __init__(self, bootstrap: str, topic: str, session_id: str | None, batch_size: int):
        self.bootstrap = bootstrap
        self.topic = topic
        self.session_id = session_id
        self.batch_size = batch_size
        self.total = 0  # sum of the end offsets: what the progress callback is told
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=_AHEAD)
        self._ready: queue.Queue[BaseException | None] = queue.Queue(maxsize=1)
        self._stop = threading.Event()
        self._started = False  # set once `_ready` was told: later failures go through `_queue`
        self._thread = threading.Thread(target=self._run, name="replay-fetcher", daemon=True)

    def __enter__(self) -> _Fetcher:
        self._thread.start()
        failed = self._ready.get()
        if failed is not None:
            self._thread.join()
            raise failed
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        with contextlib.suppress(queue.Empty):
            while True:  # unblock a `put` waiting for room
                self._queue.get_nowait()
        self._thread.join(timeout=30)

    def batches(self) -> Iterator[list[RawRecord]]:
        """Every batch, in the order fetched (each partition's records in log order)."""
        while True:
            item = self._queue.get()
            if item is None:
                return
            if isinstance(item, BaseException):
                raise item
            yield item

    def _run(self) -> None:
        try:
            asyncio.run(self._fetch())
        except BaseException as e:  # handed over to the caller's thread
            if self._started:
                self._put(e)
            else:
                self._ready.put(e)

    def _put(self, item: object) -> bool:
        """Queue an item, giving up when the caller has stopped listening."""
        while not self._stop.is_set():
            with contextlib.suppress(queue.Full):
                self._queue.put(item, timeout=0.1)
                return True
        return False

    async def _fetch(self) -> None:
        consumer = AIOKafkaConsumer(
            bootstrap_servers=self.bootstrap.split(","),
            group_id=None,
            enable_auto_commit=False,
            auto_offset_reset="earliest",
            fetch_max_bytes=64 * 1024 * 1024,
            max_partition_fetch_bytes=8 * 1024 * 1024,
        )
        try:
            try:
                await consumer.start()
            except KafkaError as e:
                raise LogError(f"cannot reach Kafka at {self.bootstrap}: {e}") from e
            try:
                ends = await self._assign(consumer)
            except KafkaError as e:
                raise LogError(f"reading {self.topic} failed: {e}") from e
            self.total = sum(ends.values())
            self._started = True
            self._ready.put(None)
            try:
                await self._read(consumer, ends)
            except KafkaError as e:
                raise LogError(f"reading {self.topic} failed: {e}") from e
        finally:
            await consumer.stop()

    async def _assign(self, consumer: AIOKafkaConsumer) -> dict[TopicPartition, int]:
        """Assign the partitions to rebuild from their beginning; their end offsets, now."""
        if self.topic not in await consumer.topics():  # before subscribing: never create it
            raise LogError(f"topic {self.topic} does not exist")
        # The partitions, through a subscription without a group (public API only).
        consumer.subscribe([self.topic])
        loop = asyncio.get_running_loop()
        deadline = loop.time() + _ASSIGNMENT_TIMEOUT_S
        while not consumer.assignment():
            if loop.time() > deadline:
                raise LogError(f"no partitions of {self.topic} after {_ASSIGNMENT_TIMEOUT_S}s")
            await asyncio.sleep(0.01)
        partitions = sorted(tp.partition for tp in consumer.assignment())
        consumer.unsubscribe()
        if self.session_id is not None:
            partitions = [partition_for(self.session_id, len(partitions))]
        tps = [TopicPartition(self.topic, p) for p in partitions]
        consumer.assign(tps)
        await consumer.seek_to_beginning(*tps)
        ends = await consumer.end_offsets(tps)
        return {tp: end for tp, end in ends.items() if end > 0}

    async def _read(self, consumer: AIOKafkaConsumer, ends: dict[TopicPartition, int]) -> None:
        remaining = {tp: end for tp, end in ends.items() if await consumer.position(tp) < end}
        consumer.pause(*(tp for tp in consumer.assignment() if tp not in remaining))
        while remaining and not self._stop.is_set():
            fetched = await consumer.getmany(
                *remaining, timeout_ms=1000, max_records=self.batch_size
            )
            batch: list[RawRecord] = []
            for tp, messages in fetched.items():
                end = remaining.get(tp)
                if end is None:
                    continue
                batch.extend(
                    (tp.partition, m.offset, m.key, m.value) for m in messages if m.offset < end
                )
                if await consumer.position(tp) >= end:
                    del remaining[tp]
                    consumer.pause(tp)  # what was appended since the start is not rebuilt
            if batch and not self._put(batch):
                return
        self._put(None)
