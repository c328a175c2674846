"""Creating topics: once `ensure_topics` returns, every client is served all their partitions."""

from __future__ import annotations

import pytest
from kafka import KafkaConsumer

from milpa_sessions.settings import Settings
from producers.topics import topic_specs

pytestmark = pytest.mark.integration


def test_new_topics_are_in_the_metadata_a_fresh_client_reads_once_ensure_topics_returns(
    settings: Settings,
) -> None:
    """The fixture created them a moment ago: no client is told they do not exist (seen in CI)."""
    specs = topic_specs(settings)
    consumer = KafkaConsumer(**settings.kafka_access().kafka_python(), enable_auto_commit=False)
    try:
        served = {s.name: consumer.partitions_for_topic(s.name) for s in specs}
    finally:
        consumer.close()
    assert served == {s.name: set(range(s.partitions)) for s in specs}
