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
from tests.unit.builders import turn


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
    [
        ("acks", "always 'all'"),
        ("enable_idempotence", "always on"),
        ("linger_ms", "field"),
        ("delivery_timeout_ms", "field delivery_timeout"),
    ],
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


class _Future:
    """kafka-python's future of a record: `get` fails as given, after recording its wait."""

    def __init__(self, waits: list[float], error: Exception, *, done: bool) -> None:
        self.waits, self.error, self.is_done = waits, error, done

    def get(self, timeout: float) -> Any:
        self.waits.append(timeout)
        raise self.error


def _log_failing_with(
    monkeypatch: pytest.MonkeyPatch, error: Exception, *, done: bool, config: ProducerConfig
) -> tuple[KafkaEventLog, list[dict[str, Any]], list[float]]:
    """A log whose producer fails every record with `error` (given up on, or still queued)."""
    built: list[dict[str, Any]] = []
    waits: list[float] = []

    class Failing:
        def __init__(self, **options: Any) -> None:
            built.append(options)

        def send(self, topic: str, key: bytes, value: bytes) -> _Future:
            return _Future(waits, error, done=done)

    monkeypatch.setattr(kafka, "KafkaProducer", Failing)
    monkeypatch.setattr(KafkaAccess, "check_reachable", lambda self, timeout: None)
    return KafkaEventLog("127.0.0.1:9", "t", config=config), built, waits


def test_an_append_fails_only_once_kafka_python_gave_up_on_its_record(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An append that raised while kafka-python still retried its record saw it land later, and
    its caller's retry (a new event id) wrote the event twice."""
    expired = kafka.errors.KafkaTimeoutError("Expiring 1 record(s) for t-0: 120000 ms has passed")
    log, built, waits = _log_failing_with(monkeypatch, expired, done=True, config=ProducerConfig())
    with pytest.raises(LogError, match=r"did not acknowledge an append: .*Expiring"):
        log.append(turn("user", "hi"))
    (options,) = built
    delivery = options.get("delivery_timeout_ms", 120_000) / 1000  # kafka-python's default
    (waited,) = waits
    assert waited > delivery  # kafka-python failed the record before the append stopped waiting
    assert "delivery_timeout_ms" in options  # set, not left to kafka-python's default
    assert delivery == 120.0  # two minutes, as README and session_model/dedupe.py say


def test_an_append_waits_past_a_delivery_timeout_of_its_own(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    expired = kafka.errors.KafkaTimeoutError("Expiring 1 record(s)")
    config = ProducerConfig(delivery_timeout=45.0)
    log, built, waits = _log_failing_with(monkeypatch, expired, done=True, config=config)
    with pytest.raises(LogError):
        log.append_many([turn("user", "a"), turn("user", "b")])
    assert built[0]["delivery_timeout_ms"] == 45_000
    assert waits and all(45.0 < waited == config.ack_timeout for waited in waits)


def test_an_append_whose_record_is_still_queued_says_it_may_yet_be_written(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """kafka-python's I/O thread held up past the delivery time-out: nothing can be promised."""
    timeout = kafka.errors.KafkaTimeoutError("Timeout after waiting for 130.0 secs.")
    log, _, _ = _log_failing_with(monkeypatch, timeout, done=False, config=ProducerConfig())
    with pytest.raises(LogError, match="still queued and may yet be written"):
        log.append(turn("user", "hi"))


@pytest.mark.parametrize(
    ("delivery_timeout", "extra"),
    [(30.0, {}), (0.0, {}), (-1.0, {}), (60.0, {"request_timeout_ms": 60_000})],
)
def test_a_delivery_timeout_shorter_than_a_request_is_refused(
    delivery_timeout: float, extra: dict[str, Any]
) -> None:
    """kafka-python refuses it (delivery_timeout_ms >= linger_ms + request_timeout_ms)."""
    with pytest.raises(ConfigurationError, match="delivery_timeout must be at least"):
        ProducerConfig(delivery_timeout=delivery_timeout, extra=extra)
