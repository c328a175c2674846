"""Each role is allowed what it needs on the project's topics, no more."""

from __future__ import annotations

from kafka.admin import ACLOperation, ACLResourcePatternType, ResourceType

from producers.acls import Principals, grants
from producers.settings import StackSettings


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


def test_one_user_holding_every_role_gets_all_of_them() -> None:
    one = Principals(agent="me", worker="me", operator="me")
    settings = StackSettings()
    allowed = grants(settings, one)
    assert list(allowed) == ["User:me"]
    separate = grants(settings, Principals())
    assert len(allowed["User:me"]) == sum(len(g) for g in separate.values())
