"""`milpa_sessions.wiring` paths that need no broker."""

from __future__ import annotations

from milpa_sessions.wiring import take_snapshots
from producers.settings import StackSettings


def test_snapshots_of_nothing_applied_ask_no_broker() -> None:
    # Nothing listens on port 9: asking the broker anything would raise LogError.
    settings = StackSettings(kafka_bootstrap="127.0.0.1:9", kafka_timeout=1.0)
    assert take_snapshots(settings, {}, trust="any") == 0
