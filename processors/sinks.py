"""Where the processors publish: topics written through aiokafka producers of their own.

Not through Faust's producer: Faust's `Topic.send` yields to the event loop between records, so
aiokafka's sender (linger 0) ships whatever is queued at that moment. A batch's ≈ 200 decisions
went out as ≈ 45 produce requests of ≈ 4.6 records (the broker spent ≈ 3–4 µs of CPU per consumed
event on them, with two workers on two cores); queued without a yield they go out as one request
per partition leader, ≈ 70 records each (docs/PERFORMANCE.md, "Two workers").
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import aiokafka
from aiokafka.errors import KafkaError

from processors.ports import OutRecord
from producers.kafka_access import KafkaAccess
from schemas.errors import LogError


class LazyProducer:
    """One aiokafka producer (acks=all, idempotent, murmur2 keys), started on first use.

    Started inside the running loop (aiokafka binds to it). `stop()` is final: a send after it
    raises `LogError` (a batch then stays unacknowledged and is redelivered, its decisions
    republished; the scheduler puts a failed tick's closings back on its schedule).
    """

    def __init__(self, bootstrap: str | KafkaAccess) -> None:
        self.access = KafkaAccess.of(bootstrap)
        self.bootstrap = self.access.bootstrap
        self._producer: aiokafka.AIOKafkaProducer | None = None
        self._starting: asyncio.Lock | None = None
        self._stopped = False

    async def started(self) -> aiokafka.AIOKafkaProducer:
        """The running producer (started now if needed)."""
        if self._producer is not None:
            return self._producer
        self._starting = self._starting or asyncio.Lock()
        async with self._starting:
            if self._stopped:
                raise LogError(f"the producer to {self.bootstrap} was stopped")
            if self._producer is None:
                producer = aiokafka.AIOKafkaProducer(
                    **self.access.aiokafka(),
                    acks="all",
                    enable_idempotence=True,
                    linger_ms=0,
                )
                await producer.start()
                self._producer = producer
        return self._producer

    async def stop(self) -> None:
        """Flush what is queued and close the connection, for good."""
        self._starting = self._starting or asyncio.Lock()
        async with self._starting:  # not while it is being started
            self._stopped = True
            producer, self._producer = self._producer, None
        if producer is not None:
            await producer.stop()


class ProducerSink:
    """Publishes raw bytes to one topic through a `LazyProducer`.

    Keys are partitioned by murmur2 like every other writer's, so a record keyed by a session id
    lands in that session's partition. Sinks that must not wait behind each other's requests
    (aiokafka keeps one request in flight per connection) get producers of their own: the
    scheduler's closings do not queue behind the worker's decisions.
    """

    def __init__(self, producer: LazyProducer, topic: str) -> None:
        self.producer = producer
        self.topic = topic

    async def publish(
        self, key: bytes | None, value: bytes, headers: Sequence[tuple[str, bytes]]
    ) -> None:
        """Send and wait until acknowledged."""
        await self.publish_many([(key, value, headers)])

    async def publish_many(self, records: Sequence[OutRecord]) -> None:
        """Queue all in order (per-key order is kept), then wait for every acknowledgement.

        `send` does not yield while the accumulator has room, so the records of one call leave
        together: one produce request per partition leader.
        """
        producer = await self.producer.started()
        pending: list[asyncio.Future[object]] = []
        try:
            for key, value, headers in records:
                pending.append(
                    await producer.send(
                        self.topic, value=value, key=key, headers=list(headers) or None
                    )
                )
        finally:
            # Every queued record's outcome is awaited, also when a later send raised.
            results = await asyncio.gather(*pending, return_exceptions=True)
        for result in results:
            if isinstance(result, BaseException):
                raise LogError(f"publishing to {self.topic} failed: {result}") from result


class PartitionedSink:
    """Publishes to explicit partitions of one topic through a `LazyProducer` (the snapshots:
    a session's snapshot and its partition's checkpoint go to its events partition's number)."""

    def __init__(self, producer: LazyProducer, topic: str) -> None:
        self.producer = producer
        self.topic = topic

    async def publish_to(self, records: Sequence[tuple[int, bytes, bytes]]) -> None:
        """Queue all (partition, key, value), then wait for every acknowledgement."""
        if not records:
            return
        pending: list[asyncio.Future[object]] = []
        try:
            producer = await self.producer.started()
            for partition, key, value in records:
                pending.append(
                    await producer.send(self.topic, value=value, key=key, partition=partition)
                )
        except (KafkaError, AssertionError) as e:  # refused before it was queued (aiokafka)
            raise LogError(f"publishing to {self.topic} failed: {e!r}") from e
        finally:
            results = await asyncio.gather(*pending, return_exceptions=True)
        for result in results:
            if isinstance(result, BaseException):
                raise LogError(f"publishing to {self.topic} failed: {result}") from result
