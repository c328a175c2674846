"""The console's failed sign-ins in Redis, so that every replica (and a restarted one) counts the
same failures per name: one counter per name's digest, expiring with its window."""

from __future__ import annotations

import redis

from projections import scripts
from projections.keys import Keys
from projections.redis_client import SyncClient
from schemas.errors import ProjectionError


class RedisSignInFailures:
    """`console.auth.SignInFailures` over Redis (one round trip per call)."""

    def __init__(self, client: SyncClient, keys: Keys) -> None:
        self.client = client
        self.keys = keys

    def blocked_for(self, bucket: str, limit: int) -> float:
        """Seconds left of the window once `limit` failures were counted in it."""
        key = self.keys.sign_in_failures(bucket)
        try:
            pipe = self.client.pipeline(transaction=False)
            pipe.get(key)
            pipe.pttl(key)
            count, ttl_ms = pipe.execute()
        except redis.RedisError as e:
            raise ProjectionError(
                f"reading sign-in failures failed: {type(e).__name__}: {e}"
            ) from e
        if count is None or int(count) < limit or ttl_ms <= 0:
            return 0.0
        return float(ttl_ms) / 1000

    def failed(self, bucket: str, window_s: float) -> None:
        """One more failure; the first of a window starts its expiry (one atomic script)."""
        key = self.keys.sign_in_failures(bucket)
        try:
            self.client.eval(scripts.SIGN_IN_FAILED.source, 1, key, max(1, int(window_s * 1000)))
        except redis.RedisError as e:
            raise ProjectionError(
                f"counting a sign-in failure failed: {type(e).__name__}: {e}"
            ) from e

    def cleared(self, bucket: str) -> None:
        """Forget the bucket's failures."""
        try:
            self.client.delete(self.keys.sign_in_failures(bucket))
        except redis.RedisError as e:
            raise ProjectionError(
                f"clearing sign-in failures failed: {type(e).__name__}: {e}"
            ) from e
