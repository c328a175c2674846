"""The Faust application: batch delivery of `sessions.events` to `ProjectionWorker`.

`BatchApp` (processors/batch_consumer.py) hands each fetched batch to the projector in one call
instead of Faust's per-record streams (which cap a worker below the throughput target). A batch's
offsets become committable only after the worker returned, that is after Redis holds every event
of it (or the dead-letter topic does); a parked partition's stop before the record the fold raised
on, or the first of a session whose stored state (or, for a redelivery, decisions history) does not
read (`BatchFolder.parked`; the `retry_parked` task reads the latter again from there once it
reads). Faust's
exactly-once mode is not used: at-least-once
delivery plus the marks in Redis make redeliveries no-ops. Folding a batch overlaps with committing
the previous one (the commits stay in order); a rebalance waits for both before the worker drops
its cache, for `MILPA_REVOKE_GRACE` at most: past it the worker leaves the group and ends, as
after kill -9, rather than hold up every member's rebalance. With the scheduler enabled, the app
starts the worker's timer process (`processors.timer_link`) and feeds it every committed batch's
deadlines and each new assignment; compaction stays in the app's loop (`processors.scheduler`).
With `MILPA_PROJECTION_TTL_S` the commits index ended sessions and a `RetentionSweep` in the app's
loop drops the due ones of the partitions the worker owns (whether or not it runs the scheduler).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn

import faust.auth
from faust.exceptions import ConsumerNotStarted
from faust.types import TP

from processors import running
from processors.batch_consumer import BatchApp, leave_group_supported
from processors.health import NO_TROUBLES, Heartbeat, Probe, Troubles, parked_partitions
from processors.locks import acquire_within
from processors.metrics import Endpoint, Metrics
from processors.ports import Consumed
from processors.scheduler import RetentionSweep, Scheduler, SchedulerStats, sweep_interval
from processors.settings import WorkerSettings
from processors.sinks import FencedSnapshotSink, LazyProducer, ProducerSink
from processors.snapshots import SnapshotStats, Snapshotter
from processors.timer_feed import TimerFeed
from processors.timer_link import TimerLink, combined
from processors.timer_process import TimerConfig
from processors.worker import Prepared, ProjectionWorker, WorkerStats
from producers.kafka_access import KafkaAccess
from projections.redis_store import AsyncRedisProjectionStore
from projections.requests import Retention
from session_model.authority import trust_fingerprint
from session_model.compaction import Compactor
from session_model.projection import BatchFolder, Fault
from session_model.signing import TrustedKeys

log = logging.getLogger(__name__)
LEAVE_GROUP_S = 5.0  # at most, for a stalled worker's LeaveGroup before it ends


def faust_credentials(access: KafkaAccess) -> Any:
    """Faust's credentials for this access (None on a plaintext cluster)."""
    if access.sasl:
        return faust.auth.SASLCredentials(
            username=access.username,
            password=access.password,
            ssl_context=access.ssl_context() if access.tls else None,
            mechanism=access.mechanism,
        )
    if access.tls:
        return faust.auth.SSLCredentials(access.ssl_context())
    return None


def faust_options(settings: WorkerSettings) -> dict[str, Any]:
    """The Faust configuration every app of ours shares (the worker's adds its batching)."""
    return {
        "broker": f"kafka://{settings.kafka_bootstrap}",
        "broker_credentials": faust_credentials(settings.kafka_access()),
        "web_enabled": False,
        "autodiscover": False,
        "store": "memory://",
        "topic_partitions": settings.partitions,
        "topic_replication_factor": settings.replication_factor,
        "consumer_auto_offset_reset": "earliest",
        "producer_acks": -1,
        "broker_commit_interval": settings.commit_interval,
        "stream_wait_empty": False,
    }


def raw_topic(app: Any, name: str, partitions: int | None = None) -> Any:
    """A Faust topic of raw bytes (the codec lives in the worker, not in Faust)."""
    return app.topic(
        name,
        key_type=bytes,
        value_type=bytes,
        key_serializer="raw",
        value_serializer="raw",
        partitions=partitions,
        internal=False,
    )


@dataclass(frozen=True, slots=True)
class ProjectorApp:
    """The Faust app and access to its worker (created lazily inside the event loop)."""

    app: Any
    worker: Callable[[], ProjectionWorker]
    scheduler: Callable[[], Scheduler]
    timer: TimerLink | None = None  # the closings' timer process (None: closed in the loop)


def create_app(
    settings: WorkerSettings, keys: TrustedKeys, *, endpoint: Endpoint | None = None
) -> ProjectorApp:
    """Build the Faust app for these settings (nothing connects until it runs); its metrics and
    health take over `endpoint` (the start-up's, `serve_starting`) when given one."""
    cache_limit = settings.cache_limit()  # checked now, not in the loop
    park_retry_s = settings.park_retry()
    if not leave_group_supported():
        log.warning(
            "this aiokafka has no GroupCoordinator._maybe_leave_group: a worker whose revocation "
            "stalls past MILPA_REVOKE_GRACE will end without leaving the group, and the "
            "rebalance will wait for its session timeout (pin aiokafka as pyproject.toml does)"
        )
    app = BatchApp(
        settings.consumer_group,
        **faust_options(settings),
        broker_commit_every=settings.commit_every,
        broker_max_poll_records=settings.batch_max_records,
        fetch_max_wait=settings.fetch_max_wait,
        fetch_min_bytes=settings.fetch_min_bytes,
    )
    events = raw_topic(app, settings.events_topic, settings.partitions)
    # Decisions and dead letters share a producer; closings have their own (see processors.sinks).
    output = LazyProducer(settings.kafka_access())
    deadletter = ProducerSink(output, settings.deadletter_topic)
    decisions = ProducerSink(output, settings.decisions_topic)
    questions = ProducerSink(output, settings.questions_topic)
    scheduling = LazyProducer(settings.kafka_access())
    closings = ProducerSink(scheduling, settings.events_topic)
    timer = timer_link(settings)
    holder: dict[str, Any] = {"timer": timer}
    retention = Retention.after(settings.projection_ttl_s)  # checked now, not in the loop
    durability = settings.durability()
    snapshotting = settings.snapshot_interval_s > 0
    # Snapshots have producers of their own (one per round, fenced): a round's records do not
    # queue before decisions.
    snapshot_output = (
        FencedSnapshotSink(settings.kafka_access(), settings.snapshots_topic)
        if snapshotting
        else None
    )
    folding = asyncio.Lock()  # created lazily by asyncio on first use, inside the app's loop
    # Held by a snapshot round, and by a revocation while it forgets what was applied: a round
    # never straddles a clean hand-over. Not the folding lock: the batches go on meanwhile (their
    # commits always did; a round copes with sessions committed during it), and a writer that
    # outlives a hand-over anyway (a zombie) is fenced by the next owner's (`FencedSnapshotSink`).
    snapshotting_lock = asyncio.Lock()

    def worker() -> ProjectionWorker:
        # The redis.asyncio client must be created inside the worker's running event loop.
        if "worker" not in holder:
            store = AsyncRedisProjectionStore(
                settings.redis_async(),
                settings.redis_keys(),
                settings.compactor_max_turns,
                retention,
                track=snapshotting,
                durability=durability,
            )
            folder = BatchFolder(keys, settings.start_mode(), settings.cutover(), parked={})
            w = ProjectionWorker(
                store,
                folder,
                deadletter,
                decisions,
                questions=questions,
                cache_limit=cache_limit,
            )
            w.on_park = park
            compactor = Compactor(settings.compactor_max_turns, settings.compactor_keep_recent)
            s = Scheduler(w.states, store.due_work, closings, compactor, closes=timer is None)
            w.listeners.append(s.observe)
            if timer is not None:
                feed = TimerFeed(timer, w.readable_states, store.due_work)
                w.listeners.append(feed.observe)
                timer.restarted.append(feed.replay)
                holder["feed"] = feed
            if settings.projection_ttl_s is not None:
                every = sweep_interval(settings.projection_ttl_s)
                holder["sweep"] = RetentionSweep(store.expire_due, settled_partitions, every=every)
            if snapshot_output is not None:
                snapshots = Snapshotter(
                    store,
                    snapshot_output,
                    lambda: s.owned,
                    w.stats.last_offsets.get,
                    trust=trust_fingerprint(folder.keys, folder.start_mode, folder.cutover),
                    interval_s=settings.snapshot_interval_s,
                    every_events=settings.snapshot_every,
                    guard=snapshotting_lock,
                )
                w.listeners.append(snapshots.observe)
                holder["snapshots"] = snapshots
            holder["worker"], holder["scheduler"] = w, s
        result: ProjectionWorker = holder["worker"]
        return result

    def park(partitions: Sequence[int]) -> None:
        topic = events.get_topic_name()
        app.park({TP(topic, p) for p in partitions})

    def scheduler() -> Scheduler:
        worker()
        result: Scheduler = holder["scheduler"]
        return result

    def owned_partitions() -> set[int]:
        return {
            tp.partition for tp in app.consumer.assignment() if tp.topic == events.get_topic_name()
        }

    def settled_partitions() -> dict[int, int]:
        """The owned partitions whose settled offset is known, each with it (`BatchApp.settled`);
        not a parked one, whose later records wait unapplied (its sessions are left alone)."""
        topic = events.get_topic_name()
        parked = worker().stats.parked
        offsets = {p: app.settled(TP(topic, p)) for p in scheduler().owned if p not in parked}
        return {p: offset for p, offset in offsets.items() if offset is not None}

    async def project(raws: Sequence[Consumed]) -> Awaitable[Awaitable[None]]:
        # Fold now; the consumer commits (the returned phase) while it fetches the next batch,
        # and publishes (the phase the commit returns) while it commits the next one.
        async with folding:
            prepared = await worker().prepare(raws)
        return _committing(worker(), prepared)

    app.batch_topic(events, project)

    if settings.scheduler_enabled:

        @app.task  # type: ignore[untyped-decorator]
        async def run_scheduler() -> None:
            if timer is not None:
                await timer.start()
            await scheduler().run()

    if retention is not None:

        @app.task  # type: ignore[untyped-decorator]
        async def run_retention() -> None:
            worker()
            sweep: RetentionSweep = holder["sweep"]
            await sweep.run()

    @app.task  # type: ignore[untyped-decorator]
    async def retry_parked() -> None:
        # A partition parked at a session whose state did not read goes on once it reads (an
        # operator rebuilt it), without a restart. (One the fold raised on waits for a fixed
        # worker: the same fold would raise again.) Such a session that parked nothing is read
        # again too: the scheduler and the timer feed, which left it out, hear of it rebuilt.
        topic = events.get_topic_name()

        def accept(faults: Mapping[int, Fault], tps: set[TP]) -> set[TP]:
            done = worker().unpark({tp.partition: faults[tp.partition] for tp in tps})
            return {tp for tp in tps if tp.partition in done}

        while True:
            await asyncio.sleep(park_retry_s)
            try:
                w = worker()
                since = app.rebalances()
                ready = await w.unparkable()
                if ready:
                    offsets = {TP(topic, p): f.position.offset for p, f in ready.items()}
                    await app.unpark(offsets, functools.partial(accept, ready), since=since)
                await w.reread()
                w.tell_rebuilt()
            except Exception as e:  # the batch in flight failed: the fetch loop ends on it too
                log.warning("could not read parked partitions again: %r", e)

    if snapshot_output is not None:

        @app.task  # type: ignore[untyped-decorator]
        async def run_snapshots() -> None:
            worker()
            snapshotter: Snapshotter = holder["snapshots"]
            await snapshotter.run()

    @app.on_partitions_revoked.connect
    async def on_revoked(sender: Any, /, *args: Any, signal: Any, **kwargs: Any) -> None:
        # Faust turns a failure here into a crash of the app, whose stop may then wait on the
        # batches in hand: the process ends within `shutdown_grace` in any case.
        try:
            await let_go()
        except Exception:
            running.start_watchdog(settings.shutdown_grace, "a revocation that failed")
            raise
        # (Cancelled, as by SIGTERM's stop: that stop has a watchdog of its own.)

    async def let_go() -> None:
        # The batches in hand finish (Redis, decisions) before the cache is dropped. A rebalance
        # waits for every member's revocation: past `revoke_grace` the worker stops instead.
        loop = asyncio.get_running_loop()
        deadline = loop.time() + settings.revoke_grace

        def left() -> float:
            return max(0.0, deadline - loop.time())

        # The batch in flight covers the one being folded, if any (the consumer chains it before
        # its fold): waited for without the folding lock, which that fold may still have to take.
        # (A fetch under way when Faust stopped the flow may still hand over a batch after this:
        # folded from Redis, the states being forgotten, and written by compare-and-set on the
        # sessions' marks, as any batch after a hand-over.)
        if not await app.settle_within(left()):
            await stalled("the batches being folded, committed and published")
        if not await acquire_within(folding, left()):
            await stalled("a batch being folded")
        try:
            worker().forget()
        finally:
            folding.release()
        snapshots: Snapshotter | None = holder.get("snapshots")
        if snapshots is None:
            worker().stats.last_offsets.clear()
            return
        # A round under way ends (or is cancelled, within what is left of the grace) first;
        # none starts after this. A round is safe to cancel: it commits no offset.
        async with snapshots.held(left()):
            worker().stats.last_offsets.clear()  # lag is only measured on what this worker reads

    async def stalled(what: str) -> NoReturn:
        """End the worker at once, its batches in hand unwritten, having left the group.

        Why not drop them and go on: the batch after one left unwritten was folded onto its
        states, and the records fetched after it sit past it in their partitions; a worker that
        goes on must write neither, yet its fetch positions are past both. Why not Faust's
        orderly stop: it would wait on the very batch that does not finish, and the member would
        join the rebalance it holds up before it ended (its partitions then waiting for its
        session timeout). Ended at once, as after kill -9, it commits no offset past what it
        applied, and its records are read again from the committed offsets.
        """
        message = (
            f"{what} has not finished {settings.revoke_grace:g}s after the worker's partitions "
            "were revoked (Redis or the broker refusing): the worker leaves the group and ends, "
            "so that the rebalance does not wait for it; its records are read again from the "
            "committed offsets (MILPA_REVOKE_GRACE)"
        )
        log.error("%s", message)
        worker().stats.last_offsets.clear()  # no snapshot round starts while it leaves
        await app.leave_group(LEAVE_GROUP_S)
        running.exit_now(f"{what} did not finish within MILPA_REVOKE_GRACE")

    @app.on_before_shutdown.connect
    async def stop_producers(sender: Any, /, *args: Any, **kwargs: Any) -> None:
        if timer is not None:
            feed: TimerFeed | None = holder.get("feed")
            if feed is not None:
                await feed.stop()
            await timer.stop()
        await scheduling.stop()
        try:
            # The batch being committed publishes its decisions first, if it can in time (with
            # Redis or the broker down it would retry for ever): unacknowledged, it is redelivered
            # and its decisions republished after the restart.
            # Half the grace: the rest is for stopping the clients before the watchdog's exit.
            await asyncio.wait_for(asyncio.shield(app.settle()), settings.shutdown_grace / 2)
        except Exception as e:  # shutting down: say why and go on stopping
            log.warning("stopping with a batch unfinished (redelivered on restart): %r", e)
        finally:
            await output.stop()

    @app.on_partitions_assigned.connect
    async def on_assigned(sender: Any, /, *args: Any, signal: Any, **kwargs: Any) -> None:
        # The topic's own partition count (the broker's metadata), which the partitioner used:
        # a record outside the partition its key maps to is refused, never folded.
        count = app.consumer.topic_partitions(events.get_topic_name()) or settings.partitions
        worker().set_partitions(count)
        owned = owned_partitions()
        await scheduler().assign(owned)
        if timer is not None:
            await holder["feed"].assign(owned)
        holder["assigned"] = True

    if settings.metrics_port > 0:
        _serve_worker_metrics(app, settings, holder, events.get_topic_name(), endpoint)

    return ProjectorApp(app, worker, scheduler, timer)


async def _committing(worker: ProjectionWorker, prepared: Prepared) -> Awaitable[None]:
    """A batch's commit (the consumer's second phase); its publishing (the third)."""
    _, published = await worker.commit(prepared)
    return published


def timer_link(settings: WorkerSettings) -> TimerLink | None:
    """The worker's timer process for closings, if these settings run one (started later)."""
    if not (settings.scheduler_enabled and settings.scheduler_timer_process):
        return None
    config = TimerConfig(
        settings.kafka_access(),
        settings.events_topic,
        realtime_priority=settings.scheduler_timer_realtime_priority,
        nice=settings.scheduler_timer_nice,
        stop_grace=settings.shutdown_grace / 4,
        hang_s=settings.scheduler_timer_hang_s,
    )
    return TimerLink(config)


def _serve_worker_metrics(
    app: Any,
    settings: WorkerSettings,
    holder: dict[str, Any],
    topic: str,
    endpoint: Endpoint | None = None,
) -> None:
    """Expose the worker's stats and health on the metrics address while the app runs."""

    def worker_stats() -> WorkerStats | None:
        w: ProjectionWorker | None = holder.get("worker")
        return w.stats if w is not None else None

    def scheduler_stats() -> SchedulerStats | None:
        s: Scheduler | None = holder.get("scheduler")
        timer: TimerLink | None = holder.get("timer")
        if s is None:
            return None
        return s.stats if timer is None else combined(s.stats, timer.stats())

    def highwaters() -> dict[int, int]:
        # Called from the metrics thread: only once the consumer exists and has an assignment.
        if not holder.get("assigned"):
            return {}
        found: dict[int, int] = {}
        try:
            for tp in app.consumer.assignment():
                if tp.topic == topic and (hw := app.consumer.highwater(tp)) is not None:
                    found[tp.partition] = hw
        except (ConsumerNotStarted, AssertionError, AttributeError, KeyError) as e:
            log.debug("highwaters unavailable (rebalancing?): %s", e)  # next scrape retries
        return found

    def snapshot_stats() -> SnapshotStats | None:
        taker: Snapshotter | None = holder.get("snapshots")
        return taker.stats if taker is not None else None

    def lag() -> dict[int, int]:
        # Past what is settled (finished, or committed when the partition was taken over; from
        # the start for a group that never committed one): so a batch that hangs before the
        # first one finished is seen too. Parked partitions are reported apart (`parked`).
        w: ProjectionWorker | None = holder.get("worker")
        parked = w.stats.parked if w is not None else {}
        return {
            p: max(hw - (app.settled(TP(topic, p)) or 0), 0)
            for p, hw in highwaters().items()
            if p not in parked
        }

    def progressed() -> float | None:
        w: ProjectionWorker | None = holder.get("worker")
        return w.stats.progressed_at if w is not None else None

    def assigned() -> bool:
        return bool(holder.get("assigned"))

    def parked() -> Troubles:
        w: ProjectionWorker | None = holder.get("worker")
        if w is None or not w.stats.parked:
            return NO_TROUBLES
        # Copies first (each one step under the GIL): the loop's thread changes them meanwhile.
        faults = dict(w.stats.parked)
        held = {p: tuple(s) for p, s in dict(w.stats.unreadable_held).items()}
        # Before and after `unreadable`: the loop stamps a rebuild before a session enters it
        # and drops the stamp after it leaves (`WorkerStats.rebuilding_since`).
        since = dict(w.stats.rebuilding_since)
        unreadable = set(dict(w.stats.unreadable))
        since |= w.stats.rebuilding_since
        # (One parked by a batch fetched before a rebalance may be another's now.)
        owned = {tp.partition for tp in app.consumer.assignment() if tp.topic == topic}
        faults = {p: f for p, f in faults.items() if p in owned}
        return parked_partitions(
            faults, held, unreadable, since, now=time.monotonic(), stall_s=settings.stall_s
        )

    probe = Probe(Heartbeat(), lag, progressed, assigned, settings.stall_s, troubles=parked)
    serve_metrics(
        app,
        settings.metrics_port,
        worker_stats,
        scheduler_stats,
        highwaters,
        host=settings.metrics_host,
        snapshots=snapshot_stats,
        probe=probe,
        endpoint=endpoint,
    )


def serve_metrics(
    app: Any,
    port: int,
    worker_stats: Callable[[], WorkerStats | None],
    scheduler_stats: Callable[[], SchedulerStats | None],
    highwaters: Callable[[], Mapping[int, int]],
    *,
    host: str = "127.0.0.1",
    snapshots: Callable[[], SnapshotStats | None] = lambda: None,
    probe: Probe,
    endpoint: Endpoint | None = None,
) -> None:
    """Expose these stats on `host:port/metrics`, and the probe's verdicts on `/livez` and
    `/readyz`, while the app runs (loopback by default); the app's loop stamps its heartbeat.
    With `endpoint` (the start-up's, listening there already), it is taken over."""
    metrics = Metrics(worker_stats, scheduler_stats, highwaters, snapshots, probe)

    @app.task  # type: ignore[untyped-decorator]
    async def metrics_server() -> None:
        probe.heartbeat.beat()  # the start-up before this was no silence of the loop
        metrics.serve(port, host, endpoint=endpoint)
        try:
            await probe.heartbeat.run()  # until the app stops and cancels this task
        finally:
            await asyncio.to_thread(metrics.stop)
