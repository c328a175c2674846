"""Where the processors publish: topics written through aiokafka producers of their own.

Not through Faust's producer: Faust's `Topic.send` yields to the event loop between records, so
aiokafka's sender (linger 0) ships whatever is queued at that moment. A batch's ≈ 200 decisions
went out as ≈ 45 produce requests of ≈ 4.6 records (the broker spent ≈ 3–4 µs of CPU per consumed
event on them, with two workers on two cores); queued without a yield they go out as one request
per partition leader, ≈ 70 records each (docs/PERFORMANCE.md, "Two workers").
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Sequence

import aiokafka
from aiokafka.errors import IllegalOperation, KafkaError, ProducerFenced

from processors.ports import OutRecord
from producers.kafka_access import KafkaAccess
from projections.snapshots import SNAPSHOT_MAX_BYTES, snapshot_writer_id
from schemas.errors import LogError, ProducerStoppedError

log = logging.getLogger(__name__)


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
                raise ProducerStoppedError(f"the producer to {self.bootstrap} was stopped")
            if self._producer is None:
                producer = aiokafka.AIOKafkaProducer(
                    **self.access.aiokafka(),
                    acks="all",
                    enable_idempotence=True,
                    linger_ms=0,
                )
                try:
                    await producer.start()
                except KafkaError as e:  # e.g. no broker reachable: the next send starts again
                    with contextlib.suppress(Exception):
                        await producer.stop()
                    raise LogError(f"starting a producer to {self.bootstrap} failed: {e!r}") from e
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
        refused: KafkaError | None = None
        try:
            for key, value, headers in records:
                pending.append(
                    await producer.send(
                        self.topic, value=value, key=key, headers=list(headers) or None
                    )
                )
        except KafkaError as e:  # e.g. no metadata for the topic in time: nothing more queued
            refused = e
        finally:
            # Every queued record's outcome is awaited, also when a later send raised.
            results = await asyncio.gather(*pending, return_exceptions=True)
        for result in (*results, refused):
            if isinstance(result, BaseException):
                raise LogError(f"publishing to {self.topic} failed: {result!r}") from result


_ABORT_TIMEOUT_S = 10.0  # how long a failed round waits for its transaction's abort


class FencedSnapshotSink:
    """Publishes a partition's snapshots through a transactional writer opened for one round.

    Every writer of partition p (whichever worker owns it, or a rebuild) uses the same
    transactional id (`projections.snapshots.snapshot_writer_id`), and opening one makes the
    broker abort the open transaction of every earlier one and refuse what it sends after. So
    a worker that lost the partition but still runs (a zombie: paused, partitioned from the
    group) cannot publish a snapshot it read before the new owner's round after that round's
    newer one: compaction keeps a key's last record, and a stale last snapshot under a newer
    checkpoint would make a rebuild skip the events between them. Readers of the topic read
    committed records only (`processors.replay`).
    """

    def __init__(
        self,
        access: str | KafkaAccess,
        topic: str,
        *,
        start_timeout_s: float = 30.0,
        publish_timeout_s: float = 60.0,
    ) -> None:
        self.access = KafkaAccess.of(access)
        # Built once: with TLS each build makes an SSL context (~16 ms, on the event loop), and a
        # round opens a writer per partition.
        self._options = self.access.aiokafka()
        self.topic = topic
        self.start_timeout_s = start_timeout_s
        self.publish_timeout_s = publish_timeout_s

    @contextlib.asynccontextmanager
    async def fenced(self, partition: int) -> AsyncIterator[FencedWriter]:
        """The partition's writer, started (earlier writers fenced) before the round reads."""
        writer_id = snapshot_writer_id(self.topic, partition)
        producer = aiokafka.AIOKafkaProducer(
            **self._options,
            transactional_id=writer_id,
            enable_idempotence=True,
            acks="all",
            linger_ms=0,
            max_request_size=SNAPSHOT_MAX_BYTES,
        )
        try:
            # aiokafka retries a coordinator it cannot find for ever: bounded here.
            await asyncio.wait_for(producer.start(), self.start_timeout_s)
        except BaseException as e:  # also cancelled while starting: its tasks are stopped
            await self._stop(producer, writer_id)
            if isinstance(e, (KafkaError, TimeoutError)):
                raise LogError(f"starting the snapshot writer {writer_id} failed: {e!r}") from e
            raise
        try:
            yield FencedWriter(producer, self.topic, partition, self.publish_timeout_s)
        finally:
            await self._stop(producer, writer_id)

    async def _stop(self, producer: aiokafka.AIOKafkaProducer, writer_id: str) -> None:
        """Stop the writer, bounded: its flush waits for ever on batches a coordinator it cannot
        reach holds back (they never expire), and a round must end to let a revocation in."""
        internal = _internal_futures(producer)
        try:
            await asyncio.wait_for(producer.stop(), self.start_timeout_s)
        except Exception as e:  # what it failed to send fails the round already
            log.warning("stopping the snapshot writer %s: %r", writer_id, e)
        finally:
            # Again after the stop: a sender that dies while stopping sets a new waiter.
            for future in {*internal, *_internal_futures(producer)}:
                if future.done() and not future.cancelled():
                    future.exception()  # retrieved: the failure reached the caller already


def _internal_futures(producer: aiokafka.AIOKafkaProducer) -> list[asyncio.Future[object]]:
    """Futures aiokafka (0.14) fails when a fenced writer's sender dies, and that nobody awaits:
    the transaction's waiter and each queued batch's drain waiter. Unretrieved, each logs
    "Future exception was never retrieved" with a traceback at ERROR when it is collected: two
    per fenced round, on every hand-over to a worker whose predecessor still ran. The failure
    itself reaches `FencedWriter.publish`'s caller through the records' own futures."""
    futures: list[asyncio.Future[object]] = []
    txn = getattr(producer, "_txn_manager", None)
    waiter = getattr(txn, "_transaction_waiter", None)
    if isinstance(waiter, asyncio.Future):
        futures.append(waiter)
    accumulator = getattr(producer, "_message_accumulator", None)
    queued = [*getattr(accumulator, "_pending_batches", ())]
    for batches in getattr(accumulator, "_batches", {}).values():
        queued.extend(batches)
    for batch in queued:
        drain = getattr(batch, "_drain_waiter", None)
        if isinstance(drain, asyncio.Future):
            futures.append(drain)
    return futures


class FencedWriter:
    """One round's writer of a partition of the snapshots topic (`FencedSnapshotSink.fenced`)."""

    def __init__(
        self,
        producer: aiokafka.AIOKafkaProducer,
        topic: str,
        partition: int,
        timeout_s: float = 60.0,
    ) -> None:
        self.producer = producer
        self.topic = topic
        self.partition = partition
        self.timeout_s = timeout_s

    async def publish(self, records: Sequence[tuple[bytes, bytes]]) -> None:
        """Publish (key, value) records to the partition in one transaction, committed on
        return (LogError if not: fenced by a newer writer, or the broker refused)."""
        if not records:
            return
        producer = self.producer
        try:
            await producer.begin_transaction()
            try:
                # Bounded: aiokafka waits for ever on a transaction coordinator it cannot find,
                # and a round that never ends holds the lock a revocation waits for.
                await asyncio.wait_for(self._send_and_commit(records), self.timeout_s)
            except BaseException:
                # Fenced: the broker aborted it already. Otherwise an open transaction would hold
                # back the partition's readers until the broker times it out.
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(producer.abort_transaction(), _ABORT_TIMEOUT_S)
                raise
        except ProducerFenced as e:
            raise LogError(
                f"the snapshot writer of {self.topic} partition {self.partition} was fenced "
                f"by a newer one (another worker owns the partition now): {e}"
            ) from e
        except TimeoutError as e:
            raise LogError(
                f"publishing to {self.topic} partition {self.partition} took over "
                f"{self.timeout_s:g} s (its leader or transaction coordinator out of reach?)"
            ) from e
        except (KafkaError, AssertionError, IllegalOperation) as e:
            raise LogError(f"publishing to {self.topic} failed: {e!r}") from e

    async def _send_and_commit(self, records: Sequence[tuple[bytes, bytes]]) -> None:
        producer = self.producer
        pending = [
            await producer.send(self.topic, value=v, key=k, partition=self.partition)
            for k, v in records
        ]
        await asyncio.gather(*pending)
        await producer.commit_transaction()
