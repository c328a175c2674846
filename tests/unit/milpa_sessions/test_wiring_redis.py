"""Waiting for Redis at start-up: a Redis Cluster that is not up yet is waited for, not fatal."""

from __future__ import annotations

import pytest
from redis.cluster import NodesManager
from redis.exceptions import RedisClusterUnreachableError

from milpa_sessions.wiring import ping_redis
from processors.running import wait_for
from producers.settings import StackSettings
from projections.redis_client import SyncClient
from schemas.errors import ConfigurationError, ProjectionError

CLUSTER = StackSettings(
    redis_url="redis://:s3cret@127.0.0.1:7000", redis_timeout=0.1, redis_cluster=True
)


def _unreachable(*args: object, **kwargs: object) -> None:
    raise RedisClusterUnreachableError("Redis Cluster cannot be connected: Error 111")


def test_a_cluster_no_node_answers_is_retried_until_the_timeout(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """redis-py's cluster client connects as it is made, and its error is no `RedisError`."""
    monkeypatch.setattr(NodesManager, "initialize", _unreachable)
    now = [0.0]
    said: list[str] = []

    def sleep(seconds: float) -> None:
        now[0] += seconds

    with pytest.raises(ProjectionError, match="not reachable after") as raised:
        wait_for(
            "Redis",
            lambda: ping_redis(CLUSTER),
            timeout=3.0,
            clock=lambda: now[0],
            sleep=sleep,
            say=said.append,
        )
    assert said and all("waiting for Redis" in line for line in said)
    assert not any("s3cret" in line for line in said)
    assert isinstance(raised.value.__cause__, ProjectionError)
    assert now[0] >= 3.0  # waited (with backoff), not ended by the first failure


def test_a_driver_error_making_the_client_is_a_projection_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Whatever the client's maker lets through of redis-py's errors, the ping wraps."""

    def redis_sync(self: StackSettings) -> SyncClient:
        raise RedisClusterUnreachableError("Redis Cluster cannot be connected: Error 111")

    monkeypatch.setattr(StackSettings, "redis_sync", redis_sync)
    with pytest.raises(ProjectionError, match="RedisClusterUnreachableError") as raised:
        ping_redis(CLUSTER)
    assert isinstance(raised.value.__cause__, RedisClusterUnreachableError)


def test_a_bad_url_is_not_waited_for() -> None:
    calls = [0]

    def ping() -> None:
        calls[0] += 1
        ping_redis(StackSettings(redis_url="redis://:s3cret@[::1", redis_cluster=True))

    with pytest.raises(ConfigurationError):
        wait_for("Redis", ping, timeout=3.0, sleep=lambda _: None)
    assert calls == [1]
