"""The console's sign-in attempts in Redis, so that every replica (and a restarted one) counts the
same attempts per name and per client address: one counter per bucket (of names, or an address's:
`src-<keyed hash>`), expiring with its window."""

from __future__ import annotations

from projections import scripts
from projections.keys import Keys
from projections.redis_client import REDIS_ERRORS, SyncClient
from schemas.errors import ProjectionError


class RedisSignInFailures:
    """`console.auth.SignInFailures` over Redis (one round trip per call)."""

    def __init__(self, client: SyncClient, keys: Keys) -> None:
        self.client = client
        self.keys = keys

    def attempt(self, bucket: str, limit: int, window_s: float) -> float:
        """Count an attempt (atomically, with the window's expiry); 0 if it may go on, else the
        seconds left of the window."""
        key = self.keys.sign_in_failures(bucket)
        window_ms = max(1, int(window_s * 1000))
        try:
            count, left_ms = self.client.eval(scripts.SIGN_IN_ATTEMPT.source, 1, key, window_ms)
        except REDIS_ERRORS as e:
            raise ProjectionError(
                f"counting a sign-in attempt failed: {type(e).__name__}: {e}"
            ) from e
        return 0.0 if int(count) <= limit else max(int(left_ms), 1) / 1000

    def over(self, bucket: str, limit: int) -> float:
        """Without counting: the seconds left of the bucket's window if it holds `limit`
        attempts, else 0 (one round trip)."""
        key = self.keys.sign_in_failures(bucket)
        try:
            with self.client.pipeline(transaction=False) as pipe:
                pipe.get(key)
                pipe.pttl(key)
                count, left_ms = pipe.execute()
        except REDIS_ERRORS as e:
            raise ProjectionError(
                f"reading sign-in attempts failed: {type(e).__name__}: {e}"
            ) from e
        if count is None or int(count) < limit or int(left_ms) <= 0:
            return 0.0
        return int(left_ms) / 1000

    def cleared(self, bucket: str) -> None:
        """Forget the bucket's attempts."""
        try:
            self.client.delete(self.keys.sign_in_failures(bucket))
        except REDIS_ERRORS as e:
            raise ProjectionError(
                f"clearing sign-in attempts failed: {type(e).__name__}: {e}"
            ) from e
