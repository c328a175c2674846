"""`milpa-sessions worker` and `scheduler` refuse to start while a rebuild that cleared the
projections has not finished (the worker would fold new events onto a half-built projection, the
scheduler read due-work indexes not yet refilled); each starts once the rebuild has."""

from __future__ import annotations

from typing import Any

import pytest
from click.testing import CliRunner

import processors.app
import processors.scheduler_app
from milpa_sessions import wiring
from milpa_sessions.cli import main
from milpa_sessions.failures import EXIT_FAILED
from producers.settings import StackSettings
from projections.redis_store import RedisProjectionStore
from tests.unit.processors.test_replay_mark import DictRedis

ENV = {
    "MILPA_KAFKA_BOOTSTRAP": "127.0.0.1:1",
    "MILPA_REDIS_URL": "redis://127.0.0.1:1/0",
    "MILPA_REDIS_PREFIX": "ms",
}


class _StartedError(Exception):
    """The worker got as far as making its app."""


@pytest.fixture
def redis(monkeypatch: pytest.MonkeyPatch) -> DictRedis:
    fake = DictRedis()
    fake.close = lambda: None  # type: ignore[attr-defined]

    def store(settings: StackSettings) -> RedisProjectionStore:
        return RedisProjectionStore(fake, settings.redis_keys(), follow=False)  # type: ignore[arg-type]

    def create_app(*args: Any, **kwargs: Any) -> None:
        raise _StartedError

    monkeypatch.setattr(wiring, "wait_for_stack", lambda settings, starting: None)
    monkeypatch.setattr(wiring, "projection_store", store)
    monkeypatch.setattr(processors.app, "create_app", create_app)
    monkeypatch.setattr(processors.scheduler_app, "create_scheduler_app", create_app)
    return fake


@pytest.mark.parametrize(
    ("command", "why"),
    [
        ("worker", "half-built projection"),
        ("scheduler", "due-work indexes the rebuild has not refilled"),
    ],
)
def test_a_folding_process_refuses_to_start_on_a_half_built_projection(
    redis: DictRedis, command: str, why: str
) -> None:
    redis.data["ms:rebuild-incomplete"] = "2026-03-01T10:00:00+00:00 replay --full"
    result = CliRunner().invoke(main, [command], env=ENV)
    assert result.exit_code == EXIT_FAILED, result.output
    line = " ".join(result.output.split())
    assert "RebuildIncompleteError" in line
    assert "`milpa-sessions replay --full`) began at 2026-03-01T10:00:00+00:00" in line
    assert "ms:rebuild-incomplete is set" in line
    assert "run `milpa-sessions replay --full` again" in line
    assert why in line


@pytest.mark.parametrize("command", ["worker", "scheduler"])
def test_it_starts_once_the_rebuild_finished(redis: DictRedis, command: str) -> None:
    result = CliRunner().invoke(main, [command], env=ENV)
    assert isinstance(result.exception, _StartedError), result.output


@pytest.mark.parametrize("command", ["worker", "scheduler"])
@pytest.mark.parametrize(
    ("setting", "value"), [("MILPA_STALL_S", "1"), ("MILPA_PARK_RETRY_S", "0")]
)
def test_a_bad_setting_is_refused_before_the_wait_for_the_stack(
    monkeypatch: pytest.MonkeyPatch, command: str, setting: str, value: str
) -> None:
    def wait(*args: Any) -> None:
        raise AssertionError("waited for Kafka and Redis with a setting it will refuse")

    monkeypatch.setattr(wiring, "wait_for_stack", wait)
    result = CliRunner().invoke(main, [command], env={**ENV, setting: value})
    assert result.exit_code != 0 and setting in result.output, result.output
