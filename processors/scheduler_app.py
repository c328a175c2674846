"""The scheduler as a process of its own: polls the projector's indexes, emits what is due.

An alternative to the default, where each worker closes its partitions' windows from a timer
process of its own (`processors.timer_process`: no event loop or GIL shared with folding). This
one needs no worker: it serves every partition, for deployments that run workers with
`MILPA_SCHEDULER_ENABLED=false`; it reads states from Redis rather than being told by the
projector, so it polls (docs/PERFORMANCE.md, "Expiry lateness").

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
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import faust
from faust.app.base import BootStrategy

from processors.app import faust_options, serve_metrics
from processors.health import Heartbeat, Probe
from processors.metrics import Endpoint
from processors.scheduler import Scheduler
from processors.settings import WorkerSettings
from processors.sinks import LazyProducer, ProducerSink
from projections.redis_store import AsyncRedisProjectionStore
from projections.said_once import SaidOnce
from schemas.errors import ProjectionError
from session_model.compaction import Compactor
from session_model.projection import Folded

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class SchedulerApp:
    """The Faust app (producer only) and its scheduler."""

    app: Any
    scheduler: Scheduler


class WholeStates:
    """The standalone scheduler's state reads: the sessions stored whole.

    A session whose stored state does not decode, or that a `replay --session` is rebuilding
    (half rebuilt), is left out, named once in the log: its deadline and due compaction wait
    (the next poll finds them again in the indexes). Before, such a session failed the whole
    read, and the deadlines read with it (a chunk of the poll's, or every one due) waited too.
    Without the event ids: the scheduler never folds, and they are most of an old session's read.
    """

    def __init__(self, store: Callable[[], AsyncRedisProjectionStore]) -> None:
        self._store = store
        self._said = SaidOnce()  # named in the log, not read whole since

    async def __call__(self, session_ids: Sequence[str]) -> dict[str, Folded]:
        """The states of these sessions, those stored whole."""
        bad: dict[str, str] = {}
        rebuilding: set[str] = set()
        found = await self._store().folded(
            session_ids, event_ids=False, unreadable=bad, rebuilding=rebuilding
        )
        said = self._said
        said.forget(found)
        for sid, why in bad.items():
            if not said.first(sid):
                continue
            if sid in rebuilding:
                log.warning("%s: its deadline and due compaction wait for it", why)
            else:
                log.error(
                    "a stored state cannot be read (%s): its deadline and due compaction wait "
                    "until it reads (rebuild it with `milpa-sessions replay --session <id> "
                    "--force`)",
                    why,
                )
        return found


def create_scheduler_app(
    settings: WorkerSettings,
    *,
    poll_interval: float = 0.1,
    horizon: float = 1.0,
    endpoint: Endpoint | None = None,
) -> SchedulerApp:
    """Build the standalone scheduler for every partition of the events topic (its metrics and
    health take over `endpoint`, the start-up's, when given one)."""
    app = faust.App(f"{settings.consumer_group}-scheduler", **faust_options(settings))
    # Producer only: it consumes nothing, so it joins no consumer group.
    app.boot_strategy = BootStrategy(app, enable_kafka_consumer=False)
    producer = LazyProducer(settings.kafka_access())
    events = ProducerSink(producer, settings.events_topic)
    keys = settings.redis_keys()
    holder: dict[str, Any] = {}

    def store() -> AsyncRedisProjectionStore:
        # redis.asyncio clients belong to the loop they were created in: create it in the app's.
        if "store" not in holder:
            holder["store"] = AsyncRedisProjectionStore(settings.redis_async(), keys)
        result: AsyncRedisProjectionStore = holder["store"]
        return result

    states = WholeStates(store)

    async def full_index(
        partitions: Iterable[int],
    ) -> tuple[dict[str, tuple[int, int]], dict[str, int]]:
        return await store().due_work(partitions)

    compactor = Compactor(settings.compactor_max_turns, settings.compactor_keep_recent)
    scheduler = Scheduler(states, full_index, events, compactor)
    partitions = range(settings.partitions)

    @app.task  # type: ignore[untyped-decorator]
    async def poll() -> None:
        scheduler.owned = set(partitions)
        while True:
            try:
                until = int((time.time() + horizon) * 1000)
                deadlines, due = await store().due_work(partitions, until)
                await scheduler.prepare(deadlines, due)
            except ProjectionError as e:
                log.error("%s; polling again in %.1fs", e, poll_interval)
            await asyncio.sleep(poll_interval)

    @app.task  # type: ignore[untyped-decorator]
    async def run() -> None:
        await scheduler.run()

    @app.on_before_shutdown.connect
    async def stop_events(sender: Any, /, *args: Any, **kwargs: Any) -> None:
        await producer.stop()

    if settings.metrics_port > 0:
        serve_metrics(
            app,
            settings.metrics_port,
            lambda: None,
            lambda: scheduler.stats,
            dict,
            host=settings.metrics_host,
            # No records of its own: alive and ready while its loop turns.
            probe=Probe(Heartbeat(), dict, lambda: None, lambda: True, settings.stall_s),
            endpoint=endpoint,
        )
    return SchedulerApp(app, scheduler)
