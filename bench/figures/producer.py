"""The producer figure: KafkaEventLog events/s against a naive `send().get()` loop."""

from __future__ import annotations

import time

from kafka import KafkaProducer

from bench import infra
from bench.figures.common import TARGETS, Run, produce_all
from bench.stats import rate
from producers.kafka_log import KafkaEventLog, ProducerConfig
from schemas.codec import EventCodec
from schemas.events import Event


def producer(run: Run) -> None:
    """KafkaEventLog events/s (acks=all, idempotent, keyed) vs a naive `send().get()` loop."""
    prefill = run.make_prefill()
    events = prefill.events
    config = ProducerConfig()
    cpu = run.cpu({})
    with KafkaEventLog(run.stack.kafka_bootstrap, prefill.settings.events_topic) as log:
        cpu.start()
        elapsed = produce_all(log, events)
        usage = cpu.stop()
    produced = len(events) - 1
    run.log(f"producer: {produced} events in {elapsed:.2f}s")
    n = min(run.sizes.naive_producer_events, len(events) - 1)
    naive_elapsed = _naive_producer(run, events[: n + 1])
    run.log(f"naive producer: {n} events in {naive_elapsed:.2f}s")
    run.put(
        "producer_events_per_s",
        rate(produced, elapsed),
        "events/s",
        baseline=rate(n, naive_elapsed),
        target=TARGETS["producer"],
        params={
            "processes": 1,
            "events": produced,
            "sessions": prefill.sessions,
            "mean_record_bytes": prefill.record_bytes,
            "seconds": elapsed,
            "api": "KafkaEventLog.send per event, then flush (timed: encode + send + all acks)",
            "acks": "all",
            "idempotence": True,
            "keyed": True,
            "linger_ms": config.linger_ms,
            "batch_size": config.batch_size,
            "compression": config.compression_type,
            "partitions": prefill.settings.partitions,
            "baseline": "kafka-python KafkaProducer(acks=all), keyed send(...).get() per event",
            "baseline_events": n,
            "baseline_seconds": naive_elapsed,
            **usage,
        },
    )


def _naive_producer(run: Run, events: list[Event]) -> float:
    """The baseline: the obvious loop, one acknowledged keyed send at a time (same Avro encoding).

    The first event is sent untimed; returns the seconds the others took.
    """
    naive_settings = run.settings("naiveprod")
    infra.create_topics(naive_settings, run.cleanup)
    codec = EventCodec()
    kp = KafkaProducer(bootstrap_servers=run.stack.kafka_bootstrap.split(","), acks="all")
    try:
        first = events[0]
        kp.send(
            naive_settings.events_topic, key=first.session_id.encode(), value=codec.encode(first)
        ).get(timeout=30)
        started = time.perf_counter()
        for e in events[1:]:
            kp.send(
                naive_settings.events_topic, key=e.session_id.encode(), value=codec.encode(e)
            ).get(timeout=30)
        return time.perf_counter() - started
    finally:
        kp.close(timeout=10)
