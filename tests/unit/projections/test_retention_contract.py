"""The retention contract (tests/contract_retention.py) run against the in-memory store."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from projections.memory import InMemoryProjectionStore
from tests.contract_retention import RetentionContract


@pytest.fixture
def projection_store() -> Iterator[InMemoryProjectionStore]:
    """A fresh in-memory store (no TTL until a test sets one)."""
    store = InMemoryProjectionStore()
    yield store
    store.clear()


class TestInMemoryRetention(RetentionContract):
    """Every retention contract test against `InMemoryProjectionStore`."""
