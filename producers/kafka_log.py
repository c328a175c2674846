"""The Kafka event log (kafka-python): Avro records keyed by session id on a partitioned topic.

Key = session id with the default murmur2 partitioner, so every Kafka client maps a session to the
same partition and its events are totally ordered. `acks=all`, idempotence on and at most five
requests in flight: retries can neither duplicate nor reorder a session's events.

An append waits until kafka-python has delivered the record or given up on it: kafka-python
retries a record until its delivery time-out at most (`ProducerConfig.delivery_timeout`, set
explicitly) and then fails it, and an append waits that long and `ACK_MARGIN` more
(`ack_timeout`). So when an append raises, kafka-python will not send the record again, and a
caller's retry (a new event) cannot be followed by the first one arriving late; except that a
produce request already on the wire when the time-out struck may still be written by the broker,
as with any Kafka client. Should kafka-python not have given up even then (its I/O thread held
up, e.g. while it renews the producer's epoch), the error says that the record is still queued
and may yet be written.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final

from producers.kafka_access import KafkaAccess
from schemas.codec import EventCodec
from schemas.errors import ConfigurationError, LogError
from schemas.events import Event
from session_model.projection import Position

if TYPE_CHECKING:
    from kafka import KafkaProducer


def _kafka_error() -> type[Exception]:
    """kafka-python's error root, imported when first needed: kafka's import costs ~0.1 s, and a
    reader's `SessionStore` holds a log it never writes to (the CLI's reading commands)."""
    from kafka.errors import KafkaError  # noqa: PLC0415

    error: type[Exception] = KafkaError
    return error


# Seconds an append waits beyond the delivery time-out: for kafka-python's I/O thread to expire
# the record (it checks when it wakes) and to complete its future.
ACK_MARGIN: Final = 10.0
_REQUEST_TIMEOUT_MS: Final = 30_000  # kafka-python's default request_timeout_ms


@dataclass(frozen=True, slots=True)
class ProducerConfig:
    """Producer tuning; the defaults favour durability, then throughput."""

    linger_ms: int = 5
    batch_size: int = 256 * 1024
    max_in_flight: int = 5
    compression_type: str | None = None
    # Seconds kafka-python may take to deliver a record, retries included, before it fails it
    # for good (its delivery_timeout_ms); an append waits for that (`ack_timeout`). At least
    # linger_ms plus the request time-out (kafka-python's request_timeout_ms, 30 s by default).
    delivery_timeout: float = 120.0
    # Seconds the bootstrap, or a send waiting for metadata or buffer room, may block.
    max_block: float = 60.0
    # kafka-python's own metric sensors: recorded on every request and response, read by nothing
    # here. Off, a producer below saturation spends 10-16 % less CPU (docs/PERFORMANCE.md).
    client_metrics: bool = False
    extra: dict[str, Any] = field(default_factory=dict)  # any other KafkaProducer options

    def __post_init__(self) -> None:
        if not self.max_block > 0:
            raise ConfigurationError(
                f"ProducerConfig.max_block must be above 0 s, not {self.max_block}"
            )
        least = (self.linger_ms + self.extra.get("request_timeout_ms", _REQUEST_TIMEOUT_MS)) / 1000
        if not self.delivery_timeout >= least:
            raise ConfigurationError(
                f"ProducerConfig.delivery_timeout must be at least {least} s (linger_ms and "
                f"request_timeout_ms), not {self.delivery_timeout}"
            )
        taken = sorted(self.extra.keys() & _SET_HERE.keys())
        if taken:
            raise ConfigurationError(
                "ProducerConfig.extra may not set "
                + ", ".join(f"{name} ({_SET_HERE[name]})" for name in taken)
            )

    @property
    def ack_timeout(self) -> float:
        """Seconds an append waits: past the delivery time-out, so kafka-python gave up first."""
        return self.delivery_timeout + ACK_MARGIN


# What `KafkaEventLog` sets itself, and why `extra` may not: the log's guarantees, or a field.
_SET_HERE = {
    "acks": "always 'all'",
    "enable_idempotence": "always on",
    "client_id": "KafkaEventLog's client_id",
    "linger_ms": "field linger_ms",
    "batch_size": "field batch_size",
    "max_in_flight_requests_per_connection": "field max_in_flight",
    "compression_type": "field compression_type",
    "delivery_timeout_ms": "field delivery_timeout",
    "max_block_ms": "field max_block",
    "bootstrap_timeout_ms": "field max_block",
    "metrics_enabled": "field client_metrics",
}


class KafkaEventLog:
    """Appends session events to Kafka; an append returns its position once acknowledged.

    The producer connects on the first append, so a reader that never writes needs no broker.
    """

    def __init__(
        self,
        bootstrap: str | KafkaAccess,
        topic: str,
        *,
        codec: EventCodec | None = None,
        config: ProducerConfig | None = None,
        client_id: str = "milpa-sessions",
    ) -> None:
        self.topic = topic
        self.access = KafkaAccess.of(bootstrap)
        self.bootstrap = self.access.bootstrap
        self.codec = codec or EventCodec()
        self.config = config or ProducerConfig()
        self.client_id = client_id
        self._client: KafkaProducer | None = None
        # Writers share one log across threads (the console's pool, the demo's agents): the
        # producer is made once, not once per thread that appends first.
        self._making = threading.Lock()
        # When the last connect failed, and why: threads that waited for it share its error.
        self._failed: tuple[float, LogError | ConfigurationError] | None = None

    @property
    def _producer(self) -> KafkaProducer:
        client = self._client
        if client is not None:
            return client
        waiting_since = time.monotonic()
        with self._making:
            if self._client is None:
                failed = self._failed
                if failed is not None and failed[0] >= waiting_since:
                    # The connect this thread waited for failed: its error, not one more connect
                    # (with Kafka down, each thread queued would otherwise wait for all ahead).
                    raise failed[1]
                try:
                    self._client = self._make_producer()
                except (LogError, ConfigurationError) as e:
                    self._failed = (time.monotonic(), e)
                    raise
            return self._client

    def _make_producer(self) -> KafkaProducer:
        from kafka import KafkaProducer  # noqa: PLC0415 - see `_kafka_error`

        c = self.config
        self.access.check_reachable(c.max_block)
        access = self.access.kafka_python()
        if c.extra.keys() & access.keys():
            raise ConfigurationError(
                "ProducerConfig.extra may not set how the producer reaches Kafka "
                f"({', '.join(sorted(c.extra.keys() & access.keys()))}: the Kafka settings)"
            )
        options: dict[str, Any] = {
            **access,
            "client_id": self.client_id,
            "acks": "all",
            "enable_idempotence": True,
            "max_in_flight_requests_per_connection": c.max_in_flight,
            "linger_ms": c.linger_ms,
            "batch_size": c.batch_size,
            "compression_type": c.compression_type,
            "delivery_timeout_ms": int(c.delivery_timeout * 1000),
            "max_block_ms": int(c.max_block * 1000),
            "bootstrap_timeout_ms": int(c.max_block * 1000),
            "metrics_enabled": c.client_metrics,
            **c.extra,
        }
        try:
            return KafkaProducer(**options)
        except _kafka_error() as e:
            raise LogError(f"cannot connect a producer to {self.bootstrap}: {e}") from e

    def send(self, event: Event) -> Any:
        """Queue one event without waiting; returns kafka-python's future (see `flush`)."""
        value = self.codec.encode(event)
        try:
            return self._producer.send(self.topic, key=event.session_id.encode(), value=value)
        except _kafka_error() as e:
            raise LogError(f"cannot send {event.type} for {event.session_id}: {e}") from e

    def append(self, event: Event) -> Position:
        """Append one event and wait for the broker's acknowledgement (see the module's docstring:
        when it raises LogError, kafka-python has given up on the record)."""
        return self._wait(self.send(event))

    def append_many(self, events: Sequence[Event]) -> list[Position]:
        """Queue every event, then wait for all acknowledgements (one linger, many records)."""
        futures = [self.send(e) for e in events]
        return [self._wait(f) for f in futures]

    def flush(self, timeout: float | None = None) -> None:
        """Wait until every queued event is acknowledged (or failed)."""
        if self._client is None:
            return
        try:
            self._producer.flush(timeout=timeout)
        except _kafka_error() as e:
            raise LogError(f"flush failed: {e}") from e

    def close(self, timeout: float | None = 10.0) -> None:
        """Flush and close the producer (if it was ever connected)."""
        if self._client is None:
            return
        try:
            self._client.close(timeout=timeout)
        except _kafka_error() as e:
            raise LogError(f"close failed: {e}") from e

    def _wait(self, future: Any) -> Position:
        wait = self.config.ack_timeout
        try:
            metadata = future.get(timeout=wait)
        except _kafka_error() as e:
            if not future.is_done:  # not given up on: kafka-python may still deliver it
                raise LogError(
                    f"an append was neither acknowledged nor failed within {wait} s: the record "
                    "is still queued and may yet be written"
                ) from e
            raise LogError(f"the broker did not acknowledge an append: {e}") from e
        return Position(metadata.partition, metadata.offset)

    def __enter__(self) -> KafkaEventLog:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
