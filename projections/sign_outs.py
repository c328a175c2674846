"""The console's signed-out sessions in Redis, so that every replica (and a restarted one) refuses
a cookie its operator signed out: one key per session, expiring when the cookie would."""

from __future__ import annotations

from projections.keys import Keys
from projections.redis_client import REDIS_ERRORS, SyncClient
from schemas.errors import ProjectionError


class RedisSignOuts:
    """`console.auth.SignOuts` over Redis (one round trip per check)."""

    def __init__(self, client: SyncClient, keys: Keys) -> None:
        self.client = client
        self.keys = keys

    def add(self, session_id: str, ttl_s: float) -> None:
        """Remember the session as signed out for `ttl_s` seconds."""
        try:
            self.client.set(self.keys.signed_out(session_id), b"1", px=max(1, int(ttl_s * 1000)))
        except REDIS_ERRORS as e:
            raise ProjectionError(f"recording a sign-out failed: {type(e).__name__}: {e}") from e

    def __contains__(self, session_id: object) -> bool:
        if not isinstance(session_id, str):
            return False
        try:
            return bool(self.client.exists(self.keys.signed_out(session_id)))
        except REDIS_ERRORS as e:
            raise ProjectionError(f"reading the sign-outs failed: {type(e).__name__}: {e}") from e
