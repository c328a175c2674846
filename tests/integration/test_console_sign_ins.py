"""Failed console sign-ins counted in Redis: every replica refuses a name after its limit."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from console.auth import MemorySignInFailures, Passwords, SignInFailures, SignInThrottle
from milpa_sessions.settings import Settings
from projections.redis_client import SyncClient
from projections.sign_ins import RedisSignInFailures
from schemas.errors import ProjectionError

pytestmark = pytest.mark.integration


@pytest.fixture
def client(settings: Settings) -> Iterator[SyncClient]:
    c = settings.redis_sync()
    yield c
    for key in c.scan_iter(match=settings.redis_keys().sign_in_failures("*"), count=100):
        c.delete(key)
    c.close()


@pytest.fixture(params=["memory", "redis"])
def failures(
    request: pytest.FixtureRequest, settings: Settings, client: SyncClient
) -> SignInFailures:
    if request.param == "memory":
        return MemorySignInFailures()
    return RedisSignInFailures(client, settings.redis_keys())


def test_a_bucket_is_blocked_once_it_failed_the_limit_and_cleared_by_a_success(
    failures: SignInFailures,
) -> None:
    for _ in range(2):
        failures.failed("b1", window_s=60)
    assert failures.blocked_for("b1", limit=3) == 0
    failures.failed("b1", window_s=60)
    assert 59 < failures.blocked_for("b1", limit=3) <= 60
    assert failures.blocked_for("b2", limit=3) == 0  # another name's count is its own
    failures.cleared("b1")
    assert failures.blocked_for("b1", limit=1) == 0


def test_the_window_runs_from_the_first_failure_and_later_ones_do_not_extend_it(
    settings: Settings, client: SyncClient
) -> None:
    keys = settings.redis_keys()
    failures = RedisSignInFailures(client, keys)
    failures.failed("b1", window_s=60)
    client.pexpire(keys.sign_in_failures("b1"), 5_000)  # as if 55 s had passed
    failures.failed("b1", window_s=60)
    assert 0 < client.pttl(keys.sign_in_failures("b1")) <= 5_000
    # A count that lost its expiry (written by hand, say) gets one at the next failure.
    client.set(keys.sign_in_failures("b2"), 7)
    failures.failed("b2", window_s=60)
    assert 59_000 < client.pttl(keys.sign_in_failures("b2")) <= 60_000


def test_two_replicas_refuse_the_same_name(settings: Settings, client: SyncClient) -> None:
    passwords = Passwords({})
    other = settings.redis_sync()
    try:
        one = SignInThrottle(
            RedisSignInFailures(client, settings.redis_keys()), passwords, limit=2, window_s=60
        )
        two = SignInThrottle(
            RedisSignInFailures(other, settings.redis_keys()), passwords, limit=2, window_s=60
        )
        one.failed("alice")
        two.failed("alice")
        assert one.blocked_for("alice") > 0 and two.blocked_for("alice") > 0
    finally:
        other.close()
    assert not list(client.scan_iter(match="*alice*"))  # the key names a digest


def test_redis_away_is_a_projection_error(settings: Settings) -> None:
    away = Settings(redis_url="redis://127.0.0.1:1/0", redis_timeout=0.5).redis_sync()
    failures = RedisSignInFailures(away, settings.redis_keys())
    try:
        with pytest.raises(ProjectionError, match="reading sign-in failures failed"):
            failures.blocked_for("b", 1)
        with pytest.raises(ProjectionError, match="counting a sign-in failure failed"):
            failures.failed("b", 60)
        with pytest.raises(ProjectionError, match="clearing sign-in failures failed"):
            failures.cleared("b")
    finally:
        away.close()
