"""The hiredis packer sends exactly what redis-py's Python packer would."""

from __future__ import annotations

from typing import Any

import pytest
from redis.asyncio.connection import Connection
from redis.connection import Connection as SyncConnection
from redis.exceptions import DataError

from projections.redis_client import (
    HiredisConnection,
    HiredisSSLConnection,
    HiredisUnixConnection,
    async_client,
    redacted,
    sync_client,
)
from schemas.errors import ConfigurationError

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
