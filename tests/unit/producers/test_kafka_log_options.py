"""The options `KafkaEventLog` gives kafka-python's producer (no broker: the producer is faked)."""

from __future__ import annotations

import threading
import time
from typing import Any

import kafka
import pytest

from producers.kafka_access import KafkaAccess
from producers.kafka_log import KafkaEventLog, ProducerConfig
from schemas.errors import ConfigurationError, LogError


@pytest.fixture
def built(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    """The keyword arguments of every KafkaProducer built."""
    seen: list[dict[str, Any]] = []

    class Recording:
        def __init__(self, **options: Any) -> None:
            seen.append(options)

    monkeypatch.setattr(kafka, "KafkaProducer", Recording)
    monkeypatch.setattr(KafkaAccess, "check_reachable", lambda self, timeout: None)
    return seen


def test_the_producer_is_idempotent_with_acks_all_and_no_client_metrics(
    built: list[dict[str, Any]],
) -> None:
    KafkaEventLog("127.0.0.1:9", "t")._producer  # noqa: B018 - building it is the test
    (options,) = built
    assert options["acks"] == "all"
    assert options["enable_idempotence"] is True
    assert options["max_in_flight_requests_per_connection"] == 5
    assert options["metrics_enabled"] is False
    assert options["bootstrap_servers"] == ["127.0.0.1:9"]


def test_client_metrics_can_be_turned_on_and_extra_options_pass_through(
    built: list[dict[str, Any]],
) -> None:
    config = ProducerConfig(client_metrics=True, extra={"retries": 3})
    KafkaEventLog("127.0.0.1:9", "t", config=config)._producer  # noqa: B018
    (options,) = built
    assert options["metrics_enabled"] is True
    assert options["retries"] == 3


@pytest.mark.parametrize(
    ("option", "named"),
    [("acks", "always 'all'"), ("enable_idempotence", "always on"), ("linger_ms", "field")],
)
def test_extra_options_may_not_undo_the_logs_guarantees_or_its_fields(
    option: str, named: str
) -> None:
    with pytest.raises(ConfigurationError, match=f"{option} \\({named}"):
        ProducerConfig(extra={option: 1})


@pytest.mark.usefixtures("built")
def test_extra_options_may_not_change_how_the_producer_reaches_kafka() -> None:
    config = ProducerConfig(extra={"bootstrap_servers": ["10.0.0.1:9092"]})
    with pytest.raises(ConfigurationError, match="bootstrap_servers"):
        KafkaEventLog("127.0.0.1:9", "t", config=config)._producer  # noqa: B018


def test_threads_appending_first_at_once_share_one_producer(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The console's pool and the demo's agents share a log: one producer, not one per thread."""
    built: list[object] = []
    started = threading.Barrier(8)

    class Slow:
        def __init__(self, **options: Any) -> None:
            time.sleep(0.05)  # connecting: long enough for every thread to arrive meanwhile
            built.append(self)

    monkeypatch.setattr(kafka, "KafkaProducer", Slow)
    monkeypatch.setattr(KafkaAccess, "check_reachable", lambda self, timeout: None)
    log = KafkaEventLog("127.0.0.1:9", "t")
    got: list[object] = []

    def first_append() -> None:
        started.wait()
        got.append(log._producer)

    threads = [threading.Thread(target=first_append) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(built) == 1
    assert got == built * 8


def test_threads_that_waited_for_a_failing_connect_share_its_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With Kafka down, threads queued behind a failing connect fail with it, not one by one."""
    attempts: list[float] = []
    started = threading.Barrier(6)

    def unreachable(self: KafkaAccess, timeout: float) -> None:
        attempts.append(time.monotonic())
        time.sleep(0.2)  # a connect that takes its time, then fails
        raise LogError("cannot reach Kafka at 127.0.0.1:9")

    monkeypatch.setattr(KafkaAccess, "check_reachable", unreachable)
    log = KafkaEventLog("127.0.0.1:9", "t")
    errors: list[BaseException] = []

    def first_append() -> None:
        started.wait()
        try:
            log._producer  # noqa: B018
        except LogError as e:
            errors.append(e)

    threads = [threading.Thread(target=first_append) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(errors) == 6
    assert len(attempts) == 1  # one connect; the five that waited for it got its error
    with pytest.raises(LogError):  # a later append tries again
        log._producer  # noqa: B018
    assert len(attempts) == 2


@pytest.mark.parametrize("max_block", [0, -1.0])
def test_a_max_block_that_is_no_wait_is_refused(max_block: float) -> None:
    with pytest.raises(ConfigurationError, match="max_block must be above 0"):
        ProducerConfig(max_block=max_block)
