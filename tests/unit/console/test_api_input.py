"""Hostile input to the console: a clear 4xx, never a 500, and nothing appended."""

from __future__ import annotations

from typing import Any

import pytest
from fastapi.testclient import TestClient

from console.pages import session_path
from producers.store import SessionStore
from session_model.session import Question
from tests.unit.console.conftest import BEARER, at, page_csrf


def _records(store: SessionStore) -> int:
    return len(store.log.records)  # type: ignore[attr-defined]


@pytest.fixture
def free_question(store: SessionStore) -> SessionStore:
    store.start("s1", "g")
    store.ask("s1", Question("free", "Anything to add?", (), None, at(600), None))
    return store


@pytest.mark.parametrize(
    ("act", "body"),
    [
        ("answer", '{"question_id":"free","answer":"\\udc80"}'),  # a lone surrogate
        ("answer", '{"question_id":"free","answer":"ok","confirm":"\\ud800"}'),
        ("answer", '{"question_id":"free","answer":"' + "x" * 70_000 + '"}'),
        ("answer", '{"question_id":"free","answer":"ok","asked_seq":' + "9" * 30 + "}"),
        ("grant", '{"operation":"rm\\u0000\\n"}'),
        ("grant", '{"operation":"' + "r" * 600 + '"}'),
        ("grant", '{"operation":"rm\u0085x"}'),  # a C1 control character
        ("grant", '{"operation":"rm\u202etxt.exe"}'),  # a bidirectional override
        ("revoke", '{"operation":"' + "r" * 70_000 + '"}'),
        ("end", '{"because":"' + "b" * 70_000 + '"}'),
    ],
)
def test_a_write_the_event_could_not_carry_is_422_and_appends_nothing(
    client: TestClient, free_question: SessionStore, act: str, body: str
) -> None:
    before = _records(free_question)
    response = client.post(
        f"/api/v1/sessions/s1/{act}",
        content=body.encode("utf-8"),
        headers={**BEARER, "Content-Type": "application/json"},
    )
    assert response.status_code == 422, response.text
    assert _records(free_question) == before


def test_a_session_id_with_a_slash_or_a_query_mark_is_answered_not_a_server_error(
    operator: TestClient,
) -> None:
    for session_id in ("a/b", "../../login", "a?b#c"):
        response = operator.get("/sessions", params={"id": session_id}, follow_redirects=False)
        assert response.status_code == 303
        assert response.headers["location"] == session_path(session_id)
        assert operator.get(response.headers["location"]).status_code == 404


def test_an_asked_seq_that_is_no_seq_is_refused_on_the_page(
    operator: TestClient, free_question: SessionStore
) -> None:
    before = _records(free_question)
    response: Any = operator.post(
        "/sessions/s1/answer",
        data={
            "question_id": "free",
            "answer": "ok",
            "asked_seq": "9" * 5_000,
            "csrf": page_csrf(operator),
        },
        follow_redirects=True,
    )
    assert response.status_code == 200 and "Not done" in response.text
    assert _records(free_question) == before
