"""The Redis clients: hiredis packing, URLs shown without secrets, drivers' errors wrapped."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from redis.asyncio.cluster import NodesManager as AsyncNodesManager
from redis.asyncio.connection import Connection
from redis.cluster import NodesManager as SyncNodesManager
from redis.connection import Connection as SyncConnection
from redis.exceptions import DataError, RedisClusterUnreachableError

from projections.keys import Keys
from projections.redis_client import (
    UNREADABLE_URL,
    HiredisConnection,
    HiredisSSLConnection,
    HiredisUnixConnection,
    async_client,
    redacted,
    sync_client,
)
from projections.requests import execute_async, generations
from schemas.errors import ConfigurationError, ProjectionError

COMMANDS: list[tuple[Any, ...]] = [
    ("PING",),
    ("SCRIPT LOAD", "return 1"),
    (b"CONFIG GET", b"maxmemory"),
    ("EVALSHA", "a" * 40, 2, "ms:{s:é}:state", "k2", "", b"\x00\xff" * 200, 0, -7, 12345678901),
    ("HSET", "h", "f", 1.5, "g", "ünïcödé ✓"),
    ("SET", "k", memoryview(b"view")),
    ("SET", "big", b"x" * 100_000),
]


def _python(commands: list[tuple[Any, ...]]) -> bytes:
    return b"".join(Connection().pack_commands(commands))


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: str(c[0]))
def test_one_command_is_packed_byte_for_byte_as_redis_py_does(command: tuple[Any, ...]) -> None:
    assert b"".join(HiredisConnection().pack_command(*command)) == b"".join(
        Connection().pack_command(*command)
    )


def test_a_pipeline_is_one_buffer_equal_to_redis_pys() -> None:
    packed = HiredisConnection().pack_commands(COMMANDS)
    assert len(packed) == 1
    assert packed[0] == _python(COMMANDS)


def test_an_unpackable_argument_is_a_data_error() -> None:
    with pytest.raises(DataError):
        HiredisConnection().pack_command("SET", "k", object())


@pytest.mark.parametrize(
    ("url", "cls"),
    [
        ("redis://127.0.0.1:6379/0", HiredisConnection),
        ("rediss://127.0.0.1:6380/0", HiredisSSLConnection),
        ("unix:///tmp/redis.sock", HiredisUnixConnection),
    ],
)
def test_the_client_uses_the_packing_connection_for_each_scheme(url: str, cls: type) -> None:
    client = async_client(url)
    assert client.connection_pool.connection_class is cls


def test_the_url_options_are_kept() -> None:
    client = async_client("redis://user:secret@127.0.0.1:6390/3?socket_timeout=2")
    kwargs = client.connection_pool.connection_kwargs
    assert (kwargs["host"], kwargs["port"], kwargs["db"]) == ("127.0.0.1", 6390, 3)
    assert (kwargs["username"], kwargs["password"], kwargs["socket_timeout"]) == (
        "user",
        "secret",
        2,
    )


def test_an_unsupported_scheme_is_refused() -> None:
    with pytest.raises(ConfigurationError, match="redis://"):
        async_client("http://127.0.0.1:6379")


def test_messages_show_a_redis_url_without_its_password() -> None:
    assert redacted("redis://u:secret@h:1/0") == "redis://u:***@h:1/0"
    assert redacted("redis://h:1/0") == "redis://h:1/0"


@pytest.mark.parametrize("url", ["redis://127.0.0.1:6379/0", "rediss://127.0.0.1:6380/0"])
def test_a_synchronous_clients_connections_pack_byte_for_byte_as_redis_pys(url: str) -> None:
    """Packed by hiredis without redis-py's per-argument encoding (a rebuild's commits)."""
    connection = sync_client(url).connection_pool.make_connection()
    plain = SyncConnection()
    assert b"".join(connection.pack_commands(COMMANDS)) == b"".join(plain.pack_commands(COMMANDS))
    for command in COMMANDS:
        assert connection.pack_command(*command) == [b"".join(plain.pack_command(*command))]
    with pytest.raises(DataError):
        connection.pack_command("SET", "k", object())


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("unix:///run/redis.sock?db=0&password=s3cret", "unix:///run/redis.sock?db=0&password=***"),
        ("unix://:s3cret@/run/redis.sock", "unix://:***@/run/redis.sock"),
        ("redis://h:1/0?pass%77ord=s3cret&db=1", "redis://h:1/0?pass%77ord=***&db=1"),
        ("redis://u:s3cret@h:1/0?password=s3cret", "redis://u:***@h:1/0?password=***"),
        ("redis://h:1/0?password=s3c&ret", "redis://h:1/0?password=***&***"),
        ("redis://h:1/0#s3cret", "redis://h:1/0#***"),
    ],
)
def test_a_password_in_the_query_is_hidden_too(url: str, shown: str) -> None:
    """redis-py honours `?password=` (its docs give it for unix:// sockets)."""
    assert redacted(url) == shown


@pytest.mark.parametrize(
    "url",
    [
        "redis://:s3cret@[::1",  # urllib raises ValueError
        "redis://:s3cr\u2100t@h:1",  # urllib raises ValueError, quoting the password
        "redis://:s3/cret@h:1/0",  # the authority ends at the password's "/"
        "redis://:s3#cret@h:1/0",
        "redis://:s3?cret@h:1/0",
        "redis://:s3?password=cret@h:1/0",  # the "@" after a query part named password
    ],
)
def test_a_url_that_does_not_parse_is_shown_as_a_placeholder(url: str) -> None:
    assert redacted(url) == UNREADABLE_URL


@pytest.mark.parametrize("url", ["redis://:s3cret@[::1", "redis://:s3cret/x@h:1/0"])
def test_a_client_for_a_url_that_does_not_parse_is_a_configuration_error(url: str) -> None:
    for make in (sync_client, async_client):
        with pytest.raises(ConfigurationError) as raised:
            make(url)
        assert "s3cret" not in str(raised.value)
        assert UNREADABLE_URL in str(raised.value)


def test_redacted_never_raises() -> None:
    assert redacted(None) == UNREADABLE_URL  # type: ignore[arg-type]


def _no_node_answers(monkeypatch: pytest.MonkeyPatch, manager: type) -> None:
    def initialize(self: object, *args: object, **kwargs: object) -> None:
        raise RedisClusterUnreachableError("Redis Cluster cannot be connected: Error 111")

    monkeypatch.setattr(manager, "initialize", initialize)


def test_a_cluster_client_no_node_answers_is_a_projection_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """redis-py's synchronous cluster client connects as it is made; its error is no
    `RedisError`."""
    _no_node_answers(monkeypatch, SyncNodesManager)
    with pytest.raises(ProjectionError, match="cannot be connected") as raised:
        sync_client("redis://:s3cret@127.0.0.1:7000", 0.1, cluster=True)
    assert isinstance(raised.value.__cause__, RedisClusterUnreachableError)
    assert "s3cret" not in str(raised.value)


def test_an_asyncio_cluster_clients_first_request_no_node_answers_is_a_projection_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The asyncio cluster client connects on its first command (`execute_async`'s)."""
    _no_node_answers(monkeypatch, AsyncNodesManager)
    client = async_client("redis://127.0.0.1:7000", 0.1, cluster=True)
    request = generations(Keys("ms", partitions=2))
    with pytest.raises(ProjectionError, match="cannot be connected"):
        asyncio.run(execute_async(client, request))


@pytest.mark.parametrize("url", ["unix:///run/redis.sock", "redis://127.0.0.1:7000/3"])
def test_a_url_a_cluster_client_cannot_use_is_a_configuration_error(url: str) -> None:
    for make in (sync_client, async_client):
        with pytest.raises(ConfigurationError, match="Redis Cluster"):
            make(url, cluster=True)


def test_an_asyncio_cluster_client_that_redis_py_refuses_is_a_configuration_error() -> None:
    """Made without connecting: what it refuses (here: no host to start from) is the settings."""
    with pytest.raises(ConfigurationError, match="at least one node"):
        async_client("redis://:7000", cluster=True)
