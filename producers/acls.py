"""The ACLs of a secured cluster: what each kind of principal may do to the project's topics.

- an agent (a writer of session events) may only write the events topic;
- the worker reads the events topic in its consumer group, writes decisions, dead letters,
  snapshots (through the snapshot writers' transactional ids) and the scheduler's events, and
  owns the topics and groups prefixed by its group (Faust's own);
- an operator writes events (grants, answers), reads decisions and dead letters, rebuilds
  (`replay` reads the snapshots and the events topic) and may describe the workers' group
  (replay's guard).

Applied with an administrator's credentials (`milpa-sessions acls apply`); idempotent. The broker
acknowledges new ACLs once the controller committed them, and enforces them only once it applied
that metadata record, a moment later (seconds on a loaded machine): `apply_acls` returns only when
the broker lists every one of them, so the principals' next request is not refused.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from kafka.admin import (
    ACL,
    ACLFilter,
    ACLOperation,
    ACLPermissionType,
    ACLResourcePatternType,
    ResourcePattern,
    ResourcePatternFilter,
    ResourceType,
)
from kafka.errors import KafkaError

from producers.settings import StackSettings
from producers.topics import admin_client
from projections.snapshots import snapshot_writer_prefix
from schemas.errors import LogError

Grant = tuple[ResourceType, str, ACLResourcePatternType, tuple[ACLOperation, ...]]
_LITERAL, _PREFIXED = ACLResourcePatternType.LITERAL, ACLResourcePatternType.PREFIXED
_TOPIC, _GROUP, _TXN = ResourceType.TOPIC, ResourceType.GROUP, ResourceType.TRANSACTIONAL_ID
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
    # Snapshots are written through transactional producers, one id per partition.
    writers = (_TXN, snapshot_writer_prefix(snapshots), _PREFIXED, (_WRITE, _DESCRIBE))
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
                writers,
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
                writers,
                (_GROUP, group, _LITERAL, (_DESCRIBE,)),
                (_GROUP, "milpa-", _PREFIXED, (_READ, _DESCRIBE)),
            ],
        ),
    ]
    allowed: dict[str, list[Grant]] = {}
    for user, granted in roles:  # one user may hold several roles (a test principal does)
        allowed.setdefault(f"User:{user}", []).extend(granted)
    return allowed


# How long `apply_acls` waits for the broker to enforce what it created: it applies a metadata
# record within milliseconds when healthy; a broker still behind after this long is not.
ACLS_IN_FORCE_TIMEOUT = 60.0


def acl_bindings(settings: StackSettings, who: Principals | None = None) -> list[ACL]:
    """Every ACL binding `grants` stands for (what `apply_acls` creates)."""
    return [
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


def apply_acls(
    settings: StackSettings,
    who: Principals | None = None,
    *,
    timeout: float = ACLS_IN_FORCE_TIMEOUT,
) -> int:
    """Create the ACLs (with the settings' credentials: an administrator's) and return once the
    broker enforces them (`wait_for_acls`, up to `timeout` s); how many were new."""
    acls = acl_bindings(settings, who)
    admin = admin_client(settings)
    try:
        try:
            result = admin.create_acls(acls)
        except KafkaError as e:
            raise LogError(f"creating ACLs failed: {e}") from e
        failed = result.get("failed") or []
        if failed:
            raise LogError(f"{len(failed)} ACL(s) were refused: {failed[0]}")
        wait_for_acls(admin, acls, timeout=timeout)
    finally:
        admin.close()
    return len(result.get("succeeded") or [])


class DescribesAcls(Protocol):
    """What `wait_for_acls` needs of an admin client (kafka-python's `KafkaAdminClient`)."""

    def describe_acls(self, acl_filter: ACLFilter) -> tuple[list[ACL], Any]:
        """The ACLs matching the filter, and an error (raised instead, by kafka-python 3)."""
        ...


Binding = tuple[str, str, int, int, int, str, int]


def _binding(acl: ACL) -> Binding:
    pattern = acl.resource_pattern
    return (
        acl.principal,
        acl.host,
        int(acl.operation),
        int(acl.permission_type),
        int(pattern.resource_type),
        pattern.resource_name,
        int(pattern.pattern_type),
    )


def wait_for_acls(
    admin: DescribesAcls,
    acls: Sequence[ACL],
    *,
    timeout: float = ACLS_IN_FORCE_TIMEOUT,
    interval: float = 0.1,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> int:
    """Poll the broker until it lists every one of `acls`; how many rounds of requests it took.

    A broker's authorizer answers DescribeAcls and authorizes requests from the same metadata
    image, so an ACL it lists is one it enforces. One request per resource still missing a
    binding (a principal's ACLs on every other resource are left out: they pile up on a test
    broker). On a cluster, the broker asked is the one the admin client picks; the others apply
    the same record about as soon. LogError after `timeout` s, naming what is still missing.
    """
    missing: dict[tuple[int, str, int], set[Binding]] = {}
    for acl in acls:
        binding = _binding(acl)
        missing.setdefault(binding[4:], set()).add(binding)
    total = sum(len(bs) for bs in missing.values())
    deadline = clock() + timeout
    rounds = 0
    while True:
        rounds += 1
        for resource in list(missing):
            kind, name, pattern = resource
            only = ResourcePatternFilter(ResourceType(kind), name, ACLResourcePatternType(pattern))
            try:
                listed, _ = admin.describe_acls(
                    ACLFilter(None, None, ACLOperation.ANY, ACLPermissionType.ANY, only)
                )
            except KafkaError as e:
                if not e.retriable or clock() >= deadline:
                    raise LogError(f"describing ACLs failed: {e}") from e
                continue  # asked again next round
            missing[resource] -= {_binding(acl) for acl in listed}
            if not missing[resource]:
                del missing[resource]
        if not missing:
            return rounds
        if clock() >= deadline:
            left = sorted(b for bs in missing.values() for b in bs)
            raise LogError(
                f"{len(left)} of {total} ACL(s) not in force on the broker after {timeout:g} s "
                f"(it has not applied their metadata record), e.g. {_render(left[0])}"
            )
        sleep(interval)


def _render(b: Binding) -> str:
    principal, host, operation, permission, kind, name, pattern = b
    return (
        f"{ACLPermissionType(permission).name} {principal}@{host} "
        f"{ACLOperation(operation).name} on {ResourceType(kind).name} "
        f"{ACLResourcePatternType(pattern).name} {name!r}"
    )
