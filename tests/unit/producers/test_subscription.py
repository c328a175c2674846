"""What a subscription commits: only what it handed out (no broker: the consumer is faked)."""

from __future__ import annotations

from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any, ClassVar

import pytest
from kafka import TopicPartition

import producers.subscription as subscription_module
from producers.subscription import Subscription

TP0, TP1 = TopicPartition("t", 0), TopicPartition("t", 1)


class FakeConsumer:
    """Hands out the polls it was given, and records each commit's offsets."""

    polls: ClassVar[list[dict[TopicPartition, list[Any]]]] = []

    def __init__(self, *topics: str, **options: Any) -> None:
        self.commits: list[dict[TopicPartition, int]] = []
        self.owned = {TP0, TP1}

    def poll(self, timeout_ms: int) -> dict[TopicPartition, list[Any]]:
        return self.polls.pop(0) if self.polls else {}

    def assignment(self) -> set[TopicPartition]:
        return self.owned

    def commit(self, offsets: dict[TopicPartition, Any]) -> None:
        self.commits.append({tp: meta.offset for tp, meta in offsets.items()})


class Texts(Subscription[str]):
    """Records whose value is `session:seq`; `bad` does not decode."""

    def decode(self, raw: bytes) -> str:
        if raw == b"bad":
            raise ValueError("not a text")
        return raw.decode()

    def order(self, item: str) -> tuple[str, tuple[int, ...]]:
        session, seq = item.split(":")
        return session, (int(seq),)


def record(offset: int, value: bytes) -> Any:
    return SimpleNamespace(offset=offset, value=value)


@pytest.fixture
def sub(monkeypatch: pytest.MonkeyPatch) -> Iterator[Texts]:
    monkeypatch.setattr(subscription_module, "KafkaConsumer", FakeConsumer)
    FakeConsumer.polls = [
        {
            TP0: [record(10, b"a:1"), record(11, b"a:1"), record(12, b"a:2")],
            TP1: [record(5, b"bad"), record(6, b"b:1")],
        }
    ]
    yield Texts("127.0.0.1:9", "t", "g")
    FakeConsumer.polls = []


def commits(sub: Texts) -> list[dict[TopicPartition, int]]:
    consumer: FakeConsumer = sub._consumer  # type: ignore[assignment]
    return consumer.commits


def test_iterating_commits_up_to_the_item_handed_out_not_the_rest_of_the_poll(sub: Texts) -> None:
    items = iter(sub)
    assert next(items) == "a:1"
    sub.commit()
    assert commits(sub) == [{TP0: 11}]  # a:1 handled; a:2 and the other partition are not yet
    assert next(items) == "a:2"  # (the repeat at 11 skipped on the way)
    assert next(items) == "b:1"  # (the undecodable record at 5 skipped on the way)
    sub.commit()
    assert commits(sub)[1] == {TP0: 13, TP1: 7}
    assert sub.undecodable == 1


def test_a_poll_hands_out_everything_and_commits_it(sub: Texts) -> None:
    assert sub.poll() == ["a:1", "a:2", "b:1"]
    sub.commit()
    assert commits(sub) == [{TP0: 13, TP1: 7}]
    sub.commit()  # nothing handed out since: nothing to commit
    assert commits(sub) == [{TP0: 13, TP1: 7}]


def test_a_partition_taken_by_another_member_is_not_committed(sub: Texts) -> None:
    sub.poll()
    consumer: FakeConsumer = sub._consumer  # type: ignore[assignment]
    consumer.owned = {TP0}
    sub.commit()
    assert commits(sub) == [{TP0: 13}]


def test_an_iteration_ended_early_leaves_the_rest_of_its_poll_to_the_next(sub: Texts) -> None:
    """A `break` (or an error) in the caller's loop does not skip the poll's other items."""
    for item in sub:
        assert item == "a:1"
        break
    sub.commit()
    assert commits(sub) == [{TP0: 11}]
    assert sub.poll() == ["a:2", "b:1"]  # from what the iteration left, not a new poll
    sub.commit()
    assert commits(sub)[1] == {TP0: 13, TP1: 7}
