"""The consume-only ceiling: how fast one process fetches and decodes the pre-filled topic with
no fold and no Redis, the reference the projector's throughput is read against."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from aiokafka import AIOKafkaConsumer, TopicPartition

from bench.figures.common import Run
from bench.stats import rate
from schemas.codec import EventCodec
from session_model.intake import Intake


def consume_ceiling(run: Run) -> float | None:
    """Events/s of fetch + decode (the worker's `Intake.admit`) over the whole pre-filled topic,
    in the harness process (idle otherwise), one aiokafka consumer on every partition."""
    prefill = run.prefilled()
    settings = prefill.settings
    count, seconds, cpu = asyncio.run(_consume(settings, len(prefill.events)))
    value = rate(count, seconds)
    run.log(f"consume-only ceiling: {count} events in {seconds:.2f}s ({value:.0f} events/s)")
    run.put(
        "consume_only_ceiling_events_per_s",
        value,
        "events/s",
        params={
            "events": count,
            "seconds": seconds,
            "what": "an aiokafka consumer (no group) fetching every partition of the pre-filled "
            "topic from the start, each record admitted by session_model.intake.Intake (decode "
            "and validate, as the worker does); no fold, no Redis",
            "harness_cpu_pct": cpu,
        },
    )
    return value


async def _consume(settings: Any, expected: int) -> tuple[int, float, float]:
    topic = settings.events_topic
    consumer = AIOKafkaConsumer(
        **settings.kafka_access().aiokafka(),
        group_id=None,
        enable_auto_commit=False,
        auto_offset_reset="earliest",
        max_partition_fetch_bytes=8 * 1024 * 1024,
        fetch_max_bytes=64 * 1024 * 1024,
    )
    await consumer.start()
    try:
        if topic not in await consumer.topics():  # before subscribing: never create it
            raise RuntimeError(f"the pre-filled topic {topic} does not exist")
        consumer.subscribe([topic])  # without a group: every partition (as replay finds them)
        while not consumer.assignment():
            await asyncio.sleep(0.01)
        partitions = sorted(tp.partition for tp in consumer.assignment())
        consumer.unsubscribe()
        tps = [TopicPartition(topic, p) for p in partitions]
        consumer.assign(tps)
        await consumer.seek_to_beginning(*tps)
        intake = Intake(EventCodec(), len(partitions))
        admit = intake.admit
        count = 0
        cpu0, t0 = time.process_time(), time.perf_counter()
        deadline = t0 + 300
        while count < expected and time.perf_counter() < deadline:
            batches = await consumer.getmany(timeout_ms=500, max_records=4_000)
            for records in batches.values():
                for r in records:
                    admit(r.key, r.value, r.partition, r.offset)
                count += len(records)
        seconds = time.perf_counter() - t0
        cpu = 100 * (time.process_time() - cpu0) / seconds if seconds else 0.0
        return count, seconds, round(cpu, 1)
    finally:
        await consumer.stop()
