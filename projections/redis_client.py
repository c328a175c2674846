"""The asyncio Redis client the processors use: redis-py's, with commands packed by hiredis (C).

Why: redis.asyncio packs commands in Python (the synchronous client already uses hiredis when it
is installed). The projector sends a dozen or more arguments per session of a batch (in EVALSHAs
of 64 sessions), and packing them was ~10 % of a worker's CPU in the profile (docs/PERFORMANCE.md).
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final, cast
from urllib.parse import unquote_plus, urlsplit

import hiredis
import redis
import redis.asyncio as aioredis
from redis.asyncio.cluster import ClusterNode as AsyncClusterNode
from redis.asyncio.cluster import RedisCluster as AsyncRedisCluster
from redis.asyncio.connection import (
    Connection,
    ConnectionPool,
    SSLConnection,
    UnixDomainSocketConnection,
    parse_url,
)
from redis.asyncio.retry import Retry as AsyncRetry
from redis.backoff import NoBackoff
from redis.cluster import ClusterNode as SyncClusterNode
from redis.cluster import RedisCluster as SyncRedisCluster
from redis.exceptions import DataError, RedisClusterException
from redis.retry import Retry

from schemas.errors import ConfigurationError, ProjectionError

# What redis-py raises when a call fails: its cluster client's own errors (no node answers, the
# slots are not covered, ...) are not `RedisError`s. Catch this, never `RedisError` alone.
REDIS_ERRORS: Final = (redis.RedisError, RedisClusterException)


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


class _HiredisPacker:
    """redis-py's command packer interface (`command_packer=`), for the synchronous clients.

    Theirs is hiredis too, but first encodes every argument in Python (`Encoder.encode`): 17 % of
    a rebuild's CPU in its profile (docs/PERFORMANCE.md). hiredis encodes str, int and float
    itself, as it does for the asyncio clients above.
    """

    def pack(self, *args: Any) -> list[bytes]:
        """One command in RESP."""
        return [_pack(args)]


HIREDIS_PACKER = _HiredisPacker()


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


class AsyncCluster(AsyncRedisCluster):
    """redis-py's asyncio Redis Cluster client, and a plain client per master for the batches.

    `projections.requests` sends a batch's commands to each master in one pipeline of its own
    (the `WAIT` that makes a commit durable must follow the writes on their connection), on
    these clients; everything else goes through the cluster client's routing.
    """

    def node_client(self, node: AsyncClusterNode) -> aioredis.Redis:
        """The plain client of one node (commands packed by hiredis), made once."""
        clients: dict[str, aioredis.Redis] = self.__dict__.setdefault("_node_clients", {})
        found = clients.get(node.name)
        if found is None:
            options = dict(node.connection_kwargs)
            options["connection_class"] = _PACKING.get(node.connection_class, HiredisConnection)
            options["retry"] = AsyncRetry(NoBackoff(), 1)
            for unused in ("driver_info", "legacy_responses", "event_dispatcher"):
                options.pop(unused, None)
            found = clients[node.name] = aioredis.Redis.from_pool(ConnectionPool(**options))
        return found

    async def aclose(self) -> None:
        """Close the cluster client and every node client."""
        for client in self.__dict__.pop("_node_clients", {}).values():
            await client.aclose()
        await super().aclose()


_NODE_CLIENTS_MADE = threading.Lock()


def _packing_pool(node: SyncClusterNode) -> redis.ConnectionPool:
    """A pool like the node's own (class, options, size), whose connections hiredis packs."""
    pool = node.redis_connection.connection_pool
    pool_class: type[redis.ConnectionPool] = type(pool)
    return pool_class(
        connection_class=pool.connection_class,
        max_connections=pool.max_connections,
        **{**pool.connection_kwargs, "command_packer": HIREDIS_PACKER},
    )


class SyncCluster(SyncRedisCluster):
    """redis-py's Redis Cluster client; `projections.requests` pipelines to each master on a
    plain client of its own (see `AsyncCluster`), whose commands hiredis packs (`_HiredisPacker`:
    redis-py's cluster client takes no packer for its nodes)."""

    def node_client(self, node: SyncClusterNode) -> redis.Redis:
        """The plain client of one node (commands packed by hiredis), made once."""
        clients: dict[str, redis.Redis] = self.__dict__.setdefault("_node_clients", {})
        found = clients.get(node.name)
        if found is None:
            with _NODE_CLIENTS_MADE:  # a rebuild's lease renewer reaches here from its thread
                found = clients.get(node.name)
                if found is None:
                    found = clients[node.name] = redis.Redis.from_pool(_packing_pool(node))
        return found

    def close(self) -> None:
        """Close the cluster client and every node client."""
        for client in self.__dict__.pop("_node_clients", {}).values():
            client.close()
        super().close()


AsyncClient = aioredis.Redis | AsyncCluster
"""What the processors talk to: one Redis (or a primary with replicas), or a Redis Cluster."""
SyncClient = redis.Redis | SyncCluster
"""What readers and replay talk to."""


def async_client(
    url: str, timeout: float | None = None, auth: RedisAuth = NO_AUTH, *, cluster: bool = False
) -> AsyncClient:
    """A `redis.asyncio` client for `url` whose connections pack commands with hiredis
    (`cluster`: a Redis Cluster client, `url` one of its nodes).

    `timeout` bounds a connect and a reply; a failed call is retried once by the client (the
    worker's own loop retries with backoff, and says so), not ten times as redis-py's default.
    """
    if cluster:
        cluster_options: dict[str, Any] = {**auth.options(url)}
        if timeout is not None:
            cluster_options["socket_timeout"] = cluster_options["socket_connect_timeout"] = timeout
        _check_cluster_url(url)
        try:
            # from_url makes an instance of the class it is called on (typed as its base). It
            # connects to nothing (the first command does), so what it refuses is the settings.
            client = cast(AsyncCluster, AsyncCluster.from_url(url, **cluster_options))
        except (ValueError, RedisClusterException) as e:
            raise _bad_url(url, e) from e
        return client
    try:
        options: dict[str, Any] = dict(parse_url(url))
    except ValueError as e:
        raise _bad_url(url, e) from e
    options["connection_class"] = _PACKING[options.get("connection_class", Connection)]
    if timeout is not None:
        options["socket_timeout"] = options["socket_connect_timeout"] = timeout
    options["retry"] = AsyncRetry(NoBackoff(), 1)
    options.update(auth.options(url))
    return aioredis.Redis.from_pool(ConnectionPool(**options))


def sync_client(
    url: str, timeout: float | None = None, auth: RedisAuth = NO_AUTH, *, cluster: bool = False
) -> SyncClient:
    """A synchronous client for `url` (`cluster`: a Redis Cluster client, `url` one of its
    nodes): bounded connect and reply times, no retry (a reader fails fast and says why; it
    can run again)."""
    options: dict[str, Any] = {**auth.options(url)}
    if timeout is not None:
        options["socket_timeout"] = options["socket_connect_timeout"] = timeout
    if cluster:
        _check_cluster_url(url)
        try:
            # redis-py's synchronous cluster client asks a node for the slots as it is made.
            return cast(SyncCluster, SyncCluster.from_url(url, **options))
        except ValueError as e:
            raise _bad_url(url, e) from e
        except REDIS_ERRORS as e:
            raise ProjectionError(f"connecting to the Redis Cluster failed: {e}") from e
    try:
        return redis.Redis.from_url(
            url, retry=Retry(NoBackoff(), 0), command_packer=HIREDIS_PACKER, **options
        )
    except ValueError as e:
        raise _bad_url(url, e) from e


def _check_cluster_url(url: str) -> None:
    """Refuse the URLs a Redis Cluster client cannot use, as a `ConfigurationError`."""
    # Checked first: the synchronous client raises these as it raises "no node answers".
    try:
        options = parse_url(url)
    except ValueError as e:
        raise _bad_url(url, e) from e
    if "path" in options:
        raise ConfigurationError(
            f"Redis URL {redacted(url)}: a Redis Cluster is reached over TCP (redis:// or "
            "rediss://), not a unix:// socket"
        )
    if options.get("db"):
        raise ConfigurationError(f"Redis URL {redacted(url)}: a Redis Cluster has database 0 only")


UNREADABLE_URL = "<an unreadable Redis URL>"


def _bad_url(url: str, e: Exception) -> ConfigurationError:
    """The error for a URL redis-py refuses (its text only if the URL's password can be hidden)."""
    shown = redacted(url)
    if shown == UNREADABLE_URL:  # urllib's errors may quote the URL: its password too
        return ConfigurationError(
            f"Redis URL {shown}: it does not parse (percent-encode a password's / ? # @ [ ] &)"
        )
    return ConfigurationError(f"Redis URL {shown}: {e}")


def redacted(url: str) -> str:
    """`url` without its passwords (userinfo, `?password=`), for messages and logs; never raises."""
    try:
        return _redacted(url)
    except Exception:
        return UNREADABLE_URL


def _redacted(url: str) -> str:
    parts = urlsplit(url)
    userinfo, at, host = parts.netloc.rpartition("@")
    user, colon, _ = userinfo.partition(":")
    netloc = f"{user}:***@{host}" if at and colon else parts.netloc
    query = [(part, *part.partition("=")) for part in parts.query.split("&") if part]
    if "@" in parts.path + parts.query + parts.fragment:
        # A password's unencoded "/", "?" or "#" ended the URL's authority before its "@": what
        # follows may be the password's end, and what looks like a port its beginning.
        return UNREADABLE_URL
    shown = f"{parts.scheme}:" if parts.scheme else ""
    if netloc or "//" in url:  # not urlunsplit: it writes unix:///p as unix:/p
        shown += f"//{netloc}"
    shown += parts.path
    if query:
        # A part with no "=" is ignored by redis-py: perhaps the rest of a password with a "&".
        hidden = (f"{name}=***" if _is_password(name) else part for part, name, _, _ in query)
        shown += "?" + "&".join(part if "=" in part else "***" for part in hidden)
    # A fragment means nothing to redis-py: it can only be text cut off something (a password).
    return shown + ("#***" if parts.fragment else "")


def _is_password(name: str) -> bool:
    """Whether a query parameter's (encoded) name is `password`, which redis-py honours."""
    return unquote_plus(name).strip().lower() == "password"
