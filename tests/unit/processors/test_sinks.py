"""Kafka output sinks without a broker: a stopped producer stays stopped, failures are reported."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from aiokafka.errors import IllegalOperation, KafkaConnectionError, KafkaTimeoutError

from processors import sinks as sinks_module
from processors.sinks import FencedSnapshotSink, FencedWriter, LazyProducer, ProducerSink
from schemas.errors import LogError, ProducerStoppedError


class FakeProducer:
    """Records sends; the futures of the keys in `failing` fail."""

    def __init__(self, failing: set[bytes]) -> None:
        self.failing = failing
        self.sent: list[tuple[str, bytes | None, bytes]] = []

    async def send(self, topic: str, *, value: bytes, key: bytes | None, headers: Any) -> Any:
        self.sent.append((topic, key, value))
        future: asyncio.Future[object] = asyncio.get_running_loop().create_future()
        if key in self.failing:
            future.set_exception(RuntimeError(f"broker refused {key!r}"))
        else:
            future.set_result("metadata")
        return future


class Started(LazyProducer):
    def __init__(self, producer: FakeProducer) -> None:
        super().__init__("unused:9092")
        self.fake = producer

    async def started(self) -> Any:
        return self.fake


def test_a_stopped_producer_is_not_started_again() -> None:
    producer = LazyProducer("127.0.0.1:1")  # nothing listens there: it must not be needed
    sink = ProducerSink(producer, "decisions")

    async def run() -> None:
        await producer.stop()
        with pytest.raises(ProducerStoppedError, match="stopped"):
            await sink.publish(b"k", b"v", ())

    asyncio.run(run())


def test_every_record_is_queued_in_order_and_a_refused_one_fails_the_call() -> None:
    fake = FakeProducer(failing={b"s2"})
    sink = ProducerSink(Started(fake), "decisions")
    records = [(f"s{i}".encode(), f"v{i}".encode(), ()) for i in range(4)]

    async def run() -> None:
        await sink.publish_many(records[:2] + records[3:])  # none refused
        with pytest.raises(LogError, match=r"decisions failed.*s2"):
            await sink.publish_many(records)

    asyncio.run(run())
    assert [key for _, key, _ in fake.sent] == [b"s0", b"s1", b"s3", b"s0", b"s1", b"s2", b"s3"]


class NoMetadata(FakeProducer):
    """`send` itself raises for `refused` (aiokafka does when the topic's metadata is late)."""

    def __init__(self, refused: bytes) -> None:
        super().__init__(failing=set())
        self.refused = refused

    async def send(self, topic: str, *, value: bytes, key: bytes | None, headers: Any) -> Any:
        if key == self.refused:
            raise KafkaTimeoutError("no metadata within 60 s")
        return await super().send(topic, value=value, key=key, headers=headers)


def test_a_send_that_raises_is_a_log_error_after_the_queued_ones_are_awaited() -> None:
    fake = NoMetadata(refused=b"s1")
    sink = ProducerSink(Started(fake), "decisions")
    records = [(f"s{i}".encode(), b"v", ()) for i in range(3)]

    async def run() -> None:
        with pytest.raises(LogError, match=r"decisions failed.*KafkaTimeoutError") as raised:
            await sink.publish_many(records)
        assert isinstance(raised.value.__cause__, KafkaTimeoutError)

    asyncio.run(run())
    assert [key for _, key, _ in fake.sent] == [b"s0"]  # nothing queued after the refusal


class Unreachable:
    """An aiokafka producer whose start finds no broker."""

    stopped = 0

    def __init__(self, **_: Any) -> None:
        pass

    async def start(self) -> None:
        raise KafkaConnectionError("Unable to bootstrap from [('127.0.0.1', 1)]")

    async def stop(self) -> None:
        Unreachable.stopped += 1


def test_a_producer_that_cannot_start_is_a_log_error_and_is_started_again_next_time(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(sinks_module.aiokafka, "AIOKafkaProducer", Unreachable)
    sink = ProducerSink(LazyProducer("127.0.0.1:1"), "decisions")

    async def run() -> None:
        for _ in range(2):
            with pytest.raises(LogError, match="starting a producer") as raised:
                await sink.publish(b"k", b"v", ())
            assert isinstance(raised.value.__cause__, KafkaConnectionError)

    asyncio.run(run())
    assert Unreachable.stopped == 2  # each half-started producer closed


class StuckTransactions:
    """A transactional producer whose records are never acknowledged (a coordinator out of
    reach: aiokafka waits for ever), and whose start never ends either when told so."""

    def __init__(self, *_: Any, hang_start: bool = False, **__: Any) -> None:
        self.hang_start = hang_start
        self.calls: list[str] = []

    async def start(self) -> None:
        self.calls.append("start")
        if self.hang_start:
            await asyncio.Event().wait()

    async def stop(self) -> None:
        self.calls.append("stop")

    async def begin_transaction(self) -> None:
        self.calls.append("begin")

    async def send(self, topic: str, *, value: bytes, key: bytes, partition: int) -> Any:
        self.calls.append("send")
        return asyncio.get_running_loop().create_future()  # never resolved

    async def commit_transaction(self) -> None:
        self.calls.append("commit")

    async def abort_transaction(self) -> None:
        self.calls.append("abort")


def test_a_snapshot_page_that_is_never_acknowledged_fails_the_round_in_bounded_time() -> None:
    """A round that waited for ever would hold the lock a revocation needs."""
    producer = StuckTransactions()
    writer = FencedWriter(producer, "snaps", 3, timeout_s=0.05)  # type: ignore[arg-type]
    with pytest.raises(LogError, match=r"snaps partition 3 took over 0.05 s"):
        asyncio.run(writer.publish([(b"s1", b"v1"), (b"s2", b"v2")]))
    assert producer.calls == ["begin", "send", "send", "abort"]  # never committed


class RefusedTransactions(StuckTransactions):
    """A producer whose transaction manager refuses the send (aiokafka's `IllegalOperation`, not
    a `KafkaError`: e.g. a transaction aborted under it)."""

    async def send(self, topic: str, *, value: bytes, key: bytes, partition: int) -> Any:
        self.calls.append("send")
        raise IllegalOperation("no transaction in progress")


def test_a_send_the_transaction_refuses_fails_the_round_as_a_log_error() -> None:
    producer = RefusedTransactions()
    writer = FencedWriter(producer, "snaps", 3, timeout_s=5)  # type: ignore[arg-type]
    with pytest.raises(LogError, match="publishing to snaps failed: IllegalOperation"):
        asyncio.run(writer.publish([(b"s1", b"v1")]))
    assert producer.calls == ["begin", "send", "abort"]


def _hanging_starts(monkeypatch: pytest.MonkeyPatch) -> list[StuckTransactions]:
    """The producers the sink makes from now on, each of whose start never ends."""
    made: list[StuckTransactions] = []

    def producer(*args: Any, **kwargs: Any) -> StuckTransactions:
        made.append(StuckTransactions(hang_start=True))
        return made[-1]

    monkeypatch.setattr("processors.sinks.aiokafka.AIOKafkaProducer", producer)
    return made


def test_a_writer_cancelled_while_it_starts_is_stopped(monkeypatch: pytest.MonkeyPatch) -> None:
    made = _hanging_starts(monkeypatch)
    sink = FencedSnapshotSink("127.0.0.1:1", "snaps", start_timeout_s=30)

    async def open_writer() -> None:
        async with sink.fenced(0):
            pytest.fail("the writer never started")

    async def run() -> None:
        task = asyncio.create_task(open_writer())
        await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(run())
    assert made[0].calls == ["start", "stop"]


def test_a_writer_whose_start_times_out_is_stopped_and_the_failure_is_a_log_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    made = _hanging_starts(monkeypatch)
    sink = FencedSnapshotSink("127.0.0.1:1", "snaps", start_timeout_s=0.05)

    async def open_writer() -> None:
        async with sink.fenced(2):
            pytest.fail("the writer never started")

    with pytest.raises(LogError, match=r"starting the snapshot writer snaps\.writer-2 failed"):
        asyncio.run(open_writer())
    assert made[0].calls == ["start", "stop"]
