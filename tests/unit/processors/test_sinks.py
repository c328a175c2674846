"""Kafka output sinks without a broker: a stopped producer stays stopped, failures are reported."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from processors.sinks import LazyProducer, ProducerSink
from schemas.errors import LogError


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
        with pytest.raises(LogError, match="stopped"):
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
