"""The rebuild's fetcher fails with LogError when its read gets no further (no broker: faked)."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
from aiokafka import TopicPartition

import processors.replay as replay_module
from producers.kafka_access import KafkaAccess
from schemas.errors import LogError


class StuckConsumer:
    """A consumer whose partitions never move (a leaderless partition, as aiokafka sees one)."""

    def __init__(self, hang_position: bool = False) -> None:
        self.hang_position = hang_position
        self.fetches = 0

    def assign(self, partitions: list[TopicPartition]) -> None:
        pass

    async def seek_to_beginning(self, *partitions: TopicPartition) -> None:
        pass

    async def position(self, tp: TopicPartition) -> int:
        if self.hang_position:
            await asyncio.sleep(3600)
        return 2

    async def getmany(self, *partitions: TopicPartition, **kwargs: Any) -> dict[Any, Any]:
        self.fetches += 1
        await asyncio.sleep(0.01)
        return {}

    def pause(self, tp: TopicPartition) -> None:
        pass


def _fetch_with(monkeypatch: pytest.MonkeyPatch, consumer: StuckConsumer) -> None:
    @contextlib.asynccontextmanager
    async def fake(access: KafkaAccess) -> AsyncIterator[StuckConsumer]:
        yield consumer

    monkeypatch.setattr(replay_module, "_consumer", fake)
    monkeypatch.setattr(replay_module, "STALL_S", 0.2)
    with replay_module._Fetcher(KafkaAccess.of("127.0.0.1:9"), "events", {0: 5}, 100) as f:
        list(f.batches())


def test_a_read_that_gets_no_further_fails_instead_of_waiting_for_ever(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    consumer = StuckConsumer()
    with pytest.raises(LogError, match=r"got no further for 0.2s .*\{0: \(2, 5\)\}"):
        _fetch_with(monkeypatch, consumer)
    assert consumer.fetches > 1  # it kept asking until the bound


def test_a_fetcher_thread_that_hands_nothing_over_fails_the_read_instead_of_a_hang(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Stuck where it cannot notice (a lock held for ever since a fork): the reader gives up."""
    stuck = threading.Event()

    def hung(self: replay_module._Fetcher) -> None:
        stuck.wait(5)  # as in OpenSSL's lock, held by a thread the fork did not copy

    monkeypatch.setattr(replay_module._Fetcher, "_run", hung)
    with replay_module._Fetcher(KafkaAccess.of("127.0.0.1:9"), "events", {0: 5}, 100) as f:
        f.silent_s = 0.1
        with pytest.raises(LogError, match=r"handed nothing over for 0.1s and is stuck"):
            list(f.batches())
        stuck.set()


def test_a_position_that_never_comes_fails_instead_of_waiting_for_ever(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with pytest.raises(LogError, match=r"position took over 0\.2s"):
        _fetch_with(monkeypatch, StuckConsumer(hang_position=True))


class MovingConsumer(StuckConsumer):
    """A healthy partition: one record per fetch until its end."""

    def __init__(self, end: int) -> None:
        super().__init__()
        self.at, self.end = 0, end

    async def position(self, tp: TopicPartition) -> int:
        return self.at

    async def getmany(self, *partitions: TopicPartition, **kwargs: Any) -> dict[Any, Any]:
        if self.at >= self.end:
            return {}
        record = type("Record", (), {"offset": self.at, "key": b"s", "value": b"v"})()
        self.at += 1
        return {partitions[0]: [record]}


def test_a_fold_slower_than_the_stall_bound_is_no_stall(monkeypatch: pytest.MonkeyPatch) -> None:
    """The fetcher waits for the fold to take its batches: that wait is not the log's."""

    @contextlib.asynccontextmanager
    async def fake(access: KafkaAccess) -> AsyncIterator[MovingConsumer]:
        yield MovingConsumer(end=8)

    monkeypatch.setattr(replay_module, "_consumer", fake)
    monkeypatch.setattr(replay_module, "STALL_S", 0.1)
    got = []
    with replay_module._Fetcher(KafkaAccess.of("127.0.0.1:9"), "events", {0: 8}, 100) as f:
        for batch in f.batches():
            time.sleep(0.2)  # a fold slower than STALL_S: the fetcher waits on the full queue
            got.extend(offset for _, offset, _, _ in batch)
    assert got == list(range(8))
