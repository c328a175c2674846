"""`CleanGroup`: a Redis driver error an adapter did not wrap still ends a command with one line
naming Redis, its URL without secrets."""

from __future__ import annotations

import click
import pytest
from click.testing import CliRunner
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisClusterUnreachableError, SlotNotCoveredError

from milpa_sessions.failures import EXIT_FAILED, CleanGroup
from projections.redis_client import UNREADABLE_URL
from schemas.errors import CorruptProjectionError, UnknownSessionError


def _group(error: Exception) -> click.Group:
    @click.group(cls=CleanGroup)
    def main() -> None:
        pass

    @main.command()
    def fail() -> None:
        raise error

    return main


@pytest.mark.parametrize(
    "error",
    [
        RedisClusterUnreachableError("Redis Cluster cannot be connected.\nPlease provide ..."),
        SlotNotCoveredError("slot 1234 is not covered by the cluster"),
        RedisConnectionError("Error 111 connecting to 127.0.0.1:7000."),
    ],
    ids=type,
)
def test_a_redis_error_ends_a_command_with_one_line(error: Exception) -> None:
    env = {"MILPA_REDIS_URL": "unix:///run/redis.sock?password=s3cret"}
    result = CliRunner(env=env).invoke(_group(error), ["fail"])
    assert result.exit_code == EXIT_FAILED
    assert result.exception is None or isinstance(result.exception, SystemExit)
    lines = result.output.strip().splitlines()
    assert len(lines) == 1
    assert lines[0].startswith("error: Redis at unix:///run/redis.sock?password=***: ")
    assert type(error).__name__ in lines[0]
    assert "s3cret" not in result.output


def test_a_redis_url_that_does_not_parse_is_named_by_a_placeholder() -> None:
    env = {"MILPA_REDIS_URL": "redis://:s3cret@[::1"}
    result = CliRunner(env=env).invoke(_group(SlotNotCoveredError("no slot")), ["fail"])
    assert result.exit_code == EXIT_FAILED
    assert f"Redis at {UNREADABLE_URL}" in result.output
    assert "s3cret" not in result.output


def test_an_error_quoting_agent_text_prints_it_as_written() -> None:
    """A session id is the agent's: no markup, no emoji codes turned into emoji."""
    error = UnknownSessionError("no session 'deploy :x: [bold]now[/bold]'")
    result = CliRunner().invoke(_group(error), ["fail"])
    assert result.exit_code != 0
    assert "deploy :x: [bold]now[/bold]" in result.output


def test_a_damaged_session_s_error_says_a_rebuild_mends_it() -> None:
    error = CorruptProjectionError("s1: the stored state cannot be read: bad zlib")
    result = CliRunner().invoke(_group(error), ["fail"])
    assert result.exit_code == EXIT_FAILED
    (line,) = result.output.strip().splitlines()
    assert line.startswith("error: CorruptProjectionError: s1: the stored state cannot be read")
    assert line.endswith("rebuild the session with `milpa-sessions replay --session ID --force`)")
