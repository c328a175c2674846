"""The ACLs of a secured cluster: what each kind of principal may do to the project's topics.

- an agent (a writer of session events) may only write the events topic;
- the worker reads the events topic in its consumer group, writes decisions, dead letters,
  snapshots and the scheduler's events, and owns the topics and groups prefixed by its group
  (Faust's own);
- an operator writes events (grants, answers), reads decisions and dead letters, rebuilds
  (`replay` reads the snapshots and the events topic) and may describe the workers' group
  (replay's guard).

Applied with an administrator's credentials (`milpa-sessions acls apply`); idempotent.
"""

from __future__ import annotations

from dataclasses import dataclass

from kafka.admin import (
    ACL,
    ACLOperation,
    ACLPermissionType,
    ACLResourcePatternType,
    ResourcePattern,
    ResourceType,
)
from kafka.errors import KafkaError

from producers.settings import StackSettings
from producers.topics import admin_client
from schemas.errors import LogError

Grant = tuple[ResourceType, str, ACLResourcePatternType, tuple[ACLOperation, ...]]
_LITERAL, _PREFIXED = ACLResourcePatternType.LITERAL, ACLResourcePatternType.PREFIXED
_TOPIC, _GROUP = ResourceType.TOPIC, ResourceType.GROUP
_READ, _WRITE, _DESCRIBE, _CREATE = (
    ACLOperation.READ,
    ACLOperation.WRITE,
    ACLOperation.DESCRIBE,
    ACLOperation.CREATE,
)


@dataclass(frozen=True, slots=True)
class Principals:
    """The SCRAM user names of each role."""

    agent: str = "agent"
    worker: str = "worker"
    operator: str = "operator"


def grants(settings: StackSettings, who: Principals) -> dict[str, list[Grant]]:
    """Per principal (`User:<name>`), what it is allowed."""
    events, decisions, questions, dead, snapshots = (
        settings.events_topic,
        settings.decisions_topic,
        settings.questions_topic,
        settings.deadletter_topic,
        settings.snapshots_topic,
    )
    group = settings.consumer_group
    roles: list[tuple[str, list[Grant]]] = [
        (who.agent, [(_TOPIC, events, _LITERAL, (_WRITE, _DESCRIBE))]),
        (
            who.worker,
            [
                (_TOPIC, events, _LITERAL, (_READ, _WRITE, _DESCRIBE)),
                (_TOPIC, decisions, _LITERAL, (_WRITE, _DESCRIBE)),
                (_TOPIC, questions, _LITERAL, (_WRITE, _DESCRIBE)),
                (_TOPIC, dead, _LITERAL, (_WRITE, _DESCRIBE)),
                (_TOPIC, snapshots, _LITERAL, (_WRITE, _DESCRIBE)),
                (_TOPIC, f"{group}-", _PREFIXED, (_CREATE, _READ, _WRITE, _DESCRIBE)),
                (_GROUP, group, _PREFIXED, (_READ, _DESCRIBE)),
            ],
        ),
        (
            who.operator,
            [
                (_TOPIC, events, _LITERAL, (_READ, _WRITE, _DESCRIBE)),
                (_TOPIC, decisions, _LITERAL, (_READ, _DESCRIBE)),
                (_TOPIC, questions, _LITERAL, (_READ, _DESCRIBE)),  # the console's live feed
                (_TOPIC, dead, _LITERAL, (_READ, _DESCRIBE)),  # to inspect what was refused
                # `replay` starts from them, and snapshots what it rebuilt
                (_TOPIC, snapshots, _LITERAL, (_READ, _WRITE, _DESCRIBE)),
                (_GROUP, group, _LITERAL, (_DESCRIBE,)),
                (_GROUP, "milpa-", _PREFIXED, (_READ, _DESCRIBE)),
            ],
        ),
    ]
    allowed: dict[str, list[Grant]] = {}
    for user, granted in roles:  # one user may hold several roles (a test principal does)
        allowed.setdefault(f"User:{user}", []).extend(granted)
    return allowed


def apply_acls(settings: StackSettings, who: Principals | None = None) -> int:
    """Create the ACLs (with the settings' credentials: an administrator's); how many were new."""
    acls = [
        ACL(
            principal,
            "*",
            operation,
            ACLPermissionType.ALLOW,
            ResourcePattern(kind, name, pattern),
        )
        for principal, allowed in grants(settings, who or Principals()).items()
        for kind, name, pattern, operations in allowed
        for operation in operations
    ]
    admin = admin_client(settings)
    try:
        result = admin.create_acls(acls)
    except KafkaError as e:
        raise LogError(f"creating ACLs failed: {e}") from e
    finally:
        admin.close()
    failed = result.get("failed") or []
    if failed:
        raise LogError(f"{len(failed)} ACL(s) were refused: {failed[0]}")
    return len(result.get("succeeded") or [])
