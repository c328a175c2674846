"""A console session signed out on one replica is refused by every other, through Redis."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from console.auth import CookieSigner
from milpa_sessions.settings import Settings
from projections.redis_client import SyncClient
from projections.sign_ins import RedisSignInFailures
from projections.sign_outs import RedisSignOuts
from schemas.errors import ProjectionError
from tests.integration.conftest import run_cli

pytestmark = pytest.mark.integration


@pytest.fixture
def client(settings: Settings) -> Iterator[SyncClient]:
    c = settings.redis_sync()
    yield c
    for key in c.scan_iter(match=settings.redis_keys().signed_out("*"), count=100):
        c.delete(key)
    c.close()


def test_a_sign_out_on_one_replica_is_refused_by_another_until_the_cookie_expires(
    settings: Settings, client: SyncClient
) -> None:
    keys = settings.redis_keys()
    other = settings.redis_sync()  # the other replica's connection
    try:
        one = CookieSigner("s" * 32, 3600, RedisSignOuts(client, keys))
        two = CookieSigner("s" * 32, 3600, RedisSignOuts(other, keys))
        users = {"alice": "$argon2id$alice"}.get
        value, session = one.issue("alice", "$argon2id$alice")
        assert two.read(value, users) == session
        one.revoke(session.session_id)
        assert two.read(value, users) is None and two.signed_out(session.session_id)
    finally:
        other.close()
    ttl_ms = client.pttl(keys.signed_out(session.session_id))
    assert 3_500_000 < ttl_ms <= 3_600_000  # kept as long as the cookie could live, no longer


@pytest.mark.parametrize("full", [(), ("--full",)], ids=["replay", "replay --full"])
def test_a_signed_out_cookie_stays_refused_after_a_rebuild(
    settings: Settings, client: SyncClient, full: tuple[str, ...]
) -> None:
    """A rebuild clears the projections only: the console's sign-outs and sign-in counters are
    no projection of the log (the README's procedure after a compromised key replays)."""
    keys = settings.redis_keys()
    signer = CookieSigner("s" * 32, 3600, RedisSignOuts(client, keys))
    users = {"alice": "$argon2id$alice"}.get
    value, session = signer.issue("alice", "$argon2id$alice")
    signer.revoke(session.session_id)
    assert signer.read(value, users) is None
    failures = RedisSignInFailures(client, keys)
    assert failures.attempt("b1", 5, 60) == 0
    try:
        done = run_cli(settings, "replay", "--force", *full)
        assert done.returncode == 0, done.stdout + done.stderr
        assert signer.read(value, users) is None and signer.signed_out(session.session_id)
        assert client.get(keys.sign_in_failures("b1")) == b"1"  # the throttle still counts it
    finally:
        client.delete(keys.sign_in_failures("b1"))


def test_redis_away_is_a_projection_error_not_a_session(settings: Settings) -> None:
    away = Settings(redis_url="redis://127.0.0.1:1/0", redis_timeout=0.5).redis_sync()
    sign_outs = RedisSignOuts(away, settings.redis_keys())
    try:
        with pytest.raises(ProjectionError, match="reading the sign-outs failed"):
            _ = "sid" in sign_outs
        with pytest.raises(ProjectionError, match="recording a sign-out failed"):
            sign_outs.add("sid", 60)
    finally:
        away.close()
