"""What a subscription commits (only what it handed out) and what it reads back before a partition's
first record (what its group may have handed out already). No broker: the consumers are faked."""

from __future__ import annotations

from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any, ClassVar

import pytest
from kafka import TopicPartition
from kafka.errors import CommitFailedError, KafkaTimeoutError

import producers.subscription as subscription_module
from producers.subscription import Subscription
from schemas.errors import LogError

TP0, TP1 = TopicPartition("t", 0), TopicPartition("t", 1)


class FakeConsumer:
    """In a group: hands out the polls it was given, and records each commit's offsets and each
    seek. Without a group (reading back): reads `log` from where it was sought, two records of a
    partition per poll."""

    polls: ClassVar[list[dict[TopicPartition, list[Any]]]] = []
    log: ClassVar[dict[TopicPartition, list[Any]]] = {}
    readers: ClassVar[int] = 0
    failing: ClassVar[bool] = False
    closed: ClassVar[int] = 0
    no_metadata: ClassVar[bool] = False

    def __init__(self, **options: Any) -> None:
        self.grouped = options["group_id"] is not None
        self.options = options
        self.calls: list[str] = []
        self.commits: list[dict[TopicPartition, int]] = []
        self.sought: dict[TopicPartition, int] = {}
        self.paused: set[TopicPartition] = set()
        self.owned = {TP0, TP1}
        if not self.grouped:
            FakeConsumer.readers += 1

    def subscribe(self, topics: list[str]) -> None:
        self.calls.append(f"subscribe {topics[0]}")

    def partitions_for_topic(self, topic: str) -> set[int]:
        self.calls.append(f"partitions {topic}")
        if FakeConsumer.no_metadata:
            raise KafkaTimeoutError("no broker answered")
        return {0, 1}

    def poll(self, timeout_ms: int) -> dict[TopicPartition, list[Any]]:
        if self.grouped:
            return self.polls.pop(0) if self.polls else {}
        out = {}
        for tp in self.owned - self.paused:
            at = self.sought.get(tp, 0)
            records = [r for r in self.log.get(tp, []) if r.offset >= at][:2]
            if records:
                out[tp] = records
                self.sought[tp] = records[-1].offset + 1
        return out

    def assign(self, partitions: list[TopicPartition]) -> None:
        self.owned = set(partitions)

    def offsets_for_times(
        self, times: dict[TopicPartition, int], timeout_ms: int
    ) -> dict[TopicPartition, Any]:
        if self.failing:
            raise KafkaTimeoutError("no leader")
        found = {}
        for tp, since in times.items():
            later = [r.offset for r in self.log.get(tp, []) if r.timestamp >= since]
            found[tp] = SimpleNamespace(offset=later[0]) if later else None
        return found

    def seek(self, tp: TopicPartition, offset: int) -> None:
        self.sought[tp] = offset

    def position(self, tp: TopicPartition, timeout_ms: int) -> int:
        return self.sought[tp]

    def pause(self, *partitions: TopicPartition) -> None:
        self.paused.update(partitions)

    def close(self) -> None:
        FakeConsumer.closed += 1

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


def record(offset: int, value: bytes, timestamp: int = 1_000_000) -> Any:
    return SimpleNamespace(offset=offset, value=value, timestamp=timestamp)


@pytest.fixture
def sub(monkeypatch: pytest.MonkeyPatch) -> Iterator[Texts]:
    monkeypatch.setattr(subscription_module, "KafkaConsumer", FakeConsumer)
    FakeConsumer.polls = [
        {
            TP0: [record(10, b"a:1"), record(11, b"a:1"), record(12, b"a:2")],
            TP1: [record(5, b"bad"), record(6, b"b:1")],
        }
    ]
    FakeConsumer.log, FakeConsumer.readers, FakeConsumer.failing = {}, 0, False
    yield Texts("127.0.0.1:9", "t", "g")
    FakeConsumer.polls = []


def commits(sub: Texts) -> list[dict[TopicPartition, int]]:
    consumer: FakeConsumer = sub._consumer  # type: ignore[assignment]
    return consumer.commits


def test_the_partitions_are_known_before_the_first_join_and_refreshed_often(sub: Texts) -> None:
    # kafka-python drops an update asked for during its bootstrap's: the leader would assign
    # nothing until the next refresh (5 minutes by default).
    consumer: FakeConsumer = sub._consumer  # type: ignore[assignment]
    assert consumer.calls == ["subscribe t", "partitions t"]
    assert consumer.options["metadata_max_age_ms"] <= 10_000


def test_a_subscription_that_cannot_learn_its_partitions_closes_its_consumer(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(subscription_module, "KafkaConsumer", FakeConsumer)
    monkeypatch.setattr(FakeConsumer, "no_metadata", True)
    monkeypatch.setattr(FakeConsumer, "closed", 0)
    with pytest.raises(LogError, match=r"cannot subscribe to t: .*no broker answered"):
        Texts("127.0.0.1:9", "t", "g")
    assert FakeConsumer.closed == 1


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


# -- reading back --------------------------------------------------------------------------------

HOUR_MS = 3_600_000


@pytest.fixture
def restarted(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """A partition whose `a:1` and `a:2` this group handed out before (offsets 10 and 11, an hour
    in), committed at 12; a worker then published `a:2` again (12) and `a:3` (13)."""
    monkeypatch.setattr(subscription_module, "KafkaConsumer", FakeConsumer)
    FakeConsumer.log = {
        TP0: [
            record(9, b"z:7", HOUR_MS - 900_001),  # before the look-back: not read
            record(10, b"a:1", HOUR_MS),
            record(11, b"a:2", HOUR_MS + 1),
            record(12, b"a:2", HOUR_MS + 5_000),
            record(13, b"a:3", HOUR_MS + 5_000),
        ]
    }
    FakeConsumer.polls = [{TP0: FakeConsumer.log[TP0][3:]}]
    FakeConsumer.readers, FakeConsumer.failing = 0, False
    yield
    FakeConsumer.polls, FakeConsumer.log = [], {}


@pytest.mark.usefixtures("restarted")
def test_a_copy_of_what_the_group_handed_out_before_a_restart_is_a_repeat() -> None:
    sub = Texts("127.0.0.1:9", "t", "g")
    assert sub.poll() == ["a:3"]
    assert sub.read_back == 2  # a:1 and a:2 (offsets 10, 11), not the record before the window
    assert FakeConsumer.readers == 1


@pytest.mark.usefixtures("restarted")
def test_without_a_look_back_the_copy_is_handed_out_again() -> None:
    sub = Texts("127.0.0.1:9", "t", "g", lookback_s=0)
    assert sub.poll() == ["a:2", "a:3"]
    assert sub.read_back == 0
    assert FakeConsumer.readers == 0


@pytest.mark.usefixtures("restarted")
def test_an_original_published_before_the_look_back_is_not_recognised() -> None:
    """The guarantee is bounded: a copy published more than `lookback_s` after its original."""
    sub = Texts("127.0.0.1:9", "t", "g", lookback_s=4)
    assert sub.poll() == ["a:2", "a:3"]
    assert sub.read_back == 0


@pytest.mark.usefixtures("restarted")
def test_a_partition_that_comes_back_where_this_process_left_it_is_not_read_again() -> None:
    """A rebalance that gives the partition back at the offset this process reached, or before
    it (its commit was behind), leaves nothing unseen before it: no reader is made."""
    sub = Texts("127.0.0.1:9", "t", "g")
    sub.poll()
    FakeConsumer.polls = [
        {TP0: [record(14, b"a:4", HOUR_MS + 6_000)]},
        {TP0: [record(13, b"a:3", HOUR_MS + 5_000), record(14, b"a:4", HOUR_MS + 6_000)]},
    ]
    assert sub.poll() == ["a:4"]
    assert sub.poll() == []  # back from 13 (the group's commit), seen and handed out here
    assert FakeConsumer.readers == 1  # the first poll's, only


@pytest.mark.usefixtures("restarted")
def test_a_partition_that_comes_back_further_on_is_read_from_where_this_process_left_it() -> None:
    """Another member handed out 14 and committed 15 meanwhile; the worker republished 14."""
    sub = Texts("127.0.0.1:9", "t", "g")
    sub.poll()  # read through 13
    read_before = sub.read_back
    FakeConsumer.log[TP0] += [
        record(14, b"a:4", HOUR_MS + 6_000),
        record(15, b"a:4", HOUR_MS + 7_000),
    ]
    FakeConsumer.polls = [{TP0: FakeConsumer.log[TP0][-1:]}]
    assert sub.poll() == []
    assert sub.read_back - read_before == 1  # offset 14 alone, not the look-back's hour again
    assert FakeConsumer.readers == 2


def test_a_refused_commit_drops_what_was_not_handed_out(sub: Texts) -> None:
    """The member lost its partitions: their new owner hands the rest out, not this one too."""
    items = iter(sub)
    assert next(items) == "a:1"
    consumer: FakeConsumer = sub._consumer  # type: ignore[assignment]

    def refused(offsets: object) -> None:
        raise CommitFailedError("the group rebalanced")

    consumer.commit = refused  # type: ignore[method-assign]
    with pytest.raises(LogError, match="committing t offsets failed"):
        sub.commit()
    assert sub.poll() == []  # a:2 and b:1 were not handed out here, and are not now


@pytest.mark.usefixtures("restarted")
def test_a_failed_read_back_hands_out_nothing_and_the_poll_is_read_again() -> None:
    FakeConsumer.failing = True
    sub = Texts("127.0.0.1:9", "t", "g")
    with pytest.raises(LogError, match="reading t back failed"):
        sub.poll()
    consumer: FakeConsumer = sub._consumer  # type: ignore[assignment]
    assert consumer.sought == {TP0: 12}  # the group's consumer goes back to the poll's first
    FakeConsumer.failing = False
    FakeConsumer.polls = [{TP0: FakeConsumer.log[TP0][3:]}]
    assert sub.poll() == ["a:3"]


@pytest.mark.usefixtures("restarted")
def test_records_without_a_timestamp_are_not_read_back_and_it_says_so(
    caplog: pytest.LogCaptureFixture,
) -> None:
    FakeConsumer.polls = [{TP0: [record(12, b"a:2", -1), record(13, b"a:3", -1)]}]
    sub = Texts("127.0.0.1:9", "t", "g")
    assert sub.poll() == ["a:2", "a:3"]
    assert FakeConsumer.readers == 0
    assert "t[0] has records without a timestamp: it is not read back" in caplog.text
