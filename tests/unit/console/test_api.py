"""The JSON API over the in-memory store: reads, the operator's acts, and their problem details."""

from __future__ import annotations

from dataclasses import replace
from datetime import timedelta
from typing import Any

import pytest
from fastapi.testclient import TestClient

from producers.store import SessionStore
from schemas.errors import (
    CorruptProjectionError,
    NoOpenQuestionError,
    ProjectionError,
    SessionRestoringError,
    UnauthorizedError,
)
from session_model.canonical import text_digest
from session_model.modes import Mode
from session_model.policy import signature_question, target_question
from session_model.principal import Principal
from session_model.session import Question
from tests.unit.builders import OPERATOR
from tests.unit.console.conftest import (
    BEARER,
    BRIDGE,
    NOW,
    FakeAnalytics,
    at,
    make_app,
    page_csrf,
    seed,
    sign_in,
)


@pytest.fixture
def api(client: TestClient, store: SessionStore) -> TestClient:
    """A service client (bearer token) over the seeded fleet."""
    seed(store)
    client.headers.update(BEARER)
    return client


def _records(store: SessionStore) -> int:
    return len(store.log.records)  # type: ignore[attr-defined]


# -- reads -----------------------------------------------------------------------------------------


def test_waiting_questions_come_soonest_deadline_first_with_total_and_cursor(
    api: TestClient,
) -> None:
    page = api.get("/api/v1/questions").json()
    assert [q["session_id"] for q in page["items"]] == ["s-b", "s-a", "s-c"]
    assert page["total"] == 3 and page["next"] is None
    first = page["items"][0]
    assert first["question_id"] == "sign:deploy"
    assert first["reason"] == "signature"
    assert first["call"] == {
        "operation": "deploy",
        "arguments": '{"env":"prod","tag":"v2"}',
        "digest": text_digest('{"env":"prod","tag":"v2"}'),
    }
    assert first["deadline_ms"] == int((NOW + timedelta(seconds=60)).timestamp() * 1000)
    assert page["items"][2]["deadline_ms"] is None

    one = api.get("/api/v1/questions", params={"limit": 1}).json()
    assert [q["session_id"] for q in one["items"]] == ["s-b"]
    assert one["total"] == 3 and one["next"]
    rest = api.get("/api/v1/questions", params={"after": one["next"]}).json()
    assert [q["session_id"] for q in rest["items"]] == ["s-a", "s-c"]

    only = api.get("/api/v1/questions", params={"reason": "permission"}).json()
    assert [q["session_id"] for q in only["items"]] == ["s-a"] and only["total"] == 1


@pytest.mark.parametrize("params", [{"after": "not-a-cursor"}, {"limit": 0}, {"limit": "x"}])
def test_an_invalid_page_request_is_422_invalid_request(
    api: TestClient, params: dict[str, object]
) -> None:
    response = api.get("/api/v1/questions", params=params)
    assert response.status_code == 422
    assert response.headers["content-type"] == "application/problem+json"
    body = response.json()
    assert body["code"] == "invalid_request" and body["status"] == 422
    assert set(body) >= {"type", "title", "status", "detail", "code"}


def test_reasons_and_the_fleet(api: TestClient, analytics: FakeAnalytics) -> None:
    assert api.get("/api/v1/questions/reasons").json() == {
        "permission": 1,
        "signature": 1,
        "style": 1,
    }
    fleet = api.get("/api/v1/fleet").json()
    assert fleet["by_status"] == {"running": 1, "waiting": 3}
    assert fleet["by_mode"] == {"ask": 4}
    assert {"status": "waiting", "mode": "ask", "count": 3} in fleet["sessions"]
    assert fleet["waiting_by_reason"] == {"permission": 1, "signature": 1, "style": 1}
    assert fleet["analytics"] is True
    assert {"hour": "2026-03-01T10:00:00+00:00", "reason": "signature", "count": 2} in fleet[
        "pauses_by_hour"
    ]
    assert fleet["time_to_answer"][0] == {
        "reason": "permission",
        "bucket": "le_5s",
        "le_seconds": 5,
        "count": 4,
    }
    assert analytics.calls == [(timedelta(hours=24), NOW, "hour")]


def test_a_session_with_its_plan_todos_and_signature_question(api: TestClient) -> None:
    s = api.get("/api/v1/sessions/s-b").json()
    assert s["goal"] == "ship the release"
    assert (s["mode"], s["status"], s["runnable"]) == ("ask", "waiting", False)
    assert s["plan"] == "build then deploy"
    assert s["todos"] == [{"id": "t1", "text": "build", "status": "done", "version": 1}]
    assert s["question"]["id"] == "sign:deploy"
    assert s["question"]["call"]["operation"] == "deploy"
    assert s["question"]["call"]["arguments"] == '{"env":"prod","tag":"v2"}'
    assert s["decisions"] == [] and s["ended_because"] is None
    assert s["unreadable"] == []


def test_the_window_and_the_timeline_as_sentences(api: TestClient) -> None:
    window = api.get("/api/v1/sessions/s-b/window").json()
    assert window[0]["role"] == "system" and "Plan of this session" in window[0]["content"]
    assert window[-1] == {"role": "user", "content": "please ship"}
    timeline = api.get("/api/v1/sessions/s-b/timeline").json()
    sentences = [e["sentence"] for e in timeline]
    assert "The plan was set (version 1): «build then deploy»" in sentences
    assert "The user said «please ship»" in sentences
    assert all(e["seq"] > 3 for e in api.get("/api/v1/sessions/s-b/timeline?since=3").json())


def test_an_unknown_session_is_404(api: TestClient) -> None:
    response = api.get("/api/v1/sessions/nope")
    assert response.status_code == 404
    assert response.json()["code"] == "unknown_session"


def _reading_raises(
    api: TestClient, store: SessionStore, monkeypatch: pytest.MonkeyPatch, error: Exception
) -> Any:
    """GET a session whose projection read raises `error`."""

    def broken(*args: object, **kwargs: object) -> None:
        raise error

    monkeypatch.setattr(store.projections, "load", broken)
    return api.get("/api/v1/sessions/s-a")


@pytest.mark.parametrize(
    "case",
    [
        # A backend away: 503, without details (they name hosts).
        (ProjectionError("redis://10.0.0.7:6379 refused"), 503, "projection_unavailable", "again"),
        # Damaged: no retry cures it, a rebuild (or a console as new as the workers) does.
        (
            CorruptProjectionError("s-a: the stored state has layout 9, this version reads 6"),
            500,
            "projection_corrupt",
            "will not help: if the console is older than the workers, upgrade it; otherwise an "
            "operator rebuilds the session with `milpa-sessions replay --session ID --force`",
        ),
        # Half rebuilt: 409, saying how to make it whole.
        (
            SessionRestoringError("session 's-a' is half rebuilt: … `replay --session s-a`"),
            409,
            "session_restoring",
            "replay --session s-a",
        ),
    ],
    ids=["Redis away", "damaged", "half rebuilt"],
)
def test_a_session_that_cannot_be_read_is_answered_by_what_would_mend_it(
    api: TestClient,
    store: SessionStore,
    monkeypatch: pytest.MonkeyPatch,
    case: tuple[Exception, int, str, str],
) -> None:
    error, status, code, says = case
    response = _reading_raises(api, store, monkeypatch, error)
    assert response.status_code == status and response.json()["code"] == code
    assert says in response.json()["detail"]
    assert "10.0.0.7" not in response.text and "layout 9" not in response.text
    assert "Traceback" not in response.text


def test_a_session_whose_decisions_history_does_not_read_is_answered_with_the_states(
    api: TestClient, store: SessionStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its recent decisions (those the state keeps), named `unreadable`: the open question
    stays answerable, while `/timeline` alone, which has nothing else to give, answers 500."""
    store.answer("s-a", "perm:rm", "yes", Principal("ops:bob"))

    def broken(*args: object, **kwargs: object) -> None:
        raise CorruptProjectionError("s-a: entry 3 is not JSON")

    monkeypatch.setattr(store.projections, "facts", broken)
    monkeypatch.setattr(store.projections, "timeline", broken)
    response = api.get("/api/v1/sessions/s-a")
    assert response.status_code == 200
    s = response.json()
    assert s["unreadable"] == ["decisions"]
    assert [(d["question_id"], d["answer"]) for d in s["decisions"]] == [("perm:rm", "yes")]
    timeline = api.get("/api/v1/sessions/s-a/timeline")
    assert timeline.status_code == 500 and timeline.json()["code"] == "projection_corrupt"


# -- answers ---------------------------------------------------------------------------------------


def test_an_operators_answer_is_a_verified_decision_as_operator_name(
    operator: TestClient, store: SessionStore
) -> None:
    seed(store)
    asked = store.load("s-a").question
    assert asked is not None
    response = operator.post(
        "/api/v1/sessions/s-a/answer",
        json={"question_id": "perm:rm", "answer": "yes", "asked_seq": asked.seq},
        headers={"X-CSRF-Token": page_csrf(operator)},
    )
    assert response.status_code == 202
    assert response.json()["position"] == f"0:{_records(store) - 1}"
    session = store.load("s-a")
    assert session.question is None
    decision = session.decisions[-1]
    # Verified survives the fold: the console's key signed it and the fold trusts that key.
    assert decision.by == Principal("operator:alice", verified=True)
    assert (decision.answer, decision.executor) == ("yes", "console")
    assert session.downgrades == 0
    detail = operator.get("/api/v1/sessions/s-a").json()
    assert detail["decisions"][0]["by"] == "operator:alice"
    assert detail["decisions"][0]["verified"] is True
    # «Allow rm in this session?» — yes grants it too, signed by the console's key.
    assert session.allows("rm")
    assert session.rejection_counts() == {}


def test_a_no_to_a_permission_question_grants_nothing(
    operator: TestClient, store: SessionStore
) -> None:
    seed(store)
    response = operator.post(
        "/api/v1/sessions/s-a/answer",
        json={"question_id": "perm:rm", "answer": "no"},
        headers={"X-CSRF-Token": page_csrf(operator)},
    )
    assert response.status_code == 202
    session = store.load("s-a")
    assert session.question is None and not session.allows("rm")


@pytest.mark.parametrize("answer", ["No, keep waiting", "Yes"])
def test_a_permission_question_with_options_of_the_askers_choosing_grants_nothing(
    operator: TestClient, store: SessionStore, answer: str
) -> None:
    """Whoever asks chooses the options: a refusal put first (or a "Yes" not the canonical
    one) must not make the console sign a grant."""
    store.start("s-x", "deploy")
    asked = Question(
        "perm:deploy", "Allow «deploy»?", ("No, keep waiting", "Yes"), "{}", at(600), "permission"
    )
    store.ask("s-x", asked)
    before = _records(store)
    response = operator.post(
        "/api/v1/sessions/s-x/answer",
        json={"question_id": "perm:deploy", "answer": answer},
        headers={"X-CSRF-Token": page_csrf(operator)},
    )
    assert response.status_code == 202
    assert _records(store) == before + 1  # the answer alone, no grant before it
    session = store.load("s-x")
    assert session.question is None and not session.allows("deploy")


def test_an_answer_to_a_question_asked_again_since_it_was_shown_is_refused(
    operator: TestClient, store: SessionStore
) -> None:
    """The operator was shown one asking; the agent answered it itself and asked the same id
    again with other arguments. The operator's answer must not land on (or sign) the new one."""
    seed(store)
    shown = operator.get("/api/v1/sessions/s-a").json()["question"]
    store.answer("s-a", "perm:rm", "no")  # the agent, unverified
    again = Question(
        "perm:rm", "Allow «rm»?", ("yes", "no"), '{"path": "/"}', at(600), "permission"
    )
    store.ask("s-a", again)
    before = _records(store)
    response = operator.post(
        "/api/v1/sessions/s-a/answer",
        json={"question_id": "perm:rm", "answer": "yes", "asked_seq": shown["seq"]},
        headers={"X-CSRF-Token": page_csrf(operator)},
    )
    assert response.status_code == 409
    assert "asked again" in response.json()["detail"]
    assert _records(store) == before  # no grant, no answer
    session = store.load("s-a")
    assert session.question is not None and not session.allows("rm")
    current = operator.get("/api/v1/sessions/s-a").json()["question"]["seq"]
    answered = operator.post(
        "/api/v1/sessions/s-a/answer",
        json={"question_id": "perm:rm", "answer": "yes", "asked_seq": current},
        headers={"X-CSRF-Token": page_csrf(operator)},
    )
    assert answered.status_code == 202 and store.load("s-a").allows("rm")


def test_a_yes_to_a_permission_question_asked_again_after_the_consoles_read_grants_nothing(
    operator: TestClient, store: SessionStore
) -> None:
    """The console read the first asking; the agent answered and re-asked before the store's
    read. The store refuses the answer, and the grant that goes with a yes is not made either."""
    seed(store)
    shown = store.load("s-a")
    store.answer("s-a", "perm:rm", "no")  # the agent, unverified
    store.ask(
        "s-a",
        Question("perm:rm", "Allow «rm»?", ("yes", "no"), '{"path": "/"}', at(600), "permission"),
    )
    _first_read_stale(store, "s-a", shown)
    before = _records(store)
    assert shown.question is not None
    response = operator.post(
        "/api/v1/sessions/s-a/answer",
        json={"question_id": "perm:rm", "answer": "yes", "asked_seq": shown.question.seq},
        headers={"X-CSRF-Token": page_csrf(operator)},
    )
    assert response.status_code == 409
    assert _records(store) == before  # no grant, no answer
    assert not store.load("s-a").allows("rm")


def test_a_yes_that_turns_late_between_the_consoles_read_and_the_stores_grants_nothing(
    operator: TestClient, store: SessionStore
) -> None:
    """The console read «Allow rm?» open; its window closed before the store's read: the late
    yes is on record (409 late_answer) and no grant goes with it."""
    store.start("s-l", "g")
    store.ask("s-l", Question("perm:rm", "Allow «rm»?", ("yes", "no"), "{}", at(1), "permission"))
    shown = store.load("s-l")
    assert store.expire_if_due("s-l", NOW + timedelta(seconds=5))
    _first_read_stale(store, "s-l", shown)
    before = _records(store)
    assert shown.question is not None
    response = operator.post(
        "/api/v1/sessions/s-l/answer",
        json={"question_id": "perm:rm", "answer": "yes", "asked_seq": shown.question.seq},
        headers={"X-CSRF-Token": page_csrf(operator)},
    )
    assert response.status_code == 409 and response.json()["code"] == "late_answer"
    assert _records(store) == before + 1  # the late answer, for the record; no grant
    assert not store.load("s-l").allows("rm")


def test_the_store_refuses_an_answer_to_another_asking(store: SessionStore) -> None:
    seed(store)
    asked = store.load("s-a").question
    assert asked is not None
    before = _records(store)
    with pytest.raises(NoOpenQuestionError, match="asked again"):
        store.answer("s-a", "perm:rm", "yes", asked_seq=asked.seq + 1)
    assert _records(store) == before


def test_an_answer_that_is_not_an_option_is_422(api: TestClient, store: SessionStore) -> None:
    before = _records(store)
    response = api.post(
        "/api/v1/sessions/s-a/answer", json={"question_id": "perm:rm", "answer": "maybe"}
    )
    assert response.status_code == 422
    assert response.json()["code"] == "invalid_answer"
    assert _records(store) == before


def test_answering_a_question_that_is_not_open_is_409(api: TestClient) -> None:
    response = api.post(
        "/api/v1/sessions/s-a/answer", json={"question_id": "other", "answer": "yes"}
    )
    assert response.status_code == 409
    assert response.json()["code"] == "no_open_question"


def test_a_late_answer_is_409_late_answer(api: TestClient, store: SessionStore) -> None:
    store.start("s-late", "g")
    store.ask("s-late", Question("q", "Now?", ("yes", "no"), expires_at=at(1)))
    assert store.expire_if_due("s-late", NOW + timedelta(seconds=5))
    response = api.post(
        "/api/v1/sessions/s-late/answer", json={"question_id": "q", "answer": "yes"}
    )
    assert response.status_code == 409
    assert response.json()["code"] == "late_answer"
    # The attempt is on record, and decided nothing.
    assert [d.answer for d in store.load("s-late").decisions] == [""]


def test_a_signature_question_is_answered_only_by_approving_it(
    api: TestClient, store: SessionStore
) -> None:
    """Answering signs the call: a "no" with the confirmation must not become an approval."""
    before = _records(store)
    for answer, confirm in (("no", "deploy"), ("decline", None), ("", "deploy")):
        body = {"question_id": "sign:deploy", "answer": answer, "confirm": confirm}
        response = api.post("/api/v1/sessions/s-b/answer", json=body)
        assert response.status_code == 422
        assert response.json()["code"] == "invalid_answer"
        assert "to decline, let its window close" in response.json()["detail"]
    assert _records(store) == before
    assert store.load("s-b").approvals == ()


def test_a_call_whose_operation_shows_as_another_name_is_not_signed(
    api: TestClient, store: SessionStore
) -> None:
    """The agent names the operation: with a bidirectional override it would read as another
    name on the page and in the confirmation typed back."""
    store.start("s-odd", "g")
    odd = "drop_table\u202e\u2066staging\u2069"
    store.ask("s-odd", signature_question(odd, {"target": "prod"}, expires_at=at(600)))
    asked = store.load("s-odd").question
    assert asked is not None
    before = _records(store)
    body = {"question_id": asked.id, "answer": "approved", "confirm": odd, "asked_seq": asked.seq}
    response = api.post("/api/v1/sessions/s-odd/answer", json=body)
    assert response.status_code == 422
    assert response.json()["code"] == "invalid_answer"
    assert "<U+202E>" in response.json()["detail"]
    assert _records(store) == before and store.load("s-odd").approvals == ()


def test_a_signature_question_needs_the_operation_typed_back(
    api: TestClient, store: SessionStore
) -> None:
    before = _records(store)
    asked = store.load("s-b").question
    assert asked is not None
    body = {"question_id": "sign:deploy", "answer": "approved", "asked_seq": asked.seq}
    for confirm in (None, "yes", "Deploy"):
        response = api.post("/api/v1/sessions/s-b/answer", json={**body, "confirm": confirm})
        assert response.status_code == 422
        assert response.json()["code"] == "confirmation_required"
    assert _records(store) == before
    response = api.post("/api/v1/sessions/s-b/answer", json={**body, "confirm": "deploy"})
    assert response.status_code == 202
    session = store.load("s-b")
    assert session.decisions[-1].affirmative  # the approval was accepted by the fold
    assert [(a.operation, a.consumed_at) for a in session.approvals] == [("deploy", None)]


@pytest.mark.parametrize(
    ("session_id", "body"),
    [
        ("s-b", {"question_id": "sign:deploy", "answer": "approved", "confirm": "deploy"}),
        ("s-a", {"question_id": "perm:rm", "answer": "yes"}),
    ],
)
def test_an_answer_that_signs_must_name_the_asking_it_was_read_from(
    api: TestClient, store: SessionStore, session_id: str, body: dict[str, str]
) -> None:
    """The agent may ask again, with other arguments, after the caller read the question: what
    would be signed is what is asked now, so the caller names the asking it read."""
    before = _records(store)
    response = api.post(f"/api/v1/sessions/{session_id}/answer", json=body)
    assert response.status_code == 422
    assert response.json()["code"] == "confirmation_required"
    assert "send `asked_seq`" in response.json()["detail"]
    assert _records(store) == before


def test_a_yes_that_confirms_a_target_must_name_the_asking_too(
    api: TestClient, store: SessionStore
) -> None:
    """«Deploy to staging?» read, then asked again under the same id naming prod: a yes without
    the asking would confirm prod (`Session.confirmed`)."""
    store.start("s-t", "ship")
    why = '{"operation": "deploy", "target": "prod"}'
    target = Question("target:deploy", "Deploy there?", ("yes", "no"), why, at(600))
    store.ask("s-t", replace(target, reason="target_not_named"))
    before = _records(store)
    body = {"question_id": "target:deploy", "answer": "yes"}
    response = api.post("/api/v1/sessions/s-t/answer", json=body)
    assert response.status_code == 422
    assert response.json()["code"] == "confirmation_required"
    assert _records(store) == before
    asked = store.load("s-t").question
    assert asked is not None
    response = api.post("/api/v1/sessions/s-t/answer", json={**body, "asked_seq": asked.seq})
    assert response.status_code == 202
    assert store.load("s-t").confirmed("deploy", "prod")


def test_a_body_missing_fields_is_422_invalid_request(api: TestClient) -> None:
    response = api.post("/api/v1/sessions/s-a/answer", json={"answer": "yes"})
    assert response.status_code == 422
    body = response.json()
    assert body["code"] == "invalid_request"
    assert body["errors"][0]["where"] == "body.question_id"


# -- the other acts --------------------------------------------------------------------------------


def test_grant_revoke_mode_and_end(api: TestClient, store: SessionStore) -> None:
    assert api.post("/api/v1/sessions/s-d/grant", json={"operation": "deploy"}).status_code == 202
    assert store.load("s-d").permissions == ("deploy",)
    assert api.post("/api/v1/sessions/s-d/revoke", json={"operation": "deploy"}).status_code == 202
    assert store.load("s-d").permissions == ()
    assert api.post("/api/v1/sessions/s-d/mode", json={"mode": "auto"}).status_code == 202
    assert store.load("s-d").mode is Mode.AUTO  # signed: the fold believed it
    bad = api.post("/api/v1/sessions/s-d/mode", json={"mode": "yolo"})
    assert bad.status_code == 422 and bad.json()["code"] == "invalid_request"
    assert api.post("/api/v1/sessions/s-d/end", json={"because": "done"}).status_code == 202
    assert store.load("s-d").ended_because == "done (ended by service:deployer)"
    again = api.post("/api/v1/sessions/s-d/end", json={"because": "again"})
    assert again.status_code == 409 and again.json()["code"] == "session_ended"


def test_a_service_without_the_operator_scope_cannot_make_a_session_less_supervised(
    client: TestClient, store: SessionStore
) -> None:
    """A bridge's token answers and tightens; granting, relaxing a mode and signing a call (or
    the grant a yes to a permission question carries), and confirming a target, are operators'
    acts."""
    seed(store)
    store.start("s-t", "deploy somewhere")
    store.ask("s-t", target_question("deploy", "prod", "Deploy to prod?", at(600)))
    asked = store.load("s-t").question
    assert asked is not None
    before = _records(store)

    def as_bridge(session: str, act: str, body: dict[str, str]) -> Any:
        return client.post(f"/api/v1/sessions/{session}/{act}", json=body, headers=BRIDGE)

    refused = [
        as_bridge("s-d", "grant", {"operation": "rm"}),
        as_bridge("s-d", "mode", {"mode": "auto"}),
        as_bridge("s-a", "answer", {"question_id": "perm:rm", "answer": "yes"}),
        as_bridge(
            "s-b",
            "answer",
            {"question_id": "sign:deploy", "answer": "approved", "confirm": "deploy"},
        ),
        as_bridge(
            "s-t", "answer", {"question_id": asked.id, "answer": "yes", "asked_seq": asked.seq}
        ),
    ]
    assert [r.status_code for r in refused] == [403] * 5
    assert {r.json()["code"] for r in refused} == {"unauthorized"}
    assert "operator` scope" in refused[0].json()["detail"]
    assert _records(store) == before
    allowed = [
        as_bridge("s-d", "mode", {"mode": "ask"}),
        as_bridge("s-d", "revoke", {"operation": "rm"}),
        as_bridge("s-a", "answer", {"question_id": "perm:rm", "answer": "no"}),
        as_bridge("s-c", "answer", {"question_id": "q-c", "answer": "formal"}),
        as_bridge(
            "s-t", "answer", {"question_id": asked.id, "answer": "no", "asked_seq": asked.seq}
        ),
    ]
    assert [r.status_code for r in allowed] == [202] * 5
    assert store.load("s-c").decisions[-1].by == Principal("service:bridge", verified=True)
    assert not store.load("s-t").confirmed("deploy", "prod")


def _first_read_stale(store: SessionStore, session_id: str, stale: Any) -> None:
    """The next `load` of the session returns `stale` (an earlier state); later ones the truth.

    What a console request sees when the session changes between its check and the store's own
    read (another writer appends in between).
    """
    real = store.load
    served: list[bool] = []

    def load(sid: str, at_least: Any = None) -> Any:
        if sid == session_id and not served:
            served.append(True)
            return stale
        return real(sid, at_least)

    store.load = load  # type: ignore[method-assign]


def test_a_bridge_cannot_get_a_call_signed_by_racing_the_question(
    client: TestClient, store: SessionStore
) -> None:
    store.start("s-r", "drop the table")
    before_asking = store.load("s-r")
    store.ask("s-r", signature_question("drop_db", {"db": "prod"}, at(600)))
    _first_read_stale(store, "s-r", before_asking)  # the console read before the agent asked
    before = _records(store)
    response = client.post(
        "/api/v1/sessions/s-r/answer",
        json={"question_id": "sign:drop_db", "answer": "whatever"},
        headers=BRIDGE,
    )
    assert response.status_code == 409  # not the open question when the console checked
    assert _records(store) == before
    # And the store, asked directly on behalf of such a caller, refuses on its own read.
    with pytest.raises(UnauthorizedError):
        store.answer("s-r", "sign:drop_db", "ok", Principal("service:bridge"), may_relax=False)
    assert _records(store) == before


def test_a_bridge_tightening_the_mode_is_never_turned_into_a_signed_relaxation(
    client: TestClient, store: SessionStore
) -> None:
    store.start("s-m", "g")
    store.set_mode("s-m", "auto")  # the operator's signed act
    in_auto = store.load("s-m")
    store.set_mode("s-m", "ask")  # an operator tightens to ask ...
    _first_read_stale(store, "s-m", in_auto)  # ... after the console read auto
    before = _records(store)
    response = client.post(  # ... and the bridge's acknowledge would now relax it
        "/api/v1/sessions/s-m/mode", json={"mode": "acknowledge"}, headers=BRIDGE
    )
    assert response.status_code == 403
    assert _records(store) == before
    assert store.load("s-m").mode is Mode.ASK


def test_an_operator_tightening_the_mode_is_not_signed_as_a_relaxation_either(
    client: TestClient, store: SessionStore
) -> None:
    store.start("s-o", "g")
    store.set_mode("s-o", "auto")
    in_auto = store.load("s-o")
    store.set_mode("s-o", "ask")  # another operator tightened meanwhile
    _first_read_stale(store, "s-o", in_auto)
    before = _records(store)
    response = client.post(
        "/api/v1/sessions/s-o/mode", json={"mode": "acknowledge"}, headers=BEARER
    )  # asked as a tightening from auto: never signed as a relaxation from ask
    assert response.status_code == 403
    assert _records(store) == before


def test_a_late_yes_to_a_permission_question_is_no_bridge_s_act_either(
    client: TestClient, store: SessionStore
) -> None:
    store.start("s-l", "g")
    store.ask("s-l", Question("perm:rm", "Allow rm?", ("yes", "no"), "{}", at(60), "permission"))
    store.expire_if_due("s-l", NOW + timedelta(seconds=61))
    before = _records(store)
    response = client.post(
        "/api/v1/sessions/s-l/answer",
        json={"question_id": "perm:rm", "answer": "yes"},
        headers=BRIDGE,
    )
    assert response.status_code == 403
    assert _records(store) == before


@pytest.mark.parametrize(
    ("signed", "options"),
    [(False, ("yes", "no")), (True, ("yes", "no", "later")), (False, ("yes", "no", "later"))],
)
def test_a_bridge_cannot_say_yes_to_a_permission_question_however_it_is_asked(
    settings: object, signed: bool, options: tuple[str, ...]
) -> None:
    store = SessionStore.in_memory(signer=OPERATOR if signed else None)
    store.start("s1", "g")
    store.ask("s1", Question("perm:rm", "Allow rm?", options, "{}", at(600), "permission"))
    app = make_app(store, settings)  # type: ignore[arg-type]
    before = _records(store)
    with TestClient(app, headers=BRIDGE) as bridge:
        yes = bridge.post(
            "/api/v1/sessions/s1/answer", json={"question_id": "perm:rm", "answer": "yes"}
        )
        assert yes.status_code == 403
        assert _records(store) == before
        no = bridge.post(
            "/api/v1/sessions/s1/answer", json={"question_id": "perm:rm", "answer": "no"}
        )
        assert no.status_code == 202


def test_without_an_operator_key_authority_is_refused_403(settings: object) -> None:
    store = SessionStore.in_memory()
    store.start("s1", "g")
    app = make_app(store, settings)  # type: ignore[arg-type]
    with TestClient(app, headers=BEARER) as client:
        response = client.post("/api/v1/sessions/s1/grant", json={"operation": "deploy"})
    assert response.status_code == 403
    assert response.json()["code"] == "unauthorized"
    assert store.load("s1").permissions == ()


def test_the_openapi_document_is_served_but_no_cdn_backed_ui(client: TestClient) -> None:
    doc = client.get("/openapi.json", headers=BEARER).json()
    assert "/api/v1/questions" in doc["paths"]
    assert "post" in doc["paths"]["/api/v1/sessions/{session_id}/answer"]
    assert "/login" not in doc["paths"]  # the pages are not part of the API
    assert "/openapi.json" not in doc["paths"]
    assert doc["components"]["schemas"]["AnswerRequest"]["properties"]["answer"]["maxLength"]
    assert client.get("/docs").status_code == 404
    assert client.get("/redoc").status_code == 404


def test_the_openapi_document_needs_the_api_s_authentication(client: TestClient) -> None:
    refused = client.get("/openapi.json")
    assert refused.status_code == 401
    assert refused.headers["content-type"].startswith("application/problem+json")
    assert refused.json()["code"] == "unauthenticated"
    assert refused.headers["WWW-Authenticate"].startswith("Bearer")
    wrong = client.get("/openapi.json", headers={"Authorization": "Bearer not-a-token"})
    assert wrong.status_code == 401
    assert client.get("/openapi.json", headers=BRIDGE).status_code == 200  # any API caller
    assert sign_in(client).status_code == 303
    assert "/api/v1/fleet" in client.get("/openapi.json").json()["paths"]  # an operator's cookie


def test_an_answer_naming_an_earlier_asking_after_the_close_is_session_ended_for_anyone(
    client: TestClient, store: SessionStore
) -> None:
    """Not late (the store and the fold agree): a limited caller's yes to `perm:` is refused
    as any write to an ended session is, not as an act it may not make."""
    store.start("s-old", "g")
    store.ask("s-old", Question("perm:rm", "Allow rm?", ("yes", "no"), reason="permission"))
    store.answer("s-old", "perm:rm", "no")
    store.ask(
        "s-old",
        Question("perm:rm", "Allow rm?", ("yes", "no"), expires_at=at(1), reason="permission"),
    )
    assert store.expire_if_due("s-old", NOW + timedelta(seconds=5))
    closed = store.load("s-old").closed_question
    assert closed is not None
    before = _records(store)
    response = client.post(
        "/api/v1/sessions/s-old/answer",
        json={"question_id": "perm:rm", "answer": "yes", "asked_seq": closed.seq - 2},
        headers=BRIDGE,
    )
    assert response.status_code == 409
    assert response.json()["code"] == "session_ended"
    assert _records(store) == before


def test_the_timeline_can_be_asked_for_its_latest_entries_only(api: TestClient) -> None:
    whole = api.get("/api/v1/sessions/s-b/timeline").json()
    assert len(whole) > 2
    assert api.get("/api/v1/sessions/s-b/timeline?latest=2").json() == whole[-2:]
    since = whole[0]["seq"]
    after = [e for e in whole if e["seq"] > since]
    assert api.get(f"/api/v1/sessions/s-b/timeline?since={since}&latest=100").json() == after
    assert api.get("/api/v1/sessions/s-b/timeline?latest=0").status_code == 422
    assert api.get("/api/v1/sessions/s-b/timeline?latest=1001").status_code == 422
