"""Composing settings into the real adapters (the only place that knows all of them)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from processors.health import Starting, checked_stall
from processors.running import wait_for
from processors.settings import WorkerSettings
from producers.kafka_log import KafkaEventLog, ProducerConfig
from producers.settings import StackSettings, WriterSettings
from producers.store import SessionStore
from projections.analytics import Analytics
from projections.redis_client import REDIS_ERRORS, redacted
from projections.redis_store import RedisProjectionStore
from projections.requests import Retention
from projections.sign_ins import RedisSignInFailures
from projections.sign_outs import RedisSignOuts
from schemas.errors import ConfigurationError, ProjectionError, RebuildIncompleteError
from schemas.secret_files import check_owner_writes
from session_model.authority import Cutover
from session_model.signing import Signer, TrustedKeys

if TYPE_CHECKING:
    from console.app import ConsoleDeps
    from processors.metrics import Endpoint


def trusted_keys(settings: StackSettings) -> TrustedKeys:
    """The answering keys the fold trusts: every `*.pem` public key in `trusted_keys_dir`."""
    directory = settings.trusted_keys_dir
    if directory is None:
        return TrustedKeys.none()
    if not directory.is_dir():
        raise ConfigurationError(f"trusted keys directory {directory} does not exist")
    check_owner_writes(directory, "trusted keys directory")  # whoever adds a key is an operator
    return TrustedKeys.from_pem_files(sorted(directory.glob("*.pem")))


def signer(settings: WriterSettings) -> Signer | None:
    """The answering key of this surface, if configured (its file stem is the key id)."""
    path: Path | None = settings.signing_key
    return Signer.from_pem_file(path) if path is not None else None


def projection_store(settings: StackSettings) -> RedisProjectionStore:
    """The Redis projection store under the configured key prefix."""
    return RedisProjectionStore(
        settings.redis_sync(),
        settings.redis_keys(),
        compact_after=settings.compactor_max_turns,
        durability=settings.durability(),
    )


def projection_store_for_rebuild(settings: StackSettings) -> RedisProjectionStore:
    """The projection store a rebuild writes: tracking sessions for snapshots when they are
    taken (as the workers' commits do) and indexing ended sessions for retention."""
    return dataclasses.replace(
        projection_store(settings),
        retention=Retention.after(settings.projection_ttl_s),
        track=settings.snapshot_interval_s > 0,
    )


def check_rebuild_finished(settings: StackSettings, *, why: str) -> None:
    """Raise `RebuildIncompleteError` if a rebuild cleared the projections and did not finish
    (one GET): neither a worker nor a scheduler may start on what it left; `why` says what
    starting now would do."""
    store = projection_store(settings)
    try:
        found = store.incomplete_rebuild()
    finally:
        store.close()
    if found is not None:
        began, what = found
        raise RebuildIncompleteError(
            f"a rebuild (`milpa-sessions {what}`) began at {began} and did not finish "
            f"({store.keys.rebuild_incomplete()} is set): run `milpa-sessions {what}` again; "
            f"{why}"
        )


def take_snapshots(settings: StackSettings, applied: Mapping[int, int], trust: str) -> int:
    """Snapshot every session of these partitions, applied through these offsets under `trust`
    (after a rebuild, with no worker running: its `ReplayReport.trust`), and write their
    checkpoints; the snapshots written."""

    # Imported here: aiokafka is start-up time that the CLI's readers and writers, each a process
    # of its own, need not pay.
    from processors.replay import end_offsets  # noqa: PLC0415
    from processors.sinks import FencedSnapshotSink  # noqa: PLC0415
    from processors.snapshots import snapshot_partitions  # noqa: PLC0415
    from projections.redis_store import AsyncRedisProjectionStore  # noqa: PLC0415

    if not applied:
        return 0  # nothing was applied (an empty topic): nothing to cover, no broker to ask
    # A missing topic fails here at once (LogError), not after the writer's start-up timeout.
    end_offsets(settings.kafka_access(), settings.snapshots_topic)
    # Where a session's keys live depends on the events topic's partition count: the topic's, as
    # the rebuild and the workers use it, whatever MILPA_PARTITIONS says (a setting that
    # disagrees would read empty indexes and checkpoint partitions with nothing snapshotted).
    _, partitions = end_offsets(settings.kafka_access(), settings.events_topic)
    keys = dataclasses.replace(settings.redis_keys(), partitions=partitions)

    async def run() -> int:
        client = settings.redis_async()
        store = AsyncRedisProjectionStore(
            client,
            keys,
            settings.compactor_max_turns,
            track=True,
            durability=settings.durability(),
        )
        try:
            sink = FencedSnapshotSink(settings.kafka_access(), settings.snapshots_topic)
            return await snapshot_partitions(store, sink, applied, trust=trust)
        finally:
            await client.aclose()

    return asyncio.run(run())


def session_store(settings: WriterSettings, *, producer: str | None = None) -> SessionStore:
    """A `SessionStore` writing to Kafka and reading the Redis projections."""
    id_key, key = settings.id_key(), signer(settings)  # read before a connection is made
    try:
        config = ProducerConfig(
            max_block=settings.kafka_timeout, delivery_timeout=settings.delivery_timeout
        )
    except ConfigurationError as e:
        raise ConfigurationError(
            f"MILPA_KAFKA_TIMEOUT={settings.kafka_timeout}, "
            f"MILPA_DELIVERY_TIMEOUT={settings.delivery_timeout}: {e}"
        ) from e
    log = KafkaEventLog(
        settings.kafka_access(),
        settings.events_topic,
        client_id=producer or settings.producer_id,
        config=config,
    )
    return SessionStore(
        log,
        projection_store(settings),
        producer=producer or settings.producer_id,
        signer=key,
        start_mode=settings.start_mode(),
        read_timeout=settings.read_timeout,
        id_key=id_key,
    )


CONSOLE_PRODUCER = "operator-console"


def console_deps(settings: WriterSettings) -> ConsoleDeps:
    """The web console's adapters: it writes as an operator, reads the waiting index and the
    analytics, and relays the questions feed live."""
    # Imported here: FastAPI costs every other command a second of start-up on a slow core.
    from console.app import ConsoleDeps  # noqa: PLC0415
    from processors.feed import follow_questions  # noqa: PLC0415

    store = session_store(settings, producer=CONSOLE_PRODUCER)
    access, topic = settings.kafka_access(), settings.questions_topic
    return ConsoleDeps(
        store=store,
        index=projection_store(settings),
        analytics=Analytics(settings.redis_sync(), settings.redis_keys()),
        source=lambda: follow_questions(access, topic),
        sign_outs=RedisSignOuts(settings.redis_sync(), settings.redis_keys()),
        sign_in_failures=RedisSignInFailures(settings.redis_sync(), settings.redis_keys()),
    )


def ping_redis(settings: StackSettings) -> None:
    """Raise `ProjectionError` unless Redis answers a PING within the configured timeout."""
    try:
        client = settings.redis_sync()  # a Redis Cluster client connects as it is made
        try:
            client.ping()
        finally:
            client.close()
    except REDIS_ERRORS as e:
        raise ProjectionError(f"{type(e).__name__}: {e}") from e


def checked_cutover(settings: StackSettings) -> Cutover:
    """The configured cut-over, once the events topic is the one its offsets were read from.

    Raises `ConfigurationError` when it names no topic id or another topic's (the events topic
    was recreated or mirrored: its first records are not the legacy ones, and believing their
    unsigned authority would let an agent's grant through).
    """
    # An admin client, only when a cut-over is set.
    from producers.topics import topic_id  # noqa: PLC0415
    from session_model.authority import kafka_form, parse_topic_id  # noqa: PLC0415

    cutover = settings.cutover()
    if not cutover.before:
        return cutover
    topic = settings.events_topic
    actual = topic_id(settings, topic)
    offsets = ",".join(f"{p}:{o}" for p, o in sorted(cutover.before.items()))
    if cutover.topic_id is None:
        raise ConfigurationError(
            "MILPA_AUTHORITY_CUTOVER names no topic: offsets mean something only in the topic "
            f"they were read from. If they were read from {topic} as it is now (id "
            f"{kafka_form(actual)}), set MILPA_AUTHORITY_CUTOVER={kafka_form(actual)}@{offsets}"
        )
    try:
        named = parse_topic_id(cutover.topic_id)
    except ValueError as e:
        raise ConfigurationError(f"MILPA_AUTHORITY_CUTOVER: {e}") from e
    if named != actual:
        raise ConfigurationError(
            f"MILPA_AUTHORITY_CUTOVER was read from topic id {cutover.topic_id}, but {topic} is "
            f"{kafka_form(actual)} now (recreated or mirrored): its records before those offsets "
            "are not the legacy ones. Set the cut-over anew for this topic, or leave it empty"
        )
    return cutover


def wait_for_stack(settings: WorkerSettings, starting: Starting | None = None) -> None:
    """Block until Kafka (the project's topics exist) and Redis answer, with backoff.

    For long-running processes started before their services: a status line every
    `startup_status_every` seconds; `startup_timeout` > 0 gives up with the last error.
    `starting` (the start-up's health verdicts) is told what is waited for, and when it ends.
    """
    from producers.topics import ensure_topics  # noqa: PLC0415 - only the long-running need it

    kafka = f"Kafka at {settings.kafka_bootstrap}"
    redis_ = f"Redis at {redacted(settings.redis_url)}"
    if starting is not None:
        starting.waiting_for(kafka)
    with _quiet("kafka"):
        wait_for(
            kafka,
            lambda: ensure_topics(settings, timeout_ms=int(settings.kafka_timeout * 1000)),
            timeout=settings.startup_timeout,
            status_every=settings.startup_status_every,
        )
    if starting is not None:
        starting.waiting_for(redis_)
    wait_for(
        redis_,
        lambda: ping_redis(settings),
        timeout=settings.startup_timeout,
        status_every=settings.startup_status_every,
    )
    if starting is not None:
        starting.waited()


def check_worker_settings(settings: WorkerSettings) -> None:
    """The long-running processes' settings that the app checks, checked before the start-up
    wait for Kafka and Redis (which may last for ever): ConfigurationError."""
    settings.cache_limit()
    settings.park_retry()
    checked_stall(settings.stall_s)


def serve_while_starting(settings: WorkerSettings) -> tuple[Endpoint | None, Starting | None]:
    """The health endpoints on the metrics port from now on (`/livez` alive while the process
    waits for Kafka and Redis, `/readyz` not ready), for the app to take over; none without a
    metrics port."""
    from processors.metrics import serve_starting  # noqa: PLC0415 - only the long-running need it

    if settings.metrics_port <= 0:
        return None, None
    starting = Starting()
    return serve_starting(settings.metrics_port, settings.metrics_host, starting), starting


@contextlib.contextmanager
def _quiet(name: str) -> Iterator[None]:
    """Silence a client library's own logging while the caller reports its failures."""
    logger = logging.getLogger(name)
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(level)
