"""The ProjectionStore contract (tests/contract_projection.py) run against the real Redis store.

The same contract class `tests/unit/test_projection_contract.py` runs against the in-memory store;
here every test gets a fresh, empty `RedisProjectionStore` under a key prefix of its own.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest

from processors.keys import Keys
from processors.redis_store import RedisProjectionStore
from tests.contract_projection import ProjectionStoreContract
from tests.integration.conftest import Stack

pytestmark = pytest.mark.integration


@pytest.fixture
def projection_store(stack: Stack) -> Iterator[RedisProjectionStore]:
    """A Redis projection store under a unique prefix, empty before and after the test."""
    store = RedisProjectionStore.from_url(stack.redis_url, Keys(f"itc{uuid.uuid4().hex[:10]}"))
    store.clear()
    yield store
    store.clear()
    store.client.close()


class TestRedisProjectionStoreContract(ProjectionStoreContract):
    """Every contract test against `RedisProjectionStore`."""


def test_the_contract_prefix_is_isolated(projection_store: RedisProjectionStore) -> None:
    """The fixture's store starts empty and its keys live under its own prefix only."""
    assert projection_store.ids() == []
    assert projection_store.keys.prefix.startswith("itc")
    assert list(projection_store.client.scan_iter(match=projection_store.keys.pattern())) == []
