"""The operator console's HTTP API on the real stack: answers become verified decisions on
`sessions.decisions`, nothing changes without an authenticated principal, and the live feed."""

from __future__ import annotations

import json
import time
import uuid
from datetime import UTC, datetime
from typing import Any

import httpx
import pytest

from deploy.harness import end_offsets, wait_for
from producers.decisions import DecisionSubscriber
from producers.questions import QuestionSubscriber
from producers.store import deadline_in
from projections.redis_store import RedisProjectionStore
from session_model.session import Question
from tests.integration.conftest import damage_state
from tests.integration.console_support import ConsoleStack

pytestmark = pytest.mark.integration


def _waiting(stack: ConsoleStack, *, seconds: float = 600, reason: str = "permission") -> str:
    """A session whose agent asks a question; returns its id once the question waits."""
    sid = f"c-{uuid.uuid4().hex[:8]}"
    stack.agent.start(sid, "tidy the repo")
    deadline = deadline_in(datetime.now(UTC), seconds)
    stack.agent.ask(
        sid, Question("q1", "May I delete build/?", ("yes", "no"), "disk", deadline, reason)
    )
    wait_for(lambda: (s := stack.agent.find(sid)) is not None and s.question is not None, 60)
    return sid


def _events(stack: ConsoleStack) -> int:
    ends = end_offsets(stack.settings.kafka_access().kafka_python(), stack.settings.events_topic)
    return sum(ends.values())


def test_the_inbox_lists_what_waits_by_deadline_for_a_bearer_token(
    console_stack: ConsoleStack,
) -> None:
    later = _waiting(console_stack, seconds=900)
    sooner = _waiting(console_stack, seconds=300, reason="signature_free")
    headers = {"Authorization": f"Bearer {console_stack.token}"}
    with console_stack.client() as client:
        page = client.get("/api/v1/questions", headers=headers).json()
        ids = [q["session_id"] for q in page["items"]]
        assert ids.index(sooner) < ids.index(later) and page["total"] >= 2
        only = client.get("/api/v1/questions?reason=signature_free", headers=headers).json()
        assert [q["session_id"] for q in only["items"]] == [sooner]
        assert client.get("/api/v1/questions/reasons", headers=headers).json()["permission"] >= 1
        one = client.get(f"/api/v1/sessions/{later}", headers=headers).json()
        assert one["question"]["id"] == "q1" and one["status"] == "waiting"
        assert client.get("/api/v1/questions?after=garbage", headers=headers).status_code == 422
        assert client.get("/openapi.json", headers=headers).json()["paths"]["/api/v1/questions"]
        assert client.get("/openapi.json").status_code == 401


def test_unauthenticated_and_csrf_less_writes_are_refused_and_append_nothing(
    console_stack: ConsoleStack,
) -> None:
    sid = _waiting(console_stack)
    before = _events(console_stack)
    body = {"question_id": "q1", "answer": "yes"}
    with console_stack.client() as client:
        refused = client.post(f"/api/v1/sessions/{sid}/answer", json=body)
        assert refused.status_code == 401
        assert refused.headers["content-type"].startswith("application/problem+json")
        assert refused.json()["code"] == "unauthenticated"
        assert (
            client.post(f"/api/v1/sessions/{sid}/grant", json={"operation": "rm"}).status_code
            == 401
        )
        assert client.get("/api/v1/questions").status_code == 401
        page = client.post(f"/sessions/{sid}/answer", data={"question_id": "q1", "answer": "yes"})
        assert page.status_code in (303, 401) and "/sessions/" not in page.headers.get(
            "location", ""
        )
        console_stack.login(client)  # signed in, but the writes below carry no CSRF token
        csrf_less = client.post(f"/api/v1/sessions/{sid}/answer", json=body)
        assert csrf_less.status_code == 403 and csrf_less.json()["code"] == "csrf_failed"
        form = client.post(f"/sessions/{sid}/answer", data={"question_id": "q1", "answer": "yes"})
        assert form.status_code == 403
        wrong = client.post(
            f"/api/v1/sessions/{sid}/answer", json=body, headers={"X-CSRF-Token": "forged"}
        )
        assert wrong.status_code == 403
    time.sleep(1.0)  # anything appended would be in the log by now
    assert _events(console_stack) == before
    session = console_stack.agent.load(sid)
    assert session.question is not None and not session.decisions


def test_an_answer_over_http_is_a_verified_decision_of_the_operator(
    console_stack: ConsoleStack,
) -> None:
    sid = _waiting(console_stack)
    settings = console_stack.settings
    decisions = DecisionSubscriber(
        settings.kafka_access(), settings.decisions_topic, f"milpa-it-{uuid.uuid4().hex[:6]}"
    )
    questions = QuestionSubscriber(
        settings.kafka_access(), settings.questions_topic, f"milpa-it-{uuid.uuid4().hex[:6]}"
    )
    try:
        with console_stack.client() as client:
            csrf = console_stack.login(client)
            done = client.post(
                f"/api/v1/sessions/{sid}/answer",
                json={"question_id": "q1", "answer": "yes"},
                headers={"X-CSRF-Token": csrf},
            )
            assert done.status_code == 202, done.text
        found: list[Any] = []
        wait_for(
            lambda: bool(found.extend(d for d in decisions.poll() if d.session_id == sid) or found),
            60,
        )
        (decision,) = found
        assert decision.answer == "yes" and decision.question_id == "q1"
        assert decision.by is not None
        assert (decision.by.id, decision.by.verified) == ("operator:alice", True)
        feed: list[Any] = []
        wait_for(
            lambda: (
                bool(feed.extend(c for c in questions.poll() if c.session_id == sid))
                or any(c.status.value == "answered" for c in feed)
            ),
            60,
        )
        assert [c.status.value for c in feed] == ["open", "answered"]
        assert feed[1].by is not None and feed[1].by.verified
    finally:
        decisions.close()
        questions.close()
    session = console_stack.agent.load(sid)
    assert session.is_runnable()
    with console_stack.client() as client:
        page = client.get(
            "/api/v1/questions", headers={"Authorization": f"Bearer {console_stack.token}"}
        )
        assert sid not in [q["session_id"] for q in page.json()["items"]]


def test_a_late_answer_is_409_late_answer(console_stack: ConsoleStack) -> None:
    sid = _waiting(console_stack, seconds=1.0)
    wait_for(lambda: (s := console_stack.agent.find(sid)) is not None and s.ended, 60)
    with console_stack.client() as client:
        csrf = console_stack.login(client)
        late = client.post(
            f"/api/v1/sessions/{sid}/answer",
            json={"question_id": "q1", "answer": "yes"},
            headers={"X-CSRF-Token": csrf},
        )
    assert late.status_code == 409, late.text
    problem = late.json()
    assert problem["code"] == "late_answer" and problem["status"] == 409
    # The attempt is on record as the fold's rejection, and decides nothing.
    wait_for(
        lambda: (
            (s := console_stack.agent.find(sid)) is not None
            and s.rejection_counts().get("late_answer", 0) == 1
        ),
        60,
    )


def test_server_sent_events_carry_a_new_question_and_its_answer(
    console_stack: ConsoleStack,
) -> None:
    headers = {"Authorization": f"Bearer {console_stack.token}", "Accept": "text/event-stream"}
    seen: list[dict[str, Any]] = []
    deadline = time.monotonic() + 60
    sid = ""
    with (
        httpx.Client(base_url=console_stack.url, timeout=httpx.Timeout(30, read=5)) as client,
        client.stream("GET", "/api/v1/events", headers=headers) as stream,
    ):
        assert stream.status_code == 200
        assert stream.headers["content-type"].startswith("text/event-stream")
        lines = stream.iter_lines()
        time.sleep(0.5)  # the console follows the topic from its end: let it get there
        sid = _waiting(console_stack)
        event = ""
        for line in lines:
            if line.startswith("event:"):
                event = line.split(":", 1)[1].strip()
            elif line.startswith("data:") and event == "question":
                data = json.loads(line.split(":", 1)[1])
                if data.get("session_id") == sid:
                    seen.append(data)
                    break
            if time.monotonic() > deadline:
                break
    assert seen and seen[0]["status"] == "open" and seen[0]["question_id"] == "q1"


def test_grant_and_mode_are_signed_by_the_console(console_stack: ConsoleStack) -> None:
    sid = f"c-{uuid.uuid4().hex[:8]}"
    console_stack.agent.start(sid, "ship")
    wait_for(lambda: console_stack.agent.find(sid) is not None, 60)
    with console_stack.client() as client:
        csrf = console_stack.login(client)
        h = {"X-CSRF-Token": csrf}
        assert (
            client.post(
                f"/api/v1/sessions/{sid}/grant", json={"operation": "deploy"}, headers=h
            ).status_code
            == 202
        )
        assert (
            client.post(
                f"/api/v1/sessions/{sid}/mode", json={"mode": "auto"}, headers=h
            ).status_code
            == 202
        )
    wait_for(
        lambda: (
            (s := console_stack.agent.find(sid)) is not None
            and s.allows("deploy")
            and s.mode.value == "auto"
        ),
        60,
    )
    assert console_stack.agent.load(sid).rejection_counts() == {}


def test_a_damaged_session_answers_500_naming_the_rebuild_and_the_others_still_answer(
    console_stack: ConsoleStack,
) -> None:
    """A session whose stored state does not decode: no retry cures it, so not a 503 "try again
    shortly" (as before) but a 500 that says a rebuild mends it; the log has what was found."""
    damaged, fine = _waiting(console_stack), _waiting(console_stack)
    projections = console_stack.agent.projections
    assert isinstance(projections, RedisProjectionStore)
    damage_state(projections, damaged)
    headers = {"Authorization": f"Bearer {console_stack.token}"}
    with console_stack.client() as client:
        refused = client.get(f"/api/v1/sessions/{damaged}", headers=headers)
        assert refused.status_code == 500, refused.text
        assert refused.json()["code"] == "projection_corrupt"
        assert "replay --session ID --force" in refused.json()["detail"]
        assert client.get(f"/api/v1/sessions/{fine}", headers=headers).status_code == 200
        console_stack.login(client)
        page = client.get(f"/sessions/{damaged}")
        assert page.status_code == 500 and "replay --session ID --force" in page.text
        assert client.get(f"/sessions/{fine}").status_code == 200
    assert "layout 9" in console_stack.log.read_text()


def test_an_inbox_entry_that_does_not_decode_is_named_and_the_others_are_listed(
    console_stack: ConsoleStack,
) -> None:
    """Before, one damaged entry of the waiting-questions index failed every operator's inbox."""
    damaged, fine = _waiting(console_stack), _waiting(console_stack)
    projections = console_stack.agent.projections
    assert isinstance(projections, RedisProjectionStore)
    cards = projections.keys.waiting_cards(projections.keys.partition_of(damaged))
    assert projections.client.hexists(cards, damaged)
    projections.client.hset(cards, damaged, b"{damaged")
    headers = {"Authorization": f"Bearer {console_stack.token}"}
    with console_stack.client() as client:
        page = client.get("/api/v1/questions?limit=500", headers=headers)
        assert page.status_code == 200, page.text
        assert page.json()["unreadable"] == [damaged]
        listed = [q["session_id"] for q in page.json()["items"]]
        assert fine in listed and damaged not in listed
        console_stack.login(client)
        inbox = client.get("/inbox")
        assert inbox.status_code == 200 and 'id="inbox-unreadable"' in inbox.text
        assert f"/sessions/{damaged}" in inbox.text and "replay --session ID --force" in inbox.text
    assert damaged in console_stack.log.read_text()


def test_a_session_whose_timeline_entry_does_not_decode_is_shown_without_it_and_answered(
    console_stack: ConsoleStack,
) -> None:
    """Before, one damaged timeline entry made the session's page a 500: its open question could
    not be seen or answered there. Now the page names what is left out and how to mend it."""
    sid = _waiting(console_stack)
    projections = console_stack.agent.projections
    assert isinstance(projections, RedisProjectionStore)
    state = projections.keys.session(sid).state  # a young session's entries are in its hash
    assert projections.client.hexists(state, b"t1")
    projections.client.hset(state, b"t1", b"{damaged\n")
    with console_stack.client() as client:
        csrf = console_stack.login(client)
        page = client.get(f"/sessions/{sid}")
        assert page.status_code == 200, page.text
        assert 'id="session-unreadable"' in page.text and "timeline cannot be read" in page.text
        assert "replay --session ID --force" in page.text
        assert 'data-question="q1"' in page.text  # the open question, to answer
        done = client.post(
            f"/api/v1/sessions/{sid}/answer",
            json={"question_id": "q1", "answer": "yes"},
            headers={"X-CSRF-Token": csrf},
        )
        assert done.status_code == 202, done.text
    wait_for(lambda: console_stack.agent.load(sid).is_runnable(), 60)
    assert sid in console_stack.log.read_text()  # the log names the session and the damage
