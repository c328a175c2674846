"""Retention against the real stack: the contract on Redis, and expiry → `show` → `replay`.

The contract (tests/contract_retention.py) runs here against `RedisProjectionStore`, under a key
prefix of each test's own; the end-to-end test ends sessions through a worker, sweeps with a
clock it passes in (no real TTL is waited for), and restores one with `replay --session`.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest

from milpa_sessions.settings import Settings
from projections.keys import Keys
from projections.redis_store import RedisProjectionStore
from tests.contract_retention import RetentionContract

pytestmark = pytest.mark.integration


@pytest.fixture
def projection_store(secured: Settings) -> Iterator[RedisProjectionStore]:
    """A Redis projection store under a unique prefix, empty before and after the test."""
    store = RedisProjectionStore.from_url(
        secured.redis_url, Keys(f"itr{uuid.uuid4().hex[:10]}"), auth=secured.redis_auth()
    )
    store.clear()
    yield store
    store.clear()
    store.client.close()


class TestRedisRetention(RetentionContract):
    """Every retention contract test against `RedisProjectionStore` (the commit and drop
    scripts keep the retention index, the tombstones, the waiting index and fleet counts)."""
