"""The synchronous store's own Redis calls wrap every driver error, a Redis Cluster's too."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import pytest
from redis.exceptions import RedisClusterException, SlotNotCoveredError

from projections.keys import Keys
from projections.redis_client import SyncClient
from projections.redis_store import RedisProjectionStore
from projections.sign_ins import RedisSignInFailures
from projections.sign_outs import RedisSignOuts
from schemas.errors import ProjectionError
from session_model.projection import Position


class _Unserved:
    """A cluster client whose every call finds no node serving its slot."""

    def __getattr__(self, name: str) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            raise SlotNotCoveredError(f"{name}: slot 1234 is not covered by the cluster")

        return call


CALLS: dict[str, Callable[[RedisProjectionStore], object]] = {
    "load at_least": lambda s: s.load("s-1", Position(0, 5), timeout=0.0),
    "ids": lambda s: s.ids(),
    "history": lambda s: s.history("s-1"),
    "facts": lambda s: s.facts("s-1"),
    "timeline": lambda s: s.timeline("s-1"),
    "clear": lambda s: s.clear(),
    "close": lambda s: s.close(),
}


@pytest.mark.parametrize("call", CALLS.values(), ids=CALLS.keys())
def test_a_cluster_error_is_a_projection_error(
    call: Callable[[RedisProjectionStore], object],
) -> None:
    keys = Keys("ms", partitions=2).in_generations((0, 0))
    store = RedisProjectionStore(cast(SyncClient, _Unserved()), keys, follow=False)
    with pytest.raises(ProjectionError, match="not covered") as raised:
        call(store)
    assert isinstance(raised.value.__cause__, RedisClusterException)


KEYS = Keys("ms", partitions=2)
CONSOLE_CALLS: dict[str, Callable[[SyncClient], object]] = {
    "sign-in attempt": lambda c: RedisSignInFailures(c, KEYS).attempt("b", 5, 60.0),
    "sign-in cleared": lambda c: RedisSignInFailures(c, KEYS).cleared("b"),
    "sign-out added": lambda c: RedisSignOuts(c, KEYS).add("s", 60.0),
    "sign-out read": lambda c: "s" in RedisSignOuts(c, KEYS),
}


@pytest.mark.parametrize("call", CONSOLE_CALLS.values(), ids=CONSOLE_CALLS.keys())
def test_a_cluster_error_in_the_consoles_records_is_a_projection_error(
    call: Callable[[SyncClient], object],
) -> None:
    with pytest.raises(ProjectionError, match="not covered") as raised:
        call(cast(SyncClient, _Unserved()))
    assert isinstance(raised.value.__cause__, RedisClusterException)
