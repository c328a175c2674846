"""New topics are waited for on every broker, not on whichever one answers first."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

import pytest
from kafka.errors import KafkaConnectionError

from producers.topics import wait_for_brokers
from schemas.errors import LogError

TOPICS = {"events": 6, "decisions": 6}


class Brokers:
    """Brokers 1-3, each learning the topics after `lag[b]` questions (None: never)."""

    def __init__(self, lag: dict[int, int | None], down: Sequence[int] = ()) -> None:
        self.lag = lag
        self.down = set(down)
        self.asked: list[int | None] = []

    def ask(
        self, broker: int | None, topics: Sequence[str]
    ) -> tuple[dict[str, int], tuple[int, ...]]:
        self.asked.append(broker)
        if broker in self.down:
            raise KafkaConnectionError(f"broker {broker} refused the connection")
        lag = 0 if broker is None else self.lag[broker]
        seen = sum(1 for b in self.asked if b == broker)
        knows = lag is not None and seen > lag
        return ({t: TOPICS[t] for t in topics} if knows else {}), tuple(self.lag)


def test_every_broker_is_waited_for_until_it_knows_the_topics() -> None:
    brokers = Brokers({1: 0, 2: 0, 3: 4})
    wait_for_brokers(brokers.ask, TOPICS, time.monotonic() + 5, pause_s=0)
    assert brokers.asked.count(3) == 5  # asked until its fifth answer held the topics
    assert brokers.asked.count(1) == brokers.asked.count(2) == 1


def test_a_topic_with_fewer_partitions_than_made_is_not_yet_known() -> None:
    answers = iter([{"events": 6}, {"events": 3}, {"events": 6}])
    asked: list[int | None] = []

    def ask(broker: int | None, topics: Sequence[str]) -> tuple[dict[str, int], tuple[int, ...]]:
        asked.append(broker)
        return next(answers), (1,)

    wait_for_brokers(ask, {"events": 6}, time.monotonic() + 5, pause_s=0)
    assert asked == [None, 1, 1]


def test_a_broker_that_answers_without_the_topics_at_the_deadline_is_an_error() -> None:
    brokers = Brokers({1: 0, 2: None, 3: 0})
    with pytest.raises(LogError, match=r"\{2: \['decisions', 'events'\]\}"):
        wait_for_brokers(brokers.ask, TOPICS, time.monotonic() + 0.05, pause_s=0.01)


def test_a_broker_that_cannot_be_asked_does_not_hold_the_wait(
    caplog: pytest.LogCaptureFixture,
) -> None:
    brokers = Brokers({1: 0, 2: 0, 3: 0}, down=[2])
    with caplog.at_level(logging.WARNING, logger="producers.topics"):
        wait_for_brokers(brokers.ask, TOPICS, time.monotonic() + 0.05, pause_s=0.01)
    assert brokers.asked.count(2) > 1  # retried until the deadline
    assert "could not ask brokers [2]" in caplog.text
