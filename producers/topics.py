"""Creating the project's topics with explicit settings (never relying on auto-creation).

And deleting a deployment's topics and consumer group, for the throw-away deployments of tests and
benchmarks: the events topic is the record, so nothing in the product calls `delete_topics`.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from kafka.admin import KafkaAdminClient, NewTopic
from kafka.errors import KafkaError, TopicAlreadyExistsError
from kafka.protocol.metadata import MetadataRequest

from producers.settings import StackSettings
from projections.snapshots import SNAPSHOT_MAX_BYTES
from schemas.errors import LogError
from session_model.authority import parse_topic_id

ADMIN_CLIENT_ID = "milpa-sessions-admin"

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class TopicSpec:
    """One topic and its configuration."""

    name: str
    partitions: int
    replication_factor: int
    config: dict[str, str]


# Only the latest record of a key is kept: each session's latest snapshot. A snapshot is a few
# KB to a few hundred (a session's window of turns and its state).
_COMPACTED = {
    "cleanup.policy": "compact",
    "retention.ms": "-1",
    "max.message.bytes": str(SNAPSHOT_MAX_BYTES),
    "min.cleanable.dirty.ratio": "0.5",
}


def topic_specs(settings: StackSettings) -> list[TopicSpec]:
    """The events topic (the record: unlimited retention), decisions, questions, dead letters,
    and the snapshots (compacted: each session's latest, and each partition's checkpoint)."""
    keep_forever = {"retention.ms": "-1", "retention.bytes": "-1", "cleanup.policy": "delete"}
    rf = settings.replication_factor
    specs = [
        TopicSpec(settings.events_topic, settings.partitions, rf, keep_forever),
        TopicSpec(settings.decisions_topic, settings.partitions, rf, keep_forever),
        TopicSpec(settings.questions_topic, settings.partitions, rf, keep_forever),
        TopicSpec(settings.deadletter_topic, 1, rf, keep_forever),
        # As many partitions as the events topic: a partition's snapshots go to its number.
        TopicSpec(settings.snapshots_topic, settings.partitions, rf, _COMPACTED),
    ]
    isr = settings.topic_min_insync()  # every topic: an acks=all write is on `isr` replicas
    if isr is not None:
        specs = [replace(s, config={**s.config, "min.insync.replicas": str(isr)}) for s in specs]
    return specs


def admin_client(settings: StackSettings, timeout_ms: int | None = None) -> KafkaAdminClient:
    """An admin client, bootstrapped within `kafka_timeout` (`timeout_ms`: per request)."""
    access = settings.kafka_access()
    access.check_reachable(settings.kafka_timeout)
    try:
        return KafkaAdminClient(
            **access.kafka_python(),
            client_id=ADMIN_CLIENT_ID,
            request_timeout_ms=timeout_ms or int(settings.kafka_timeout * 1000),
            bootstrap_timeout_ms=int(settings.kafka_timeout * 1000),
        )
    except KafkaError as e:
        raise LogError(f"cannot reach Kafka at {access.bootstrap}: {e}") from e


def ensure_topics(settings: StackSettings, timeout_ms: int = 30_000) -> dict[str, str]:
    """Create missing topics; returns `{name: "created" | "exists"}`."""
    admin = admin_client(settings, timeout_ms)
    outcome: dict[str, str] = {}
    try:
        existing = set(admin.list_topics())
        specs = topic_specs(settings)
        for spec in specs:
            if spec.name in existing:
                outcome[spec.name] = "exists"
                continue
            try:
                admin.create_topics(
                    [
                        NewTopic(
                            name=spec.name,
                            num_partitions=spec.partitions,
                            replication_factor=spec.replication_factor,
                            topic_configs=spec.config,
                        )
                    ],
                    timeout_ms=timeout_ms,
                )
                outcome[spec.name] = "created"
            except TopicAlreadyExistsError:
                outcome[spec.name] = "exists"
        created = {s.name: s.partitions for s in specs if outcome[s.name] == "created"}
        _wait_visible(admin, created, time.monotonic() + timeout_ms / 1000)
    except KafkaError as e:
        raise LogError(f"creating topics failed: {e}") from e
    finally:
        admin.close()
    return outcome


# What one broker's metadata says of some topics: `{name: partitions}` for those it knows whole.
Ask = Callable[[int | None, Sequence[str]], tuple[dict[str, int], tuple[int, ...]]]


def _wait_visible(admin: KafkaAdminClient, partitions: dict[str, int], deadline: float) -> None:
    """Until every broker's metadata holds every partition of these new topics (LogError if not).

    A CreateTopics answer means the controller committed the topics; each broker applies that to
    the metadata it serves a moment later, and a client that asks one in between is told the
    topic does not exist (a test's consumer was, in CI). With several brokers, asking one proves
    nothing of the others, so each is asked on its own connection.
    """
    if partitions:
        wait_for_brokers(broker_metadata(admin), partitions, deadline)


def wait_for_brokers(
    ask: Ask, partitions: Mapping[str, int], deadline: float, pause_s: float = 0.05
) -> None:
    """Ask every broker (the first answer names them) until each knows these topics whole.

    A broker that cannot be asked does not hold the wait: a client cannot reach it either, and a
    broker catches up with the metadata log before it serves again. At the deadline, a broker that
    answered without the topics is a LogError; one that only failed is logged and let go.
    """
    wanted = dict(partitions)
    _, brokers = ask(None, sorted(wanted))  # any broker: its answer lists them all
    missing = {b: set(wanted) for b in brokers}
    failed: dict[int, str] = {}
    while True:
        for broker in sorted(missing):
            try:
                known, _ = ask(broker, sorted(missing[broker]))
            except KafkaError as e:
                failed[broker] = str(e)
                continue
            failed.pop(broker, None)
            missing[broker] = {t for t in missing[broker] if known.get(t) != wanted[t]}
            if not missing[broker]:
                del missing[broker]
        if not missing:
            return
        if time.monotonic() > deadline:
            lacking = {b: sorted(ts) for b, ts in missing.items() if b not in failed}
            if lacking:
                raise LogError(f"created topics not in the brokers' metadata yet: {lacking}")
            log.warning("could not ask brokers %s for the new topics: %s", sorted(failed), failed)
            return
        time.sleep(pause_s)


def broker_metadata(admin: KafkaAdminClient) -> Ask:
    """Ask one broker (None: any) for these topics' metadata on the admin client's connections.

    kafka-python 3.0.12 has no public request to a chosen broker; its client's connection
    manager sends one (`tests/integration/test_broker_failover.py` holds it on three brokers).
    """
    manager = admin._manager  # private: see the docstring

    async def metadata(broker: int | None, topics: Sequence[str]) -> Any:
        request = MetadataRequest(
            topics=[MetadataRequest.MetadataRequestTopic(name=t) for t in topics],
            allow_auto_topic_creation=False,
        )
        return (await manager.send(request, node_id=broker)).to_dict()

    def ask(broker: int | None, topics: Sequence[str]) -> tuple[dict[str, int], tuple[int, ...]]:
        answer = manager.run(metadata, broker, topics)
        known = {t["name"]: len(t["partitions"]) for t in answer["topics"] if not t["error_code"]}
        return known, tuple(b["node_id"] for b in answer["brokers"])

    return ask


@dataclass(frozen=True, slots=True)
class GroupMember:
    """One member of a consumer group: who it is and the partitions it owns, by topic."""

    member_id: str
    client: str  # `client_id@host`
    partitions: dict[str, frozenset[int]]


@dataclass(frozen=True, slots=True)
class GroupDescription:
    """A consumer group as the coordinator describes it now."""

    state: str
    members: tuple[GroupMember, ...]


def topic_id(settings: StackSettings, topic: str) -> uuid.UUID:
    """The topic's id (KIP-516): a recreated topic of the same name has another."""
    try:
        admin = admin_client(settings)
        try:
            described = admin.describe_topics([topic])
        finally:
            admin.close()
    except KafkaError as e:
        raise LogError(f"describing topic {topic} failed: {e}") from e
    found = [t for t in described if t.get("name") == topic and not t.get("error_code")]
    if not found:
        raise LogError(f"topic {topic} does not exist")
    raw = found[0].get("topic_id")
    try:
        parsed = parse_topic_id(str(raw)) if raw is not None else None
    except ValueError:
        parsed = None
    if parsed is None or parsed.int == 0:  # Kafka's "no id" is all zeros
        raise LogError(f"the broker gives no id for topic {topic} (got {raw!r})")
    return parsed


def describe_group(settings: StackSettings, group: str | None = None) -> GroupDescription:
    """The state and members of `group` (default: the workers' group); no members if unknown."""
    group = group or settings.consumer_group
    admin = admin_client(settings)
    try:
        described = admin.describe_groups([group]).get(group)
    except KafkaError as e:
        raise LogError(f"describing group {group} failed: {e}") from e
    finally:
        admin.close()
    if described is None:
        raise LogError(f"group {group} was not described")
    error = described.get("error")
    if error and "GroupIdNotFoundError" not in str(error):
        # A coordinator loading or moving answers with no members: that is not "no workers".
        raise LogError(f"describing group {group} failed: {error}")
    members = []
    for m in described.get("members") or []:
        assignment = m.get("member_assignment") or {}
        owned: dict[str, set[int]] = {}
        for t in assignment.get("assigned_partitions") or []:
            owned.setdefault(t["topic"], set()).update(t["partitions"])
        client = f"{m.get('client_id')}@{str(m.get('client_host', '')).lstrip('/')}"
        partitions = {topic: frozenset(ps) for topic, ps in owned.items()}
        members.append(GroupMember(str(m.get("member_id", "")), client, partitions))
    return GroupDescription(str(described.get("group_state")), tuple(members))


def group_members(settings: StackSettings) -> list[str]:
    """The members of the workers' consumer group now (`client_id@host` each; empty if none)."""
    return sorted(m.client for m in describe_group(settings).members)


def delete_topics(settings: StackSettings, names: Iterable[str] | None = None) -> None:
    """Delete these settings' topics (or only `names`), their consumer group and its topics.

    For throw-away deployments (tests, benchmarks). Faust names its internal topics after the
    group, so every topic starting with the group's name goes too.
    """
    admin = admin_client(settings, 30_000)
    try:
        existing = set(admin.list_topics())
        chosen = set(names) if names is not None else {spec.name for spec in topic_specs(settings)}
        doomed = sorted(
            (chosen & existing) | {t for t in existing if t.startswith(settings.consumer_group)}
        )
        if doomed:
            admin.delete_topics(doomed, timeout_ms=30_000)
        group = settings.consumer_group
        for _ in range(10):  # a member that just left can keep the group non-empty for a moment
            try:
                outcome = admin.delete_groups([group]).get(group)
            except KafkaError as e:
                outcome = type(e).__name__
            if outcome in ("OK", "GroupIdNotFoundError", None):
                break
            time.sleep(0.5)
    except KafkaError as e:
        raise LogError(f"deleting topics failed: {e}") from e
    finally:
        admin.close()
