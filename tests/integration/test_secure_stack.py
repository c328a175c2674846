"""The whole path with SASL_SSL and ACLs on: each principal may do what its role needs, no more."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from deploy.harness import free_port, read_env, stack_command, wait_for
from milpa_sessions.cli import main
from milpa_sessions.settings import Settings
from processors.sinks import FencedSnapshotSink
from producers.decisions import DecisionSubscriber
from producers.kafka_log import KafkaEventLog
from producers.store import SessionStore
from producers.topics import ensure_topics
from projections.redis_store import RedisProjectionStore
from schemas.errors import LogError, ProjectionError
from session_model.policy import permission_question
from session_model.principal import Principal
from session_model.projection import BatchFolder, Position, Record
from tests.integration.conftest import with_keys
from tests.unit.builders import started

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def secure_stack(
    secured: Settings, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, Any]]:
    """A broker on SASL_SSL (SCRAM users, ACLs) and its Redis: the run's own when it is one
    (`./dev test --secure`: its secrets directory holds every role's password beside the
    admin's), else one of this module's own (the plain pass)."""
    admin_secret = os.environ.get("MILPA_TEST_KAFKA_ADMIN_PASSWORD_FILE")
    if secured.kafka_access().sasl and admin_secret is not None:
        yield {
            "env": {
                "MILPA_KAFKA_BOOTSTRAP": secured.kafka_bootstrap,
                "MILPA_REDIS_URL": secured.redis_url,
                "MILPA_KAFKA_CA_FILE": str(secured.kafka_ca_file),
            },
            "secrets": Path(admin_secret).parent,
        }
        return
    state = tmp_path_factory.mktemp("secure") / "stack"
    env = {
        **os.environ,
        "MILPA_STACK_DIR": str(state),
        "MILPA_KAFKA_PORT": str(free_port()),
        "MILPA_KAFKA_CONTROLLER_PORT": str(free_port()),
        "MILPA_REDIS_PORT": str(free_port()),
    }
    done = stack_command("up", "--secure", env=env, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    values = read_env(state / "stack.env")
    secrets = state / "secure"
    yield {"env": values, "secrets": secrets}
    stack_command("down", env=env, timeout=120, check=False)


def _as(base: Settings, stack: dict[str, Any], user: str) -> Settings:
    """`base` on the secure stack, as SCRAM user `user` (and the Redis user of that role)."""
    env = stack["env"]
    redis_user = "operator" if user == "admin" else user
    return replace(
        base,
        kafka_bootstrap=env["MILPA_KAFKA_BOOTSTRAP"],
        redis_url=env["MILPA_REDIS_URL"],
        kafka_security_protocol="SASL_SSL",
        kafka_ca_file=Path(env["MILPA_KAFKA_CA_FILE"]),
        kafka_username=user,
        kafka_password_file=stack["secrets"] / f"{user}.password",
        redis_username=redis_user,
        redis_password_file=stack["secrets"] / f"redis-{redis_user}.password",
    )


@pytest.fixture
def roles(settings: Settings, secure_stack: dict[str, Any]) -> dict[str, Settings]:
    """This test's topics on the secure stack, created and opened to each role by the admin
    (`acls apply` returns once the broker enforces the ACLs: no request of a role races them)."""
    as_ = {u: _as(settings, secure_stack, u) for u in ("admin", "agent", "worker", "operator")}
    ensure_topics(as_["admin"])
    applied = CliRunner().invoke(main, ["acls", "apply"], env=as_["admin"].to_env())
    assert applied.exit_code == 0, applied.output
    return as_


def test_an_agent_may_write_events_and_nothing_else(roles: dict[str, Settings]) -> None:
    agent = roles["agent"]
    events = KafkaEventLog(agent.kafka_access(), agent.events_topic)
    decisions = KafkaEventLog(agent.kafka_access(), agent.decisions_topic)
    try:
        events.append(started("allowed", session_id="sec-a"))  # `acls apply` waited: in force
        with pytest.raises(LogError, match="TopicAuthorizationFailed"):
            decisions.append(started("a forged decision", session_id="sec-a"))
    finally:
        events.close(timeout=5)
        decisions.close(timeout=5)
    refused = CliRunner().invoke(main, ["acls", "apply"], env=agent.to_env())
    assert refused.exit_code == 1
    assert refused.output.strip().splitlines()[-1].startswith("error:")
    stolen = roles["worker"].kafka_password_file
    assert stolen is not None
    wrong = CliRunner().invoke(  # the agent's name with another user's password
        main, ["topics", "create"], env={**agent.to_env(), "MILPA_KAFKA_PASSWORD_FILE": str(stolen)}
    )
    lines = wrong.output.strip().splitlines()
    assert wrong.exit_code == 1 and len(lines) == 1 and "Kafka" in lines[0], wrong.output
    assert stolen.read_text().strip() not in wrong.output


def test_the_end_to_end_path_works_with_tls_acls_and_signed_authority(
    roles: dict[str, Settings], start_worker: Any, tmp_path: Path
) -> None:
    made = CliRunner().invoke(main, ["keys", "generate", "ops-1", "--dir", str(tmp_path)])
    assert made.exit_code == 0, made.output
    worker = with_keys(roles["worker"], trusted_keys_dir=tmp_path / "trusted")
    start_worker(worker)
    agent_settings = roles["agent"]
    projections = RedisProjectionStore.from_url(  # an agent reads Redis, never writes it
        agent_settings.redis_url,
        agent_settings.redis_keys(),
        auth=agent_settings.redis_auth(),
    )
    log = KafkaEventLog(agent_settings.kafka_access(), agent_settings.events_topic)
    try:
        agent = SessionStore(log, projections, producer="agent-7", read_timeout=90)
        agent.start("sec-1", "deploy billing")
        agent.ask("sec-1", permission_question("deploy", {"env": "prod"}))
        agent.load("sec-1")
        operator_env = {
            **roles["operator"].to_env(),
            "MILPA_SIGNING_KEY": str(tmp_path / "ops-1.key"),
            "MILPA_TRUSTED_KEYS_DIR": str(tmp_path / "trusted"),
        }
        for args in (
            ["grant", "sec-1", "deploy"],
            ["answer", "sec-1", "perm:deploy", "yes", "--by", "actor:member:42", "--verified"],
        ):
            done = CliRunner().invoke(main, args, env=operator_env)
            assert done.exit_code == 0, done.output
        wait_for(lambda: bool((s := projections.load("sec-1")) and s.decisions), timeout=90)
        session = projections.load("sec-1")
        assert session is not None
        assert session.permissions == ("deploy",)
        assert session.decisions[0].by == Principal("actor:member:42", verified=True)
        with pytest.raises(ProjectionError, match=r"can.t run this command"):
            projections.commit(BatchFolder().fold({}, [Record(started("x"), Position(0, 0))]))
        operator = roles["operator"]
        subscriber = DecisionSubscriber(
            operator.kafka_access(), operator.decisions_topic, "milpa-secure-subscriber"
        )
        try:
            received: list[Any] = []
            wait_for(lambda: bool(received.extend(subscriber.poll()) or received), timeout=60)
            assert received[0].session_id == "sec-1" and received[0].answer == "yes"
        finally:
            subscriber.close()
    finally:
        log.close(timeout=5)
        projections.client.close()


def test_the_worker_and_the_operator_may_open_snapshot_writers_and_an_agent_may_not(
    roles: dict[str, Settings],
) -> None:
    """Snapshots go through transactional producers: `acls apply` grants their ids to the roles
    that write snapshots (the worker's rounds, the operator's `replay`), and to no one else."""

    async def publish(who: Settings) -> None:
        sink = FencedSnapshotSink(who.kafka_access(), who.snapshots_topic, start_timeout_s=20)
        async with sink.fenced(0) as writer:
            await writer.publish([(b"acl-check", b"not a snapshot")])

    for role in ("worker", "operator"):
        asyncio.run(publish(roles[role]))
    with pytest.raises(LogError, match="TransactionalIdAuthorizationFailed"):
        asyncio.run(publish(roles["agent"]))
