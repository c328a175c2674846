"""A transfer of open todos re-run by another process, through Kafka, a worker and Redis.

The spec's "Writes that span two sessions": a transfer interrupted after the target got its
cards completes, when run again, without duplicating anything. The ids that make this so are
keyed (`MILPA_ID_KEY_FILE`), so that an agent cannot append under one of them first.
"""

from __future__ import annotations

import secrets
from pathlib import Path

import pytest

from milpa_sessions.settings import Settings
from milpa_sessions.wiring import session_store
from tests.integration.conftest import with_keys
from tests.unit.builders import interrupted_transfer

pytestmark = pytest.mark.integration


def test_a_transfer_rerun_by_another_process_before_the_target_folded_duplicates_nothing(
    settings: Settings, start_worker: object, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first run dies after the target's cards were sent, while no worker folds them; a
    second store (another process's, the same key file) reads the target without them and sends
    them again under the same ids, which the fold drops as duplicates: the target folds each card
    once. Without the shared key it would fold each twice."""
    key = tmp_path / "id.key"
    key.write_bytes(secrets.token_bytes(32))
    key.chmod(0o600)
    keyed = with_keys(settings, id_key_file=key, read_timeout=60.0)
    worker = start_worker(keyed)  # type: ignore[operator]
    first = session_store(keyed)
    first.start("src", "g")
    first.start("dst", "g")
    first.set_todo("src", "a", "A")
    first.set_todo("src", "b", "B", "blocked")
    assert [t.id for t in first.open_todos("src")] == ["a", "b"]  # folded
    dst_seq = first.load("dst").seq
    worker.stop()

    interrupted_transfer(first, monkeypatch, "src", "dst")
    first.close()

    second = session_store(keyed)
    try:
        assert second.load("dst").todos == ()  # the target's cards are not folded yet
        assert second.transfer_open_todos("src", "dst") == 2
        start_worker(keyed)  # type: ignore[operator]
        assert second.open_todos("src") == ()  # waits until the source's record is folded
        dst = second.load("dst")
        assert [(t.id, t.status, t.version) for t in dst.todos] == [
            ("a", "pending", 1),
            ("b", "blocked", 1),
        ]
        assert dst.seq == dst_seq + 2  # each card folded once: the resent two were duplicates
    finally:
        second.close()
