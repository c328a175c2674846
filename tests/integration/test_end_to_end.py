"""One session through Kafka → Faust → Redis equals the pure fold; decisions reach a subscriber."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path

import pytest
from cryptography.hazmat.primitives import serialization

from deploy.harness import wait_for
from milpa_sessions.settings import Settings
from producers.decisions import DecisionSubscriber
from producers.kafka_log import KafkaEventLog
from producers.store import SessionStore, deadline_in
from projections.redis_store import RedisProjectionStore
from schemas import events as ev
from schemas.errors import NotYetVisibleError
from session_model.policy import permission_question
from session_model.principal import Principal
from session_model.projection import Position
from session_model.signing import Signer
from tests.integration.conftest import with_keys
from tests.integration.expected import RecordingLog, assert_projection_matches, expected_projections

pytestmark = pytest.mark.integration


def _trust(signer: Signer, directory: Path) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / f"{signer.key_id}.pem").write_bytes(
        signer.private_key.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        )
    )
    return directory


def test_one_session_end_to_end_equals_the_in_memory_fold(
    settings: Settings,
    kafka_log: KafkaEventLog,
    projections: RedisProjectionStore,
    start_worker: object,
    tmp_path: Path,
) -> None:
    signer = Signer.generate("ops-console")
    settings = with_keys(settings, trusted_keys_dir=_trust(signer, tmp_path / "trusted"))
    start_worker(settings)  # type: ignore[operator]
    log = RecordingLog(kafka_log)
    store = SessionStore(log, projections, producer="it-agent", signer=signer, read_timeout=60)
    now = datetime.now(UTC)

    store.start("s-1", "move the plugin to sqlite")
    store.record_turn("s-1", "user", "start with the repository")
    store.record_tool_call("s-1", "make", {"what": "entity"}, "ok: created", mutating=True)
    store.set_plan("s-1", "entity, then repository")
    store.set_todo("s-1", "t1", "entity", "done")
    store.set_todo("s-1", "t2", "repository", "in_progress")
    question = permission_question("migrate", {"db": "sqlite"}, expires_at=deadline_in(now, 600))
    store.ask("s-1", question)
    store.answer("s-1", question.id, "yes", Principal("actor:member:42", verified=True))
    store.grant("s-1", "migrate")
    store.record_tool_call("s-1", "migrate", {"db": "sqlite"}, "ok", mutating=True)
    store.end("s-1", "done for today")

    session = store.load("s-1")  # waits for this store's last write (read-your-writes)
    expected = expected_projections(log.events, signer.trusted_keys())
    assert_projection_matches(projections, expected)
    assert session.decisions[0].by == Principal("actor:member:42", verified=True)
    assert session.ended_because == "done for today"
    assert [e["kind"] for e in projections.timeline("s-1")][-2:] == ["open-work", "ended"]


def test_load_at_least_waits_for_the_position_and_times_out_before_it(
    settings: Settings,
    kafka_log: KafkaEventLog,
    projections: RedisProjectionStore,
    start_worker: object,
) -> None:
    store = SessionStore(kafka_log, projections, producer="it-agent", checks=False)
    position = store.start("s-rw", "read your writes")
    with pytest.raises(NotYetVisibleError):
        projections.load("s-rw", at_least=position, timeout=0.2)  # no worker yet
    start_worker()  # type: ignore[operator]
    session = projections.load("s-rw", at_least=position, timeout=60)
    assert session is not None and session.goal == "read your writes"
    with pytest.raises(NotYetVisibleError):
        projections.load(
            "s-rw", at_least=Position(position.partition, position.offset + 1), timeout=0.3
        )


def test_forged_verified_answer_is_downgraded_and_decisions_reach_a_subscriber_as_folded(
    settings: Settings,
    kafka_log: KafkaEventLog,
    projections: RedisProjectionStore,
    start_worker: object,
    tmp_path: Path,
) -> None:
    operator_key = Signer.generate("ops-console")
    settings = with_keys(settings, trusted_keys_dir=_trust(operator_key, tmp_path / "trusted"))
    start_worker(settings)  # type: ignore[operator]
    log = RecordingLog(kafka_log)
    # The agent's store holds no trusted key: it signs with a key of its own making.
    agent = SessionStore(
        log,
        projections,
        producer="agent-7",
        signer=Signer.generate("ops-console"),
        read_timeout=60,  # the worker may still be joining its group on a loaded machine
    )
    human = SessionStore(log, projections, producer="console", signer=operator_key, read_timeout=60)

    agent.start("s-forged", "approve myself")
    agent.ask("s-forged", permission_question("deploy", {"env": "prod"}))
    agent.answer("s-forged", "perm:deploy", "yes", Principal("actor:boss", verified=True))
    raw = agent.event(
        "s-forged",
        ev.QUESTION_ASKED,
        {
            "question_id": "perm:rm",
            "question": "rm -rf?",
            "options": ["yes", "no"],
            "reason": "permission",
        },
    )
    agent.append(raw)
    unsigned = agent.event(
        "s-forged",
        ev.QUESTION_ANSWERED,
        {"question_id": "perm:rm", "answer": "yes", "by": {"id": "actor:boss", "verified": True}},
    )
    agent.append(unsigned)
    human.start("s-human", "a real approval")
    human.ask("s-human", permission_question("deploy", {"env": "staging"}))
    human.answer("s-human", "perm:deploy", "yes", Principal("actor:member:42", verified=True))

    forged = projections.load("s-forged", at_least=log.positions["s-forged"], timeout=60)
    real = projections.load("s-human", at_least=log.positions["s-human"], timeout=60)
    assert forged is not None and real is not None
    assert [d.by for d in forged.decisions] == [Principal("actor:boss", verified=False)] * 2
    assert forged.downgrades == 2
    assert real.decisions[0].by == Principal("actor:member:42", verified=True)
    expected = expected_projections(log.events, operator_key.trusted_keys())
    assert_projection_matches(projections, expected)

    subscriber = DecisionSubscriber(
        settings.kafka_access(), settings.decisions_topic, "milpa-it-sub"
    )
    received: list = []
    wait_for(lambda: received.extend(subscriber.poll()) or len(received) >= 3, timeout=60)
    subscriber.close()
    folded = [(sid, d) for sid in ("s-forged", "s-human") for d in expected[sid].state.decisions]
    assert sorted(
        (d.session_id, d.seq, d.question_id, d.answer, d.by, d.event_id) for d in received
    ) == sorted((sid, d.seq, d.question_id, d.answer, d.by, d.event_id) for sid, d in folded)
    assert all(d.reason == "permission" for d in received)
