"""The live rebuild's lease renewer (`processors.generations._lease`), with a fake store."""

from __future__ import annotations

import time
from typing import Any

import pytest

from processors.generations import _lease
from schemas.errors import ProjectionError


class _Store:
    """Takes and gives the lease; each renewal raises the next of `failures`, then renews."""

    def __init__(self, *failures: Exception) -> None:
        self.failures = list(failures)
        self.actions: list[str] = []

    def lease(self, token: str, ttl_ms: int, action: str) -> bool:
        self.actions.append(action)
        if action == "renew" and self.failures:
            raise self.failures.pop(0)
        return True


def test_a_renewal_that_fails_unexpectedly_counts_as_the_lease_lost() -> None:
    store: Any = _Store(RuntimeError("a bug in the client"))
    with _lease(store, 0.06) as (lost, guard):
        assert lost.wait(5), "the rebuild was not told to stop"
        assert [t.name for t in guard.threads] == ["rebuild-lease"]
    assert store.actions[0] == "take" and store.actions[-1] == "give"


def test_a_renewal_redis_refuses_for_a_moment_is_tried_again(
    caplog: pytest.LogCaptureFixture,
) -> None:
    store: Any = _Store(ProjectionError("Redis away"))
    with _lease(store, 0.06) as (lost, _):
        deadline = time.monotonic() + 5
        while store.actions.count("renew") < 3 and time.monotonic() < deadline:
            assert not lost.wait(0.01)
    assert store.actions.count("renew") >= 3
    assert not lost.is_set()
    assert "renewing the lease failed: Redis away" in caplog.text
