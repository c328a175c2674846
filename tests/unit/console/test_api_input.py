"""Hostile input to the console: a clear 4xx, never a 500, and nothing appended."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlencode

import pytest
from fastapi.testclient import TestClient

from console.auth import SESSION_COOKIE
from console.inputs import FORM_FIELDS, MAX_BODY_BYTES, TEXT_CHARS
from console.pages import session_path
from producers.store import SessionStore
from session_model.session import Question
from tests.unit.console.conftest import BEARER, PASSWORD, at, login_csrf, page_csrf


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


# -- bodies and forms past every valid input -------------------------------------------------------


def test_a_body_past_the_limit_is_413_before_its_caller_is_checked(
    client: TestClient, free_question: SessionStore
) -> None:
    # FastAPI reads a JSON body before the guard's 401: unbounded, anyone could make it read any.
    before = _records(free_question)
    body = b'{"question_id":"free","answer":"' + b"x" * MAX_BODY_BYTES + b'"}'
    json_headers = {"Content-Type": "application/json"}
    anonymous = client.post("/api/v1/sessions/s1/answer", content=body, headers=json_headers)
    assert anonymous.status_code == 413, anonymous.text
    signed = client.post(
        "/api/v1/sessions/s1/answer", content=body, headers={**BEARER, **json_headers}
    )
    assert signed.status_code == 413, signed.text

    def unknown_length() -> Iterator[bytes]:  # no Content-Length: counted as it is read
        yield body[:1000]
        yield body[1000:]

    chunked = client.post(
        "/api/v1/sessions/s1/answer", content=unknown_length(), headers={**BEARER, **json_headers}
    )
    assert "content-length" not in chunked.request.headers
    assert chunked.status_code == 413, chunked.text
    assert _records(free_question) == before


def _sign_in_form(client: TestClient) -> dict[str, str]:
    """A valid sign-in form, as a browser would send it after loading it."""
    csrf = login_csrf(client.get("/login").text)
    return {"username": "alice", "password": PASSWORD, "csrf": csrf, "next": "/"}


def test_a_sign_in_past_the_body_limit_is_413_and_signs_nobody_in(client: TestClient) -> None:
    form = {**_sign_in_form(client), "padding": "p" * MAX_BODY_BYTES}
    response = client.post("/login", data=form, follow_redirects=False)
    assert response.status_code == 413, response.text
    assert SESSION_COOKIE not in response.cookies


def test_a_form_with_a_file_or_too_many_fields_is_refused_before_it_is_read(
    client: TestClient, free_question: SessionStore
) -> None:
    # Starlette spools a form's file parts to disk: no console form has one.
    upload = {"upload": ("notes.txt", b"spooled to /tmp", "text/plain")}
    refused = client.post("/login", data=_sign_in_form(client), files=upload)
    assert refused.status_code == 400, refused.text
    assert SESSION_COOKIE not in refused.cookies
    many = {**_sign_in_form(client), **{f"f{i}": "x" for i in range(FORM_FIELDS)}}
    assert client.post("/login", data=many, follow_redirects=False).status_code == 400
    # The pages' guard reads an act's form first (for its CSRF token): the same limits.
    signed_in = client.post("/login", data=_sign_in_form(client), follow_redirects=False)
    assert signed_in.status_code == 303
    before = _records(free_question)
    act = {"question_id": "free", "answer": "ok", "csrf": page_csrf(client)}
    response = client.post("/sessions/s1/answer", data=act, files=upload, follow_redirects=False)
    assert response.status_code == 400, response.text
    assert _records(free_question) == before


def test_the_longest_answer_fits_the_body_limit_however_it_is_escaped(
    operator: TestClient, free_question: SessionStore
) -> None:
    # The worst case per character: an astral one, `\uXXXX\uXXXX` in ASCII-only JSON and
    # `%XX%XX%XX%XX` in a form; the form's other fields fit in what is left.
    longest = "\U0001f331" * TEXT_CHARS
    body = json.dumps({"question_id": "free", "answer": longest}).encode("ascii")
    assert len(body) > 12 * TEXT_CHARS
    response = operator.post(
        "/api/v1/sessions/s1/answer",
        content=body,
        headers={**BEARER, "Content-Type": "application/json"},
    )
    assert response.status_code == 202, response.text
    free_question.ask("s1", Question("free2", "More?", (), None, at(600), None))
    form = {"question_id": "free2", "answer": longest, "csrf": page_csrf(operator)}
    assert len(urlencode(form)) > 12 * TEXT_CHARS
    page = operator.post("/sessions/s1/answer", data=form, follow_redirects=False)
    assert page.status_code == 303
    assert "Answered «" in operator.get(page.headers["location"]).text
