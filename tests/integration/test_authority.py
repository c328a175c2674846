"""Authority through Kafka → worker → Redis: unsigned authority is refused, visible and counted."""

from __future__ import annotations

import urllib.request
import uuid
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from cryptography.hazmat.primitives import serialization

from deploy.harness import free_port, read_topic, wait_for
from milpa_sessions import wiring
from milpa_sessions.cli import main
from milpa_sessions.settings import Settings
from processors.replay import replay
from producers.kafka_log import KafkaEventLog
from producers.store import SessionStore
from producers.topics import delete_topics, ensure_topics, topic_id
from projections.analytics import Analytics
from projections.redis_store import RedisProjectionStore
from schemas import events as ev
from schemas.codec import EventCodec
from schemas.errors import ConfigurationError, LogError, UnauthorizedError
from schemas.events import Event
from session_model.authority import Cutover, kafka_form
from session_model.modes import Mode
from session_model.policy import SessionPolicy, Verdict, signature_question
from session_model.principal import Principal
from session_model.session import Question
from session_model.signing import Signer, TrustedKeys
from tests.integration.conftest import _as_admin, run_cli, with_keys

pytestmark = pytest.mark.integration


def _trust(signer: Signer, directory: Path) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / f"{signer.key_id}.pem").write_bytes(
        signer.private_key.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        )
    )
    return directory


def _forged(agent: SessionStore, sid: str, type_: str, payload: dict[str, object]) -> None:
    """What a dishonest agent does: append the event itself, past the writer API's check."""
    agent.append(agent.event(sid, type_, payload))


def test_unsigned_authority_is_refused_by_the_worker_counted_and_signed_authority_applies(
    settings: Settings,
    kafka_log: KafkaEventLog,
    projections: RedisProjectionStore,
    start_worker: object,
    tmp_path: Path,
) -> None:
    operator = Signer.generate("ops-1")
    port = free_port()
    worker_settings = with_keys(
        settings, trusted_keys_dir=_trust(operator, tmp_path / "trusted"), metrics_port=port
    )
    start_worker(worker_settings)  # type: ignore[operator]
    agent = SessionStore(kafka_log, projections, producer="agent-7", read_timeout=60)
    human = SessionStore(
        kafka_log, projections, producer="console", signer=operator, read_timeout=60
    )

    agent.start("a1", "deploy the billing service")
    with pytest.raises(UnauthorizedError):
        agent.grant("a1", "deploy")  # the honest path learns at once, and appends nothing
    _forged(agent, "a1", ev.PERMISSION_GRANTED, {"operation": "deploy"})
    _forged(agent, "a1", ev.MODE_CHANGED, {"mode": "auto"})
    stranger = Signer.generate("ops-1")  # the right key id, the wrong key
    SessionStore(
        kafka_log, projections, producer="agent-7", signer=stranger, read_timeout=60
    ).grant("a1", "rm")
    _forged(agent, "a2", ev.STARTED, {"goal": "sneak in", "mode": "auto", "parent_id": None})
    agent.record_turn("a1", "assistant", "trying anyway")
    session = agent.load("a1")
    assert session.permissions == ()
    assert session.mode is Mode.ASK
    assert [r.code for r in session.rejections] == ["unauthorized"] * 3
    decided = SessionPolicy().decide(session, "deploy", mutating=True, requires_signature=False)
    assert decided is Verdict.ASK_PERMISSION
    wait_for(lambda: projections.load("a2") is not None, timeout=60)
    sneaked = projections.load("a2")
    assert sneaked is not None
    assert sneaked.started and sneaked.mode is Mode.ASK
    assert [r.code for r in sneaked.rejections] == ["unauthorized"]

    # The operator's signed grant and relaxed mode are believed.
    human.grant("a1", "deploy")
    human.set_mode("a1", "acknowledge")
    human.start("a3", "operator-launched", mode="auto")
    session = human.load("a1")
    assert (session.permissions, session.mode) == (("deploy",), Mode.ACKNOWLEDGE)
    assert human.load("a3").mode is Mode.AUTO

    counts = {c.name: c.count for c in Analytics(projections.client, projections.keys).rejections()}
    assert counts == {"unauthorized": 4}
    wait_for(lambda: _scrape(port, 'milpa_rejections_total{code="unauthorized"} 4.0'), timeout=30)


def test_a_verified_yes_written_from_a_lagging_read_does_not_land_on_the_question_asked_again(
    settings: Settings,
    kafka_log: KafkaEventLog,
    projections: RedisProjectionStore,
    start_worker: Any,
    tmp_path: Path,
) -> None:
    console = Signer.generate("console-1")
    worker_settings = with_keys(settings, trusted_keys_dir=_trust(console, tmp_path / "trusted"))
    worker = start_worker(worker_settings)
    agent = SessionStore(kafka_log, projections, producer="agent-7", read_timeout=60)
    human = SessionStore(
        kafka_log, projections, producer="console", signer=console, read_timeout=60
    )
    agent.start("b1", "deploy when allowed")
    agent.ask("b1", Question("perm:deploy", "Allow deploy?", ("yes", "no"), reason="permission"))
    first = agent.load("b1").question
    assert first is not None
    # The projection stops here (the worker is gone) while the agent, past the writer API's
    # checks, has the question refused and asks it again: same id, another asking.
    worker.stop()
    _forged(agent, "b1", ev.QUESTION_ANSWERED, {"question_id": "perm:deploy", "answer": "no"})
    _forged(
        agent,
        "b1",
        ev.QUESTION_ASKED,
        {
            "question_id": "perm:deploy",
            "question": "Allow deploy?",
            "options": ["yes", "no"],
            "reason": "permission",
        },
    )
    kafka_log.flush()
    shown = human.load("b1").question  # the lagging projection: the first asking, still open
    assert shown == first
    human.answer("b1", "perm:deploy", "yes", by=Principal("operator:alice", verified=True))
    start_worker(worker_settings)
    wait_for(lambda: projections.load("b1").rejection_counts() == {"stale_question": 1}, 60)
    session = projections.load("b1")
    assert session.question is not None and session.question.seq > first.seq  # still waiting
    assert [(d.answer, d.by) for d in session.decisions] == [("no", None)]
    assert session.permissions == ()


def _scrape(port: int, line: str) -> bool:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        return line in response.read().decode()


def test_a_rebuild_without_the_operator_key_turns_its_grants_into_rejections(
    settings: Settings,
    kafka_log: KafkaEventLog,
    projections: RedisProjectionStore,
) -> None:
    operator = Signer.generate("ops-1")
    human = SessionStore(kafka_log, projections, producer="console", signer=operator, checks=False)
    human.start("r1", "rebuild me")
    human.grant("r1", "deploy")
    kafka_log.flush()

    def rebuilt(
        keys: TrustedKeys, cutover: Cutover | None = None
    ) -> tuple[tuple[str, ...], list[str]]:
        replay(settings.kafka_access(), settings.events_topic, projections, keys, cutover=cutover)
        s = projections.load("r1")
        assert s is not None
        return s.permissions, [r.code for r in s.rejections]

    assert rebuilt(operator.trusted_keys()) == (("deploy",), [])
    assert rebuilt(TrustedKeys.none()) == ((), ["unauthorized"])  # the key was removed
    # A cut-over past the grant: records before it are legacy, believed as written.
    ends = {p: o + 1 for p, o in _positions(projections, "r1").items()}
    assert rebuilt(TrustedKeys.none(), Cutover(ends)) == (("deploy",), [])


def test_a_cutover_is_believed_only_in_the_topic_its_offsets_were_read_from(
    settings: Settings, start_worker: Any
) -> None:
    assert wiring.checked_cutover(settings) == Cutover()  # none: nothing to check
    actual = topic_id(settings, settings.events_topic)
    printed = kafka_form(actual)  # as kafka-topics --describe prints it
    unbound = with_keys(settings, authority_cutover="0:5,1:3")
    with pytest.raises(ConfigurationError, match=f"MILPA_AUTHORITY_CUTOVER={printed}@0:5,1:3"):
        wiring.checked_cutover(unbound)
    bound = with_keys(settings, authority_cutover=f"{printed}@0:5,1:3")
    assert wiring.checked_cutover(bound) == Cutover({0: 5, 1: 3}, printed)
    dashed = with_keys(settings, authority_cutover=f"{actual}@0:5,1:3")  # the UUID form too
    assert wiring.checked_cutover(dashed).before == {0: 5, 1: 3}
    with pytest.raises(ConfigurationError, match="not a topic id"):
        wiring.checked_cutover(with_keys(settings, authority_cutover="nonsense@0:5"))
    # The topic deleted and made again (or mirrored elsewhere): same name, another id.
    admin = _as_admin(settings) if settings.kafka_access().sasl else settings
    delete_topics(admin, [settings.events_topic])
    # Deletion is asynchronous: until it completes the old topic (and id) may still answer.
    wait_for(lambda: _recreated(admin, settings, actual), timeout=60)
    with pytest.raises(ConfigurationError, match="recreated or mirrored"):
        wiring.checked_cutover(bound)
    # And the processes that fold refuse to start on it.
    result = run_cli(bound, "replay", "--force")
    assert result.returncode != 0 and "recreated or mirrored" in result.stderr, result
    worker = start_worker(bound)
    wait_for(lambda: not worker.alive(), timeout=60)
    assert "recreated or mirrored" in worker.log()


def _recreated(admin: Settings, settings: Settings, old: uuid.UUID) -> bool:
    try:
        ensure_topics(admin)
        return topic_id(settings, settings.events_topic) != old
    except LogError:
        return False


def _positions(projections: RedisProjectionStore, sid: str) -> dict[int, int]:
    raw = projections.client.hget(projections.keys.session(sid).state, "mark")
    assert raw is not None
    partition, _, offset = raw.decode().partition(":")
    return {int(partition): int(offset)}


def test_a_signed_call_flows_from_the_cli_through_the_worker_once_and_a_replay_is_refused(
    settings: Settings,
    kafka_log: KafkaEventLog,
    projections: RedisProjectionStore,
    start_worker: object,
    tmp_path: Path,
) -> None:
    runner = CliRunner()
    env = settings.to_env()
    made = runner.invoke(main, ["keys", "generate", "ops-1", "--dir", str(tmp_path)], env=env)
    assert made.exit_code == 0, made.output
    start_worker(with_keys(settings, trusted_keys_dir=tmp_path / "trusted"))  # type: ignore[operator]
    agent = SessionStore(kafka_log, projections, producer="agent-7", read_timeout=60)
    args = {"service": "billing", "version": "2.0.1"}
    agent.start("c1", "release billing")
    agent.ask("c1", signature_question("deploy", args))
    agent.load("c1")

    def decide(arguments: dict[str, str]) -> Verdict:
        return SessionPolicy().decide(
            agent.load("c1"), "deploy", mutating=True, requires_signature=True, arguments=arguments
        )

    assert decide(args) is Verdict.REQUIRE_SIGNATURE
    answer = ["answer", "c1", "sign:deploy", "approved", "--by", "actor:member:42", "--verified"]
    refused = runner.invoke(main, answer, env=env)  # no operator key: nothing is signed
    assert refused.exit_code == 2
    signing = {**env, "MILPA_SIGNING_KEY": str(tmp_path / "ops-1.key")}
    shown = runner.invoke(main, [*answer, "--yes"], env=signing)
    assert shown.exit_code == 0, shown.output
    assert 'deploy {"service":"billing","version":"2.0.1"}' in shown.output
    wait_for(lambda: bool(projections.load("c1") and projections.load("c1").approvals), 60)
    assert decide(args) is Verdict.ALLOW
    assert decide({**args, "version": "6.6.6"}) is Verdict.REQUIRE_SIGNATURE
    agent.record_tool_call("c1", "deploy", args, "deployed", mutating=True)
    assert decide(args) is Verdict.REQUIRE_SIGNATURE  # used once
    session = agent.load("c1")
    assert session.approvals[0].consumed_at == session.seq
    assert session.decisions[-1].by is not None and session.decisions[-1].by.verified

    # The agent replays the approval it saw on the log for its next, identical call.
    agent.ask("c1", signature_question("deploy", args))
    seen = session.approvals[0]
    replayed = next(
        r for r in _events(kafka_log, settings) if r.payload.get("approval") is not None
    ).payload["approval"]
    assert replayed["argument_digest"] == seen.argument_digest
    _forged(
        agent,
        "c1",
        ev.QUESTION_ANSWERED,
        {"question_id": "sign:deploy", "answer": "approved", "approval": replayed},
    )
    agent.record_turn("c1", "assistant", "waiting")
    session = agent.load("c1")
    assert session.question is not None
    assert [r.code for r in session.rejections] == ["unauthorized"]
    assert decide(args) is Verdict.REQUIRE_SIGNATURE


def _events(kafka_log: KafkaEventLog, settings: Settings) -> list[Event]:
    """Every event on this test's topic, as an agent reading the log would see them."""
    kafka_log.flush()
    codec = EventCodec()
    return [
        codec.decode(record.value)
        for record in read_topic(settings.kafka_access().kafka_python(), settings.events_topic)
    ]
