"""The scheduler as a process of its own: polls the projector's indexes, emits what is due.

Why a separate process: inside a worker the scheduler shares one event loop, one GIL and one
garbage collector with batch folding, so a closing waits for the batch (and the collection) in
progress — that is what kept expiry lateness p99 far above 10 ms under load (docs/PERFORMANCE.md).
Alone, the process is idle between deadlines and wakes on time.

It reads the per-partition deadline and compaction-due indexes the projector maintains (never a
scan of all sessions), a window `horizon` ahead, every `poll_interval`; it sleeps until the next
deadline in between. A deadline set less than one poll interval before it is due is found by the
next poll, so it can be up to `poll_interval` late; deadlines are normally minutes away. Replicas
need no coordination: their closings share deterministic event ids and the fold ignores a second
closing or an older compaction. Workers then run with `MILPA_SCHEDULER_ENABLED=false`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import faust
import redis
import redis.asyncio as aioredis
from faust.app.base import BootStrategy

from processors.app import TopicSink, raw_topic, serve_metrics
from processors.keys import Keys
from processors.redis_client import async_client
from processors.redis_store import AsyncRedisProjectionStore
from processors.scheduler import Scheduler
from producers.settings import Settings
from schemas.errors import ProjectionError
from session_model.compaction import Compactor

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class SchedulerApp:
    """The Faust app (producer only) and its scheduler."""

    app: Any
    scheduler: Scheduler


# KEYS: a partition's deadlines zset and compaction-due set. ARGV: until (epoch ms).
# A flat reply (member, score, member, score, …) that the caller pairs itself: redis-py's
# per-pair conversion of ZRANGEBYSCORE … WITHSCORES was most of a poll's time on the event loop.
DUE_SCRIPT = """
return {redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', ARGV[1], 'WITHSCORES'),
        redis.call('SMEMBERS', KEYS[2])}
"""


async def due_within(
    client: aioredis.Redis, keys: Keys, partitions: Iterable[int], until_ms: int
) -> tuple[dict[str, tuple[int, int]], dict[str, int]]:
    """Deadlines up to `until_ms` and the compaction-due sessions of these partitions (one trip)."""
    owned = sorted(partitions)
    script = client.register_script(DUE_SCRIPT)
    try:
        pipe = client.pipeline(transaction=False)
        for p in owned:
            await script(
                keys=[keys.deadlines(p), keys.compaction_due(p)], args=[until_ms], client=pipe
            )
        replies = await pipe.execute()
    except redis.RedisError as e:
        raise ProjectionError(f"reading due work failed: {e}") from e
    deadlines: dict[str, tuple[int, int]] = {}
    due: dict[str, int] = {}
    for p, (flat, members) in zip(owned, replies, strict=True):
        pairs = iter(flat)
        for member, score in zip(pairs, pairs, strict=True):
            deadlines[_text(member)] = (int(score), p)
        for member in members:
            due[_text(member)] = p
    return deadlines, due


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def create_scheduler_app(
    settings: Settings, *, poll_interval: float = 0.1, horizon: float = 1.0
) -> SchedulerApp:
    """Build the standalone scheduler for every partition of the events topic."""
    app = faust.App(
        f"{settings.consumer_group}-scheduler",
        broker=f"kafka://{settings.kafka_bootstrap}",
        web_enabled=False,
        autodiscover=False,
        store="memory://",
        producer_acks=-1,
    )
    # Producer only: it consumes nothing, so it joins no consumer group.
    app.boot_strategy = BootStrategy(app, enable_kafka_consumer=False)
    events = TopicSink(raw_topic(app, settings.events_topic, settings.partitions))
    keys = Keys(settings.redis_prefix)
    holder: dict[str, Any] = {}

    def client() -> aioredis.Redis:
        # redis.asyncio clients belong to the loop they were created in: create it in the app's.
        if "client" not in holder:
            holder["client"] = async_client(settings.redis_url)
        result: aioredis.Redis = holder["client"]
        return result

    async def states(session_ids: Any) -> Any:
        # The scheduler never folds: it needs the question and the turns, not the event ids.
        store = AsyncRedisProjectionStore(client(), keys)
        return await store.folded(session_ids, event_ids=False)

    async def full_index(partitions: Iterable[int]) -> Any:
        return await due_within(client(), keys, partitions, 2**62)

    compactor = Compactor(settings.compactor_max_turns, settings.compactor_keep_recent)
    scheduler = Scheduler(states, full_index, events, compactor)
    partitions = range(settings.partitions)

    @app.task  # type: ignore[untyped-decorator]
    async def poll() -> None:
        scheduler.owned = set(partitions)
        while True:
            try:
                until = int((time.time() + horizon) * 1000)
                deadlines, due = await due_within(client(), keys, partitions, until)
                await scheduler.prepare(deadlines, due)
            except ProjectionError as e:
                log.error("%s; polling again in %.1fs", e, poll_interval)
            await asyncio.sleep(poll_interval)

    @app.task  # type: ignore[untyped-decorator]
    async def run() -> None:
        await scheduler.run()

    if settings.metrics_port > 0:
        serve_metrics(app, settings.metrics_port, lambda: None, lambda: scheduler.stats, dict)
    return SchedulerApp(app, scheduler)
