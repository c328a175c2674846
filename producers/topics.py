"""Creating the project's topics with explicit settings (never relying on auto-creation)."""

from __future__ import annotations

from dataclasses import dataclass

from kafka.admin import KafkaAdminClient, NewTopic
from kafka.errors import KafkaError, TopicAlreadyExistsError

from producers.settings import Settings
from schemas.errors import LogError


@dataclass(frozen=True, slots=True)
class TopicSpec:
    """One topic and its configuration."""

    name: str
    partitions: int
    replication_factor: int
    config: dict[str, str]


def topic_specs(settings: Settings) -> list[TopicSpec]:
    """The events topic (the record: unlimited retention), decisions, and the dead letters."""
    keep_forever = {"retention.ms": "-1", "retention.bytes": "-1", "cleanup.policy": "delete"}
    rf = settings.replication_factor
    return [
        TopicSpec(settings.events_topic, settings.partitions, rf, keep_forever),
        TopicSpec(settings.decisions_topic, settings.partitions, rf, keep_forever),
        TopicSpec(settings.deadletter_topic, 1, rf, keep_forever),
    ]


def ensure_topics(settings: Settings, timeout_ms: int = 30_000) -> dict[str, str]:
    """Create missing topics; returns `{name: "created" | "exists"}`."""
    try:
        admin = KafkaAdminClient(
            bootstrap_servers=settings.kafka_bootstrap.split(","),
            client_id=f"{settings.producer_id}-admin",
            request_timeout_ms=timeout_ms,
        )
    except KafkaError as e:
        raise LogError(f"cannot reach Kafka at {settings.kafka_bootstrap}: {e}") from e
    outcome: dict[str, str] = {}
    try:
        existing = set(admin.list_topics())
        for spec in topic_specs(settings):
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
    except KafkaError as e:
        raise LogError(f"creating topics failed: {e}") from e
    finally:
        admin.close()
    return outcome
