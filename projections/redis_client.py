"""The asyncio Redis client the processors use: redis-py's, with commands packed by hiredis (C).

Why: redis.asyncio packs commands in Python (the synchronous client already uses hiredis when it
is installed). The projector sends a dozen or more arguments per session of a batch (in EVALSHAs
of 64 sessions), and packing them was ~10 % of a worker's CPU in the profile (docs/PERFORMANCE.md).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import hiredis
import redis
import redis.asyncio as aioredis
from redis.asyncio.connection import (
    Connection,
    ConnectionPool,
    SSLConnection,
    UnixDomainSocketConnection,
    parse_url,
)
from redis.asyncio.retry import Retry as AsyncRetry
from redis.backoff import NoBackoff
from redis.exceptions import DataError
from redis.retry import Retry

from schemas.errors import ConfigurationError


def _pack(args: tuple[Any, ...]) -> bytes:
    # As redis-py does: a command name with spaces ("SCRIPT LOAD") is sent as separate words.
    first = args[0]
    if isinstance(first, str):
        args = (*first.encode().split(), *args[1:])
    elif b" " in first:
        args = (*first.split(), *args[1:])
    try:
        packed: bytes = hiredis.pack_command(args)
    except TypeError as e:
        raise DataError(str(e)) from e
    return packed


class _HiredisPacking:
    """Replaces the Python packer of an asyncio connection class."""

    def pack_command(self, *args: Any) -> list[bytes]:
        """One command in RESP."""
        return [_pack(args)]

    def pack_commands(self, commands: Iterable[Iterable[Any]]) -> list[bytes]:
        """A pipeline's commands in RESP, as one buffer."""
        return [b"".join(_pack(tuple(cmd)) for cmd in commands)]


class HiredisConnection(_HiredisPacking, Connection):
    """TCP."""


class HiredisSSLConnection(_HiredisPacking, SSLConnection):
    """TLS (`rediss://`)."""


class HiredisUnixConnection(_HiredisPacking, UnixDomainSocketConnection):
    """Unix socket (`unix://`)."""


_PACKING: dict[type, type] = {
    Connection: HiredisConnection,
    SSLConnection: HiredisSSLConnection,
    UnixDomainSocketConnection: HiredisUnixConnection,
}


@dataclass(frozen=True, slots=True)
class RedisAuth:
    """Credentials beyond the URL: an ACL user, its password (read from a file), a CA for TLS."""

    username: str | None = None
    password: str | None = field(default=None, repr=False)  # never printed, never logged
    ca_file: Path | None = None  # `rediss://`: the CA that signed the server's certificate

    def options(self, url: str) -> dict[str, Any]:
        """Client keyword arguments (those the URL does not already carry)."""
        options: dict[str, Any] = {}
        if self.username:
            options["username"] = self.username
        if self.password is not None:
            options["password"] = self.password
        if self.ca_file is not None:
            if not url.startswith("rediss://"):
                raise ConfigurationError("a Redis CA file needs a rediss:// URL")
            options["ssl_ca_certs"] = str(self.ca_file)
        return options


NO_AUTH = RedisAuth()


def async_client(
    url: str, timeout: float | None = None, auth: RedisAuth = NO_AUTH
) -> aioredis.Redis:
    """A `redis.asyncio` client for `url` whose connections pack commands with hiredis.

    `timeout` bounds a connect and a reply; a failed call is retried once by the client (the
    worker's own loop retries with backoff, and says so), not ten times as redis-py's default.
    """
    try:
        options: dict[str, Any] = dict(parse_url(url))
    except ValueError as e:
        raise ConfigurationError(f"Redis URL {redacted(url)}: {e}") from e
    options["connection_class"] = _PACKING[options.get("connection_class", Connection)]
    if timeout is not None:
        options["socket_timeout"] = options["socket_connect_timeout"] = timeout
    options["retry"] = AsyncRetry(NoBackoff(), 1)
    options.update(auth.options(url))
    return aioredis.Redis.from_pool(ConnectionPool(**options))


def sync_client(url: str, timeout: float | None = None, auth: RedisAuth = NO_AUTH) -> redis.Redis:
    """A synchronous client for `url`: bounded connect and reply times, no retry (a reader
    fails fast and says why; it can run again)."""
    options: dict[str, Any] = {"retry": Retry(NoBackoff(), 0), **auth.options(url)}
    if timeout is not None:
        options["socket_timeout"] = options["socket_connect_timeout"] = timeout
    try:
        return redis.Redis.from_url(url, **options)
    except ValueError as e:
        raise ConfigurationError(f"Redis URL {redacted(url)}: {e}") from e


def redacted(url: str) -> str:
    """`url` without its password, for messages and logs."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.replace(f":{parts.password}@", ":***@", 1)
    return urlunsplit(parts._replace(netloc=netloc))
