"""The server-rendered pages: what they show, and the forms that act through them."""

from __future__ import annotations

import re
from datetime import timedelta
from typing import Any

import pytest
from fastapi.testclient import TestClient
from starlette.datastructures import FormData

from console import service
from console.app import pattern_literal, reason_class
from console.inputs import AnswerRequest, InvalidInputError, OperationRequest
from console.pages import form_input
from producers.store import SessionStore
from schemas.errors import CorruptProjectionError, ProjectionError, SessionRestoringError
from session_model.principal import Principal
from session_model.session import Question
from tests.unit.console.conftest import BEARER, NOW, at, page_csrf, seed


def _ids(html: str, attribute: str) -> list[str]:
    return re.findall(rf'<li class="question" {attribute}="([^"]+)"', html)


def test_the_inbox_lists_waiting_questions_soonest_deadline_first(
    operator: TestClient, store: SessionStore
) -> None:
    seed(store)
    page = operator.get("/inbox")
    assert page.status_code == 200
    assert _ids(page.text, "data-session") == ["s-b", "s-a", "s-c"]
    assert '<span id="inbox-total">3</span>' in page.text
    deadline = int((NOW + timedelta(seconds=60)).timestamp() * 1000)
    assert f'data-deadline="{deadline}"' in page.text  # the countdown's anchor
    assert 'data-question="sign:deploy"' in page.text
    assert 'class="badge reason reason-signature"' in page.text
    assert 'id="question-template"' in page.text  # rows added live are built from it
    assert 'id="inbox-empty" class="muted empty" hidden' in page.text


def test_the_inbox_filters_by_reason_and_pages_by_cursor(
    operator: TestClient, store: SessionStore
) -> None:
    seed(store)
    filtered = operator.get("/inbox?reason=style")
    assert _ids(filtered.text, "data-session") == ["s-c"]
    assert '<ul id="questions" class="questions" data-reason="style"' in filtered.text
    for extra in range(60):
        store.start(f"x-{extra:02d}", "g")
        store.ask(f"x-{extra:02d}", seed_question(extra))
    first = operator.get("/inbox")
    assert len(_ids(first.text, "data-session")) == 50
    link = re.search(r'id="next-page" href="([^"]+)"', first.text)
    assert link
    second = operator.get(link.group(1).replace("&amp;", "&"))
    rest = _ids(second.text, "data-session")
    assert len(rest) == 13 and not set(rest) & set(_ids(first.text, "data-session"))
    assert 'id="next-page"' not in second.text


def seed_question(n: int) -> Question:
    return Question(f"q{n}", f"Q{n}?", ("yes", "no"), None, at(1000 + n), "permission")


def test_an_empty_inbox_says_so(operator: TestClient) -> None:
    page = operator.get("/inbox").text
    assert re.search(r'id="inbox-empty" class="muted empty"\s*>Nothing is waiting\.', page)
    assert _ids(page, "data-session") == []


def test_the_overview_counts_and_draws_the_charts(
    operator: TestClient, store: SessionStore
) -> None:
    seed(store)
    page = operator.get("/")
    assert page.status_code == 200
    assert '<td data-status="waiting" data-mode="ask">3</td>' in page.text
    assert '<td data-status="running" data-mode="ask">1</td>' in page.text
    assert re.search(r'<li data-reason="signature">.*?<span class="n">1</span>', page.text, re.S)
    pauses = re.search(r'<svg id="pauses-chart".*?</svg>', page.text, re.S)
    assert pauses
    assert pauses.group(0).count("<rect") == 3  # two bars at 10:00 (stacked), one at 08:00
    assert "2 pauses (signature)" in pauses.group(0)
    tta = re.search(r'<svg id="tta-chart".*?</svg>', page.text, re.S)
    assert tta and tta.group(0).count("<rect") == 2


def test_the_session_page_shows_state_window_timeline_and_the_signature_gate(
    operator: TestClient, store: SessionStore
) -> None:
    seed(store)
    page = operator.get("/sessions/s-b")
    assert page.status_code == 200
    html = page.text
    assert re.search(r'id="session-status"[^>]*>waiting<', html)
    assert '<pre id="signed-call" data-operation="deploy">{&#34;env&#34;:&#34;prod&#34;' in html
    assert 'id="confirm-operation"' in html and 'data-expect="deploy"' in html
    assert 'required pattern="deploy"' in html  # without JS the browser still refuses
    assert 'id="sign-and-answer"' in html
    assert "answer-option" not in html  # a click cannot sign: no option buttons
    assert "The plan was set (version 1): «build then deploy»" in html
    assert 'data-kind="waiting"' in html
    assert 'data-todo="t1" data-status="done"' in html
    assert '<li class="message role-user" data-role="user">' in html


def test_the_grant_hint_shows_only_for_a_yes_no_permission_question(
    operator: TestClient, store: SessionStore
) -> None:
    seed(store)
    assert "also grants «rm»" in operator.get("/sessions/s-a").text
    store.start("s-x", "deploy")
    options = ("No, keep waiting", "Yes")
    store.ask("s-x", Question("perm:deploy", "Allow?", options, "{}", at(600), "permission"))
    page = operator.get("/sessions/s-x").text
    assert 'id="grant-hint"' not in page and "also grants" not in page


def test_a_page_answer_to_a_question_asked_again_since_the_page_was_drawn_is_not_done(
    operator: TestClient, store: SessionStore
) -> None:
    seed(store)
    page = operator.get("/sessions/s-a").text
    shown = re.search(r'name="asked_seq" value="(\d+)"', page)
    assert shown is not None
    store.answer("s-a", "perm:rm", "no")  # the agent answers itself, then asks again
    store.ask(
        "s-a", Question("perm:rm", "Allow «rm»?", ("yes", "no"), '{"p": "/"}', at(60), "permission")
    )
    before = store.load("s-a").seq
    response = operator.post(
        "/sessions/s-a/answer",
        data={
            "csrf": page_csrf(operator),
            "question_id": "perm:rm",
            "answer": "yes",
            "asked_seq": shown.group(1),
        },
    )
    assert "Not done (no_open_question)" in response.text and "asked again" in response.text
    assert store.load("s-a").seq == before and not store.load("s-a").allows("rm")


def test_answering_from_the_page_redirects_back_with_a_flash_and_shows_the_decision(
    operator: TestClient, store: SessionStore
) -> None:
    seed(store)
    page = operator.get("/sessions/s-a").text
    assert '<button type="submit" name="answer" value="yes" class="answer-option primary">' in page
    response = operator.post(
        "/sessions/s-a/answer",
        data={
            "csrf": page_csrf(operator),
            "question_id": "perm:rm",
            "answer": "yes",
            "asked_seq": "2",  # (as the page's form sends it)
        },
        follow_redirects=False,
    )
    assert response.status_code == 303
    assert response.headers["location"].endswith("/sessions/s-a")
    after = operator.get("/sessions/s-a").text
    assert re.search(
        r'<div id="flash" class="flash ok"[^>]*>Answered «yes» as operator:alice', after
    )
    assert re.search(r'id="session-status"[^>]*>running<', after)
    assert 'data-question="perm:rm" data-verified="true"' in after
    assert "operator:alice (verified) answered «Allow «rm»?» with «yes», via console" in after
    assert store.load("s-a").decisions[-1].by == Principal("operator:alice", verified=True)
    # The flash is shown once.
    assert 'id="flash"' not in operator.get("/sessions/s-a").text


def test_signing_from_the_page_needs_the_typed_confirmation(
    operator: TestClient, store: SessionStore
) -> None:
    seed(store)
    csrf = page_csrf(operator)
    form = {"csrf": csrf, "question_id": "sign:deploy", "answer": "approved", "asked_seq": "5"}
    refused = operator.post("/sessions/s-b/answer", data=form).text  # redirected back
    assert 'class="flash error"' in refused and "confirmation_required" in refused
    assert store.load("s-b").question is not None
    operator.post("/sessions/s-b/answer", data={**form, "confirm": "deploy"})
    assert store.load("s-b").question is None
    assert store.load("s-b").approvals[0].operation == "deploy"


def test_the_forms_grant_revoke_set_the_mode_and_end(
    operator: TestClient, store: SessionStore
) -> None:
    seed(store)
    csrf = page_csrf(operator)
    operator.post("/sessions/s-d/grant", data={"csrf": csrf, "operation": "deploy"})
    assert store.load("s-d").permissions == ("deploy",)
    page = operator.get("/sessions/s-d").text
    assert '<li data-operation="deploy">' in page
    operator.post("/sessions/s-d/revoke", data={"csrf": csrf, "operation": "deploy"})
    operator.post("/sessions/s-d/mode", data={"csrf": csrf, "mode": "acknowledge"})
    assert store.load("s-d").mode.value == "acknowledge"
    operator.post("/sessions/s-d/end", data={"csrf": csrf, "because": "enough"})
    ended = operator.get("/sessions/s-d").text
    assert re.search(r'id="session-status"[^>]*>ended<', ended)
    assert "The session ended: enough (ended by operator:alice)" in ended
    assert 'id="end-form"' not in ended
    error = operator.post("/sessions/s-d/grant", data={"csrf": csrf, "operation": "x"}).text
    assert 'class="flash error"' in error and "session_ended" in error


def test_an_unknown_session_page_is_404_and_the_search_box_goes_to_a_session(
    operator: TestClient, store: SessionStore
) -> None:
    seed(store)
    missing = operator.get("/sessions/nope")
    assert missing.status_code == 404 and "There is no session «nope»." in missing.text
    jump = operator.get("/sessions?id=s-a", follow_redirects=False)
    assert jump.status_code == 303 and jump.headers["location"].endswith("/sessions/s-a")


def test_pages_and_static_files_carry_a_strict_policy(operator: TestClient) -> None:
    page = operator.get("/")
    assert "script-src 'self'" in page.headers["content-security-policy"]
    assert page.headers["x-frame-options"] == "DENY"
    assert page.headers["cache-control"] == "no-store"
    css = operator.get("/static/console.css")
    assert css.status_code == 200 and "@media (max-width: 760px)" in css.text
    js = operator.get("/static/console.js")
    assert js.status_code == 200 and "EventSource" in js.text
    assert "innerHTML" not in js.text


def _classes(html: str) -> list[set[str]]:
    return [set(found.split()) for found in re.findall(r'class="([^"]*)"', html)]


def test_a_reason_is_a_class_only_in_a_css_safe_form(
    operator: TestClient, store: SessionStore
) -> None:
    # The agent writes a question's reason: `x verified` must not dress its badge as a verified
    # answer's (nor any other class); its text is shown as it is.
    store.start("s-r", "g")
    store.ask("s-r", Question("q1", "First?", ("yes", "no"), None, at(600), "x verified"))
    body = {"question_id": "q1", "answer": "yes"}
    assert operator.post("/api/v1/sessions/s-r/answer", json=body, headers=BEARER).is_success
    store.ask("s-r", Question("q2", "Second?", ("yes", "no"), None, at(600), "x verified"))
    badge = re.compile(r'<span class="([^"]*)">x verified</span>')
    for path, badges in (("/sessions/s-r", 2), ("/inbox", 1), ("/", 1)):
        html = operator.get(path).text
        assert badge.findall(html) == ["badge reason reason-other"] * badges, path
        assert not [c for c in _classes(html) if "reason" in c and "verified" in c], path
    assert reason_class("permission") == "reason-permission"
    assert reason_class("target_not_named") == "reason-target_not_named"
    for unsafe in ("x verified", "Permission", "a.b", "a\tb", "", None, "signature\n"):
        assert reason_class(unsafe) == "reason-other", unsafe


def test_the_confirmation_pattern_matches_only_the_operation_name() -> None:
    assert pattern_literal("db.migrate") == "db\\.migrate"
    assert pattern_literal("rm-rf(all)") == "rm-rf\\(all\\)"  # `-` stays: \\- is an error
    assert re.fullmatch(pattern_literal("a.b*c"), "a.b*c")
    assert not re.fullmatch(pattern_literal("a.b"), "axb")


_LONG_NAME, _LONG_TEXT = "r" * 513, "x" * 65_537  # one past the API's limits


@pytest.mark.parametrize(
    ("act", "form"),
    [
        ("answer", {"question_id": "free", "answer": _LONG_TEXT}),
        ("answer", {"question_id": "free", "answer": "ok", "confirm": _LONG_NAME}),
        ("answer", {"question_id": "q" * 513, "answer": "ok"}),
        ("answer", {"question_id": "free", "answer": "ok", "asked_seq": "9" * 30}),
        ("answer", {"question_id": "free", "answer": "ok", "asked_seq": "0"}),
        ("answer", {"question_id": "free", "answer": "ok", "asked_seq": "x1"}),
        ("grant", {"operation": "rm\x00"}),
        ("grant", {"operation": "rm\x1b[2J"}),
        ("grant", {"operation": _LONG_NAME}),
        ("grant", {"operation": "rm\u202etxt"}),
        ("revoke", {"operation": _LONG_TEXT}),
        ("mode", {"mode": "anything-goes"}),
        ("end", {"because": _LONG_TEXT}),
    ],
)
def test_a_form_the_api_would_refuse_is_not_done_and_appends_nothing(
    operator: TestClient, store: SessionStore, act: str, form: dict[str, str]
) -> None:
    store.start("s1", "g")
    store.grant("s1", _LONG_NAME)  # (so that revoking it would append something)
    store.ask("s1", Question("free", "Anything to add?", (), None, at(600), None))
    before = len(store.log.records)  # type: ignore[attr-defined]
    response = operator.post(
        f"/sessions/s1/{act}", data={**form, "csrf": page_csrf(operator)}, follow_redirects=False
    )
    assert response.status_code == 303 and response.headers["location"] == "/sessions/s1"
    page = operator.get("/sessions/s1").text
    assert re.search(r'class="flash error"[^>]*>Not done \(invalid_request\): ', page)
    assert len(store.log.records) == before  # type: ignore[attr-defined]


@pytest.mark.parametrize("name", [_LONG_NAME, "a\tb", "rm\x1b[2J", " rm", "rm\t"])
def test_any_granted_name_can_be_revoked_from_the_page(
    operator: TestClient, store: SessionStore, name: str
) -> None:
    """Taking a permission away is never refused for its name's form (a grant made before the
    limits, or with a writer of its own, may hold anything)."""
    store.start("s1", "g")
    store.grant("s1", name)
    assert store.load("s1").allows(name)
    response = operator.post(
        "/sessions/s1/revoke",
        data={"operation": name, "csrf": page_csrf(operator)},
        follow_redirects=False,
    )
    assert response.status_code == 303
    assert not store.load("s1").allows(name)


def test_a_yes_to_a_permission_question_naming_what_a_grant_refuses_grants_nothing(
    operator: TestClient, store: SessionStore
) -> None:
    """The agent chose the question's id: a yes to «perm:rm<ESC>[2J<TAB>x» must not grant a
    name the grant act itself refuses (and that a page would then show garbled)."""
    store.start("s1", "g")
    odd = "perm:rm\x1b[2J\tx"
    store.ask("s1", Question(odd, "Allow?", ("yes", "no"), None, at(600), "permission"))
    response = operator.post(
        "/sessions/s1/answer",
        data={"question_id": odd, "answer": "yes", "csrf": page_csrf(operator)},
        follow_redirects=False,
    )
    assert response.status_code == 303
    session = store.load("s1")
    assert session.question is None and session.permissions == ()


def test_a_long_answer_s_flash_is_cut_to_fit_a_cookie(
    operator: TestClient, store: SessionStore
) -> None:
    store.start("s1", "g")
    store.ask("s1", Question("free", "Anything to add?", (), None, at(600), None))
    answer = "".join(chr(0x4E00 + i % 20_000) for i in range(20_000))  # compresses badly
    response = operator.post(
        "/sessions/s1/answer",
        data={"question_id": "free", "answer": answer, "csrf": page_csrf(operator)},
        follow_redirects=False,
    )
    assert response.status_code == 303
    assert len(response.headers["set-cookie"]) < 4_096
    assert store.load("s1").decisions[-1].answer == answer  # the answer itself is whole
    assert "Answered «" + answer[:50] in operator.get("/sessions/s1").text


def test_the_pages_check_a_form_with_the_api_s_own_models() -> None:
    # One set of limits: what the API's bodies refuse, a form is refused for (even what no
    # browser sends, such as a lone surrogate).
    with pytest.raises(InvalidInputError, match="answer: "):
        form_input(AnswerRequest, FormData({"question_id": "free", "answer": "\udc80"}))
    with pytest.raises(InvalidInputError, match="question_id: "):
        form_input(AnswerRequest, FormData({"answer": "ok"}))  # a required field left out
    with pytest.raises(InvalidInputError, match="answer: Field required"):
        form_input(AnswerRequest, FormData({"question_id": "q"}))  # as the API says: 422
    body = form_input(AnswerRequest, FormData({"question_id": "q", "answer": "", "confirm": ""}))
    assert (body.answer, body.confirm, body.asked_seq) == ("", None, None)
    assert form_input(OperationRequest, FormData({"operation": "deploy"})).operation == "deploy"


def test_a_long_sessions_page_shows_its_latest_whole_events_and_says_what_is_left_out(
    operator: TestClient, store: SessionStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(service, "PAGE_TIMELINE", 5)
    store.start("long", "work for a day")
    for k in range(1, 13):
        store.record_turn("long", "user", f"turn number {k}")
    read: list[tuple[str, int, int | None]] = []
    timeline = store.projections.timeline

    def recorded(session_id: str, since: int = 0, latest: int | None = None) -> Any:
        read.append((session_id, since, latest))
        return timeline(session_id, since, latest)

    monkeypatch.setattr(store.projections, "timeline", recorded)
    html = operator.get("/sessions/long").text
    assert read == [("long", 0, 6)]  # the latest entries only, one more to see a cut
    listed = re.search(r'<ol id="timeline".*?</ol>', html, re.S)
    assert listed
    assert re.findall(r'data-seq="(\d+)"', listed.group(0)) == [str(s) for s in range(9, 14)]
    assert "Events before seq 9 are left out" in html  # turn k is seq k + 1


_HALF = SessionRestoringError("session 's-b' is half rebuilt: … `replay --session s-b`")


@pytest.mark.parametrize(
    "case",
    [
        (_HALF, 409, "replay --session s-b"),
        (CorruptProjectionError("s-b: the stored state has layout 9"), 500, "--session ID --force"),
        (ProjectionError("redis://10.0.0.7:6379 refused the connection"), 503, "try again"),
    ],
    ids=["half rebuilt", "damaged", "Redis away"],
)
def test_a_session_page_that_cannot_be_read_answers_as_the_api_does(
    operator: TestClient,
    store: SessionStore,
    monkeypatch: pytest.MonkeyPatch,
    case: tuple[Exception, int, str],
) -> None:
    error, status, says = case
    seed(store)

    def broken(*args: object, **kwargs: object) -> None:
        raise error

    monkeypatch.setattr(store.projections, "load", broken)
    page = operator.get("/sessions/s-b")
    assert page.status_code == status and says in page.text
    assert "10.0.0.7" not in page.text and "layout 9" not in page.text


def _damaged(store: SessionStore, monkeypatch: pytest.MonkeyPatch, *parts: str) -> None:
    """s-a answered once and asked again, its decisions history and/or timeline not decoding."""
    seed(store)
    store.answer("s-a", "perm:rm", "yes", Principal("ops:bob"))
    store.ask("s-a", Question("q-2", "Deploy now?", ("yes", "no"), None, at(900), "permission"))

    def broken(*args: object, **kwargs: object) -> None:
        raise CorruptProjectionError("s-a: entry 3 is not JSON")

    for part in parts:
        monkeypatch.setattr(store.projections, {"decisions": "facts"}.get(part, part), broken)


@pytest.mark.parametrize(
    "parts", [("timeline",), ("decisions",), ("decisions", "timeline")], ids="+".join
)
def test_a_session_page_shows_the_rest_when_its_decisions_or_timeline_do_not_read(
    operator: TestClient,
    store: SessionStore,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    parts: tuple[str, ...],
) -> None:
    """The open question can still be seen and answered; the page says what is left out and
    how a rebuild mends it, and the log says what was wrong, once."""
    _damaged(store, monkeypatch, *parts)
    for _ in range(2):
        page = operator.get("/sessions/s-a")
        assert page.status_code == 200
    html = page.text
    notice = re.search(r'<p id="session-unreadable" class="notice">(.*?)</p>', html, re.S)
    assert notice and " and ".join(parts) + " cannot be read" in notice.group(1)
    assert "replay --session ID --force" in notice.group(1) and "entry 3" not in html
    assert 'data-question="q-2"' in html and 'name="answer"' in html  # answerable
    decisions = re.search(r'<table id="decisions".*?</table>', html, re.S)
    assert decisions and "Allow «rm»?" in decisions.group(0)  # the state's recent decision
    timeline = re.search(r'<ol id="timeline".*?</ol>', html, re.S)
    assert timeline
    entries = re.findall(r'data-seq="(\d+)"', timeline.group(0))
    if "timeline" in parts:
        assert entries == [] and "The timeline cannot be read" in timeline.group(0)
    else:
        assert entries and entries[-1] == str(store.load("s-a").seq)  # read as usual
    said = [r.getMessage() for r in caplog.records if "entry 3 is not JSON" in r.getMessage()]
    assert len(said) == len(parts)  # each part once, over two loads
    assert all("replay --session ID --force" in m for m in said)


@pytest.mark.parametrize("part", ["facts", "timeline"])
@pytest.mark.parametrize(
    "case",
    [(_HALF, 409), (ProjectionError("redis://10.0.0.7:6379 refused the connection"), 503)],
    ids=["half rebuilt", "Redis away"],
)
def test_only_damage_is_left_out_of_a_session_page_a_backend_away_is_not(
    operator: TestClient,
    store: SessionStore,
    monkeypatch: pytest.MonkeyPatch,
    case: tuple[Exception, int],
    part: str,
) -> None:
    """A read that fails for a cause a retry or a finished rebuild cures is not a damaged part:
    the page and the API answer as for the state itself."""
    error, status = case
    seed(store)

    def broken(*args: object, **kwargs: object) -> None:
        raise error

    monkeypatch.setattr(store.projections, part, broken)
    assert operator.get("/sessions/s-a").status_code == status
    if part == "facts":  # the API's record reads no timeline
        assert operator.get("/api/v1/sessions/s-a").status_code == status
