"""Each role is allowed what it needs on the project's topics, no more."""

from __future__ import annotations

from typing import Any

import pytest
from kafka.admin import (
    ACL,
    ACLFilter,
    ACLOperation,
    ACLPermissionType,
    ACLResourcePatternType,
    ResourceType,
)
from kafka.errors import (
    KafkaError,
    NodeNotReadyError,
    NoError,
    RequestTimedOutError,
    SecurityDisabledError,
)

import producers.acls as acls_module
from producers.acls import Principals, acl_bindings, grants, wait_for_acls
from producers.settings import StackSettings
from projections.snapshots import snapshot_writer_id
from schemas.errors import LogError


def test_an_agent_may_only_write_the_events_topic() -> None:
    allowed = grants(StackSettings(events_topic="ev"), Principals(agent="a1"))
    assert allowed["User:a1"] == [
        (
            ResourceType.TOPIC,
            "ev",
            ACLResourcePatternType.LITERAL,
            (ACLOperation.WRITE, ACLOperation.DESCRIBE),
        )
    ]


def test_the_worker_reads_events_in_its_group_and_writes_its_outputs() -> None:
    settings = StackSettings(consumer_group="g")
    worker = {
        (k, n, op) for k, n, _, ops in grants(settings, Principals())["User:worker"] for op in ops
    }
    assert (ResourceType.TOPIC, settings.events_topic, ACLOperation.READ) in worker
    assert (ResourceType.TOPIC, settings.decisions_topic, ACLOperation.WRITE) in worker
    assert (ResourceType.TOPIC, settings.decisions_topic, ACLOperation.READ) not in worker
    assert (ResourceType.GROUP, "g", ACLOperation.READ) in worker
    operator = {
        (k, n, op) for k, n, _, ops in grants(settings, Principals())["User:operator"] for op in ops
    }
    assert (ResourceType.TOPIC, settings.decisions_topic, ACLOperation.READ) in operator
    assert (ResourceType.TOPIC, settings.deadletter_topic, ACLOperation.WRITE) not in operator


def test_the_worker_and_the_operator_may_open_snapshot_writers_and_nobody_else() -> None:
    settings = StackSettings(snapshots_topic="snaps")
    writers = (
        ResourceType.TRANSACTIONAL_ID,
        "snaps.writer-",
        ACLResourcePatternType.PREFIXED,
        (ACLOperation.WRITE, ACLOperation.DESCRIBE),
    )
    allowed = grants(settings, Principals())
    assert writers in allowed["User:worker"] and writers in allowed["User:operator"]
    assert all(g[0] is not ResourceType.TRANSACTIONAL_ID for g in allowed["User:agent"])
    # The id each partition's writer uses is under that prefix.
    assert snapshot_writer_id("snaps", 3).startswith(writers[1])


def test_one_user_holding_every_role_gets_all_of_them() -> None:
    one = Principals(agent="me", worker="me", operator="me")
    settings = StackSettings()
    allowed = grants(settings, one)
    assert list(allowed) == ["User:me"]
    separate = grants(settings, Principals())
    assert len(allowed["User:me"]) == sum(len(g) for g in separate.values())


class FakeBroker:
    """An admin client whose broker enforces (and lists) what was created `lag` describes later."""

    def __init__(self, lag: int = 0, errors: list[KafkaError] | None = None) -> None:
        self.lag = lag
        self.errors = errors or []
        self.pending: list[ACL] = []
        self.applied: list[ACL] = []
        self.filters: list[ACLFilter] = []
        self.closed = False

    def create_acls(self, acls: list[ACL]) -> dict[str, list[Any]]:
        self.pending.extend(acls)
        return {"succeeded": list(acls), "failed": []}

    def describe_acls(self, acl_filter: ACLFilter) -> tuple[list[ACL], Any]:
        self.filters.append(acl_filter)
        if self.errors:
            raise self.errors.pop(0)
        if self.lag > 0:
            self.lag -= 1
        else:
            self.applied, self.pending = self.applied + self.pending, []
        wanted = acl_filter.resource_pattern
        assert acl_filter.principal is None and acl_filter.host is None
        assert acl_filter.operation == ACLOperation.ANY
        listed = [a for a in self.applied if a.resource_pattern == wanted]
        return listed, NoError

    def close(self) -> None:
        self.closed = True


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0
        self.slept: list[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds


def _wait(broker: FakeBroker, acls: list[ACL], clock: FakeClock, timeout: float = 60.0) -> int:
    return wait_for_acls(broker, acls, timeout=timeout, clock=clock, sleep=clock.sleep)


def test_waiting_for_acls_returns_once_the_broker_lists_every_one() -> None:
    acls = acl_bindings(StackSettings(), Principals())
    broker, clock = FakeBroker(lag=3), FakeClock()
    broker.create_acls(acls)
    assert _wait(broker, acls, clock) == 2
    assert clock.slept == [0.1]
    assert not broker.pending
    resources = {a.resource_pattern for a in acls}
    asked = [f.resource_pattern for f in broker.filters]
    assert set(asked) == resources  # only the resources granted on, never all of a principal's
    # the three resources described before the broker applied the ACLs are asked again, only them
    assert len(asked) == len(resources) + 3


def test_acls_listed_for_another_principal_or_operation_do_not_count() -> None:
    settings = StackSettings(events_topic="ev")
    mine = [a for a in acl_bindings(settings, Principals(agent="a1")) if a.principal == "User:a1"]
    assert len(mine) == 2
    broker, clock = FakeBroker(), FakeClock()
    other = ACL(
        "User:a2", "*", ACLOperation.WRITE, ACLPermissionType.ALLOW, mine[0].resource_pattern
    )
    broker.create_acls([other, mine[0]])  # the agent's DESCRIBE never reaches the broker
    with pytest.raises(LogError, match=r"1 of 2 ACL\(s\) not in force.*ALLOW User:a1@\* DESCRIBE"):
        _wait(broker, mine, clock, timeout=5.0)
    assert 5.0 <= clock.now < 5.5  # bounded by the timeout


def test_a_retriable_describe_error_is_asked_again_and_any_other_is_an_error() -> None:
    acls = acl_bindings(StackSettings(), Principals())
    broker, clock = (
        FakeBroker(errors=[RequestTimedOutError("slow"), NodeNotReadyError("n")]),
        FakeClock(),
    )
    broker.create_acls(acls)
    assert _wait(broker, acls, clock) == 2
    broker, clock = FakeBroker(errors=[SecurityDisabledError("no authorizer")]), FakeClock()
    broker.create_acls(acls)
    with pytest.raises(LogError, match=r"describing ACLs failed.*no authorizer"):
        _wait(broker, acls, clock)


def test_applying_acls_returns_only_once_the_broker_enforces_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    broker = FakeBroker(lag=4)  # applied while the first round of describes is under way
    monkeypatch.setattr(acls_module, "admin_client", lambda settings: broker)
    settings = StackSettings()
    created = acls_module.apply_acls(settings, Principals())
    assert created == len(acl_bindings(settings, Principals()))
    assert broker.pending == [] and broker.closed


def test_applying_acls_the_broker_never_enforces_is_an_error_after_the_timeout(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    broker = FakeBroker(lag=10**9)
    monkeypatch.setattr(acls_module, "admin_client", lambda settings: broker)
    with pytest.raises(LogError, match=r"not in force on the broker after 0 s"):
        acls_module.apply_acls(StackSettings(), Principals(), timeout=0.0)
    assert broker.closed
