"""The ProjectionStore contract (tests/contract_projection.py) run against the in-memory store.

The contract is written once. `STORES` maps a param id to a factory of a fresh store; the
integration suite (tests/integration) adds the Redis store by running the same
`ProjectionStoreContract` with a `projection_store` fixture whose STORES gains
`"redis": lambda: RedisProjectionStore(...)` — nothing here changes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from datetime import UTC, datetime

import pytest

from producers.memory import in_memory_backend
from projections.memory import InMemoryProjectionStore
from schemas import events as ev
from schemas.errors import NotYetVisibleError
from schemas.events import Event
from session_model.ports import ProjectionStore
from session_model.projection import Position
from tests.contract_projection import ProjectionStoreContract
from tests.contract_waiting import WaitingIndexContract

STORES: dict[str, Callable[[], ProjectionStore]] = {
    "memory": InMemoryProjectionStore,
    # "redis": added by the integration suite, which needs the real Redis (deploy/stack.py up).
}


@pytest.fixture(params=sorted(STORES))
def projection_store(request: pytest.FixtureRequest) -> Iterator[ProjectionStore]:
    store = STORES[request.param]()
    store.clear()
    yield store
    store.clear()


class TestProjectionStoreContract(ProjectionStoreContract):
    """Every contract test, once per entry of STORES."""


class TestWaitingIndexContract(WaitingIndexContract):
    """The waiting index's contract, once per entry of STORES."""


# -- what only the in-memory adapter promises ------------------------------------------------------


def test_in_memory_store_raises_not_yet_visible_immediately_even_with_a_long_timeout() -> None:
    store = InMemoryProjectionStore()
    with pytest.raises(NotYetVisibleError):
        store.load("s1", at_least=Position(0, 0), timeout=3600.0)


def test_in_memory_backend_projects_on_every_append() -> None:
    log, store = in_memory_backend()
    event = Event("e1", "s1", ev.STARTED, datetime(2026, 1, 1, tzinfo=UTC), "t", {"goal": "g"})
    position = log.append(event)
    assert position == Position(0, 0)
    session = store.load("s1", at_least=position)
    assert session is not None
    assert session.goal == "g"
    assert store.folded(["s1"])["s1"].mark == position
