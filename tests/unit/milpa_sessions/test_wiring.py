"""`milpa_sessions.wiring` paths that need no broker."""

from __future__ import annotations

import pytest

from milpa_sessions.wiring import session_store, take_snapshots
from producers.kafka_log import KafkaEventLog
from producers.settings import StackSettings, WriterSettings
from schemas.errors import ConfigurationError


def test_snapshots_of_nothing_applied_ask_no_broker() -> None:
    # Nothing listens on port 9: asking the broker anything would raise LogError.
    settings = StackSettings(kafka_bootstrap="127.0.0.1:9", kafka_timeout=1.0)
    assert take_snapshots(settings, {}, trust="any") == 0


def test_a_writer_s_appends_wait_for_the_delivery_time_out_it_is_given() -> None:
    store = session_store(WriterSettings(delivery_timeout=40.0))
    assert isinstance(store.log, KafkaEventLog)
    assert store.log.config.delivery_timeout == 40.0
    assert store.log.config.ack_timeout > 40.0  # it waits past it: kafka-python gave up first
    default = session_store(WriterSettings()).log
    assert isinstance(default, KafkaEventLog) and default.config.delivery_timeout == 120.0


def test_a_delivery_time_out_shorter_than_a_request_is_a_setting_error() -> None:
    with pytest.raises(ConfigurationError, match=r"MILPA_DELIVERY_TIMEOUT=1\.0"):
        session_store(WriterSettings(delivery_timeout=1.0))
