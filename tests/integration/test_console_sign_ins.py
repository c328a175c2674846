"""Console sign-in attempts counted in Redis: every replica refuses a name, and a client address,
after its limit."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from console.auth import MemorySignInFailures, SignInFailures, SignInThrottle
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


def test_a_bucket_is_refused_past_the_limit_and_cleared_by_a_success(
    failures: SignInFailures,
) -> None:
    assert [failures.attempt("b1", 3, 60) for _ in range(3)] == [0.0] * 3
    assert 59 < failures.attempt("b1", 3, 60) <= 60
    assert failures.attempt("b2", 3, 60) == 0  # another bucket's count is its own
    failures.cleared("b1")
    assert failures.attempt("b1", 1, 60) == 0


def test_over_reads_whether_the_next_attempt_would_be_refused_without_counting(
    failures: SignInFailures,
) -> None:
    assert failures.over("b1", 2) == 0  # nothing counted yet
    failures.attempt("b1", 2, 60)
    assert failures.over("b1", 2) == 0  # one of two: the next may go on
    failures.attempt("b1", 2, 60)
    assert 59 < failures.over("b1", 2) <= 60  # two of two: the next would be refused
    assert 59 < failures.over("b1", 2) <= 60
    assert failures.attempt("b1", 3, 60) == 0  # the third: the two reads counted nothing
    failures.cleared("b1")
    assert failures.over("b1", 2) == 0


def test_the_window_runs_from_the_first_attempt_and_later_ones_do_not_extend_it(
    settings: Settings, client: SyncClient
) -> None:
    keys = settings.redis_keys()
    failures = RedisSignInFailures(client, keys)
    failures.attempt("b1", 1, 60)
    client.pexpire(keys.sign_in_failures("b1"), 5_000)  # as if 55 s had passed
    assert 0 < failures.attempt("b1", 1, 60) <= 5
    assert 0 < client.pttl(keys.sign_in_failures("b1")) <= 5_000
    # A count that lost its expiry (written by hand, say) gets one at the next attempt.
    client.set(keys.sign_in_failures("b2"), 7)
    assert 59 < failures.attempt("b2", 3, 60) <= 60
    assert 59_000 < client.pttl(keys.sign_in_failures("b2")) <= 60_000


def test_two_replicas_refuse_the_same_name(settings: Settings, client: SyncClient) -> None:
    other = settings.redis_sync()
    try:
        one = SignInThrottle(
            RedisSignInFailures(client, settings.redis_keys()), b"s" * 32, limit=2, window_s=60
        )
        two = SignInThrottle(
            RedisSignInFailures(other, settings.redis_keys()), b"s" * 32, limit=2, window_s=60
        )
        assert one.attempt("alice") == 0 and two.attempt("alice") == 0
        assert one.attempt("alice") > 0 and two.attempt("alice") > 0
        assert two.attempt("bob") == 0
        one.succeeded("alice")
        assert two.attempt("alice") == 0
    finally:
        other.close()
    found = [
        k.decode() for k in client.scan_iter(match=settings.redis_keys().sign_in_failures("*"))
    ]
    assert found and not any("alice" in k or "bob" in k for k in found)


def test_an_address_is_refused_past_its_limit_whatever_the_names(
    failures: SignInFailures,
) -> None:
    throttle = SignInThrottle(failures, b"s" * 32, limit=2, window_s=60, source_limit=3)
    assert [throttle.attempt_from("192.0.2.7") for _ in range(3)] == [0.0] * 3
    assert 59 < throttle.attempt_from("192.0.2.7") <= 60
    assert throttle.attempt_from("192.0.2.8") == 0  # another address's count is its own
    assert throttle.attempt_from("2001:db8::1") == 0
    assert throttle.attempt("alice") == 0  # and so is every name's
    throttle.succeeded("alice")  # a success clears the name's count, not the address's
    assert throttle.attempt_from("192.0.2.7") > 0
    assert [throttle.attempt_from("2001:db8::2") for _ in range(2)] == [0.0] * 2  # one /64
    assert throttle.attempt_from("2001:db8::3") > 0


def test_two_replicas_refuse_the_same_address_by_a_key_that_does_not_name_it(
    settings: Settings, client: SyncClient
) -> None:
    other = settings.redis_sync()
    keys = settings.redis_keys()
    try:
        one = SignInThrottle(
            RedisSignInFailures(client, keys), b"s" * 32, window_s=60, source_limit=2
        )
        two = SignInThrottle(
            RedisSignInFailures(other, keys), b"s" * 32, window_s=60, source_limit=2
        )
        assert one.attempt_from("198.51.100.4") == 0 and two.attempt_from("198.51.100.4") == 0
        assert 59 < one.attempt_from("198.51.100.4") <= 60
        assert two.attempt_from("198.51.100.4") > 0
        assert two.attempt_from("198.51.100.5") == 0
    finally:
        other.close()
    key = keys.sign_in_failures(one.source_bucket("198.51.100.4"))
    assert client.get(key) == b"4" and 59_000 < client.pttl(key) <= 60_000
    found = [k.decode() for k in client.scan_iter(match=keys.sign_in_failures("*"))]
    assert key in found and not any("198.51" in k for k in found)


def test_redis_away_is_a_projection_error(settings: Settings) -> None:
    away = Settings(redis_url="redis://127.0.0.1:1/0", redis_timeout=0.5).redis_sync()
    failures = RedisSignInFailures(away, settings.redis_keys())
    try:
        with pytest.raises(ProjectionError, match="counting a sign-in attempt failed"):
            failures.attempt("b", 1, 60)
        with pytest.raises(ProjectionError, match="clearing sign-in attempts failed"):
            failures.cleared("b")
        with pytest.raises(ProjectionError, match="reading sign-in attempts failed"):
            failures.over("b", 1)
    finally:
        away.close()
