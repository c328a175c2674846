"""Deadlines and expiry: time is declared by an event, never derived by the fold.

Spec: "Deadlines and expiry", the `session.answer_window_closed` row, and "Rejections and no-ops".
"""

from __future__ import annotations

import itertools
from datetime import UTC, datetime, timedelta, timezone

import pytest

from producers.store import SessionStore, deadline_in
from schemas import events as ev
from schemas.errors import LateAnswerError, SessionEndedError
from session_model.fold import Kind, step
from session_model.principal import Principal
from session_model.scheduled import window_closed as scheduled_window_closed
from session_model.session import Question, Rejection, Session
from session_model.signing import Signer
from tests.unit.builders import OPERATOR, answer, ask, ended, fold_all, started, window_closed

T0 = datetime(2026, 1, 1, 10, 0, 0, tzinfo=UTC)
DEADLINE = "2026-01-01T10:01:00.000Z"
AFTER = T0 + timedelta(seconds=61)


def _q(expires_at: str | None) -> Question:
    return Question("q1", "Deploy?", ("yes", "no"), expires_at=expires_at)


# -- Question.has_expired -------------------------------------------------------------------------


def test_question_without_deadline_never_expires() -> None:
    q = _q(None)
    assert q.deadline() is None
    assert q.has_expired(datetime(2999, 1, 1, tzinfo=UTC)) is False


@pytest.mark.parametrize(
    "text",
    [
        "2026-01-01T10:00:00",  # no offset: would have to be guessed into a zone
        "2026-01-01T10:00:00.000",
        "2026-01-01",  # a date only
        "garbage",
        "",
        "tomorrow at noon",
        "2026-13-01T10:00:00Z",
    ],
)
def test_unreadable_deadline_never_expires(text: str) -> None:
    q = _q(text)
    assert q.deadline() is None
    assert q.has_expired(datetime(2999, 1, 1, tzinfo=UTC)) is False


def test_z_deadline_is_read() -> None:
    q = _q("2026-01-01T10:00:00Z")
    assert q.deadline() == T0
    assert q.has_expired(T0 + timedelta(milliseconds=1)) is True


def test_millisecond_z_deadline_is_read() -> None:
    assert _q(DEADLINE).deadline() == T0 + timedelta(seconds=60)


@pytest.mark.parametrize(
    ("text", "utc"),
    [
        ("2026-01-01T12:00:00+02:00", T0),
        ("2026-01-01T05:00:00-05:00", T0),
        ("2026-01-01T10:00:00+00:00", T0),
    ],
)
def test_offset_deadlines_are_read_as_instants(text: str, utc: datetime) -> None:
    q = _q(text)
    assert q.deadline() == utc
    assert q.has_expired(utc) is False
    assert q.has_expired(utc + timedelta(milliseconds=1)) is True


def test_expiry_is_strictly_after_the_deadline() -> None:
    q = _q("2026-01-01T10:00:00Z")
    assert q.has_expired(T0 - timedelta(seconds=1)) is False
    assert q.has_expired(T0) is False
    assert q.has_expired(T0 + timedelta(microseconds=1)) is True


def test_has_expired_compares_instants_across_zones() -> None:
    q = _q("2026-01-01T10:00:00Z")
    plus_two = timezone(timedelta(hours=2))
    assert q.has_expired(datetime(2026, 1, 1, 12, 0, 0, tzinfo=plus_two)) is False
    assert q.has_expired(datetime(2026, 1, 1, 12, 0, 1, tzinfo=plus_two)) is True


def test_deadline_in_writes_a_readable_utc_instant() -> None:
    assert deadline_in(T0, 60) == DEADLINE
    assert _q(deadline_in(T0, 60)).has_expired(AFTER) is True


# -- the fold never compares with now -------------------------------------------------------------


def test_a_passed_deadline_changes_nothing_without_an_event() -> None:
    s = fold_all([started(), ask("q1", "Deploy?", expires_at="2000-01-01T00:00:00Z")])
    assert s.question is not None
    assert s.question.id == "q1"
    assert s.ended is False


# -- SessionStore.expire_if_due -------------------------------------------------------------------


def _store() -> SessionStore:
    counter = itertools.count(1)
    return SessionStore.in_memory(
        signer=OPERATOR, clock=lambda: T0, new_id=lambda: f"ev-{next(counter)}"
    )


def _asked(expires_at: str | None = DEADLINE) -> SessionStore:
    store = _store()
    store.start("s1", "ship it", "ask")
    store.set_todo("s1", "t1", "deploy", "in_progress")
    store.ask(
        "s1",
        Question(
            "q1",
            "Deploy to prod?",
            ("yes", "no"),
            why='{"target":"prod"}',
            expires_at=expires_at,
            reason="permission",
        ),
    )
    return store


def test_expire_if_due_appends_window_closed_and_returns_true() -> None:
    store = _asked()
    asked = store.load("s1").question
    assert asked is not None
    before = len(store.log.records)
    assert store.expire_if_due("s1", AFTER) is True
    assert len(store.log.records) == before + 1
    event = store.log.records[-1].event
    assert event.type == ev.ANSWER_WINDOW_CLOSED
    assert event.session_id == "s1"
    # The asking it closes, named: a re-asking of q1 before it lands is not closed by it.
    assert dict(event.payload) == {"question_id": "q1", "at": AFTER, "asked_seq": asked.seq}


def test_expire_if_due_before_the_deadline_appends_nothing() -> None:
    store = _asked()
    before = len(store.log.records)
    assert store.expire_if_due("s1", T0) is False
    assert store.expire_if_due("s1", T0 + timedelta(seconds=60)) is False  # exactly the deadline
    assert len(store.log.records) == before


def test_expire_if_due_a_thousand_times_leaves_the_log_unchanged() -> None:
    store = _asked()
    before = list(store.log.records)
    for i in range(1000):
        assert store.expire_if_due("s1", T0 + timedelta(milliseconds=i)) is False
    assert store.log.records == before


def test_expire_if_due_after_closing_appends_nothing_more() -> None:
    store = _asked()
    assert store.expire_if_due("s1", AFTER) is True
    after_close = list(store.log.records)
    for i in range(1000):
        assert store.expire_if_due("s1", AFTER + timedelta(seconds=i)) is False
    assert store.log.records == after_close


@pytest.mark.parametrize("expires_at", [None, "2026-01-01T10:00:00", "soon"])
def test_expire_if_due_never_closes_without_a_readable_deadline(expires_at: str | None) -> None:
    store = _asked(expires_at)
    before = len(store.log.records)
    assert store.expire_if_due("s1", datetime(2999, 1, 1, tzinfo=UTC)) is False
    assert len(store.log.records) == before
    assert store.load("s1").question is not None


def test_expire_if_due_without_question_returns_false() -> None:
    store = _store()
    store.start("s1", "goal")
    before = len(store.log.records)
    assert store.expire_if_due("s1", AFTER) is False
    assert len(store.log.records) == before


def test_closed_window_ends_the_session_with_the_exact_reason() -> None:
    store = _asked()
    store.expire_if_due("s1", AFTER)
    s = store.load("s1")
    assert s.ended is True
    assert s.is_runnable() is False
    assert s.question is None
    assert s.ended_because == (
        "the window to answer «Deploy to prod?» closed at 2026-01-01T10:01:01.000Z "
        "and nobody answered"
    )


def test_closed_window_records_an_empty_decision_inheriting_reason_and_why() -> None:
    store = _asked()
    turns_before = store.load("s1").turns
    store.expire_if_due("s1", AFTER)
    s = store.load("s1")
    assert len(s.decisions) == 1
    d = s.decisions[0]
    assert d.question_id == "q1"
    assert d.question == "Deploy to prod?"
    assert d.answer == ""
    assert d.by is None
    assert d.executor is None
    assert d.reason == "permission"
    assert d.why == '{"target":"prod"}'
    assert d.expired_at == AFTER
    assert s.turns == turns_before  # no user turn


def test_closed_window_shows_expired_then_open_work_then_ended() -> None:
    store = _asked()
    store.expire_if_due("s1", AFTER)
    entries = store.timeline("s1", since=3)
    assert [e["kind"] for e in entries] == ["expired", "open-work", "ended"]
    assert entries[0]["question_id"] == "q1"
    assert entries[0]["at"] == "2026-01-01T10:01:01.000Z"
    assert entries[1]["todos"] == [
        {
            "id": "t1",
            "status": "in_progress",
            "version": 1,
            "disposition": "open",
            "mutations_since": 0,
        }
    ]
    assert {e["seq"] for e in entries} == {4}


def test_answer_after_the_window_closed_is_recorded_late_and_raises() -> None:
    store = _asked()
    store.expire_if_due("s1", AFTER)
    before = len(store.log.records)
    who = Principal.from_terminal("rod", "laptop")
    with pytest.raises(SessionEndedError):
        store.answer("s1", "q1", "yes", by=who)
    assert len(store.log.records) == before + 1  # the late attempt is on record
    late = store.log.records[-1].event
    assert late.type == ev.QUESTION_ANSWERED
    s = store.load("s1")
    assert s.rejections == (
        Rejection(
            seq=5,
            event_id=late.event_id,
            type=ev.QUESTION_ANSWERED,
            code="late_answer",
            producer="milpa-sessions",
            occurred_at=T0,
            by=Principal("cli:rod@laptop", verified=False),
        ),
    )
    assert s.rejection_counts() == {"late_answer": 1}
    assert len(s.decisions) == 1
    assert s.decisions[0].answer == ""


def test_answer_naming_another_asking_after_close_raises_and_appends_nothing() -> None:
    store = _asked()
    store.expire_if_due("s1", AFTER)
    closed = store.load("s1").closed_question
    assert closed is not None
    before = len(store.log.records)
    with pytest.raises(SessionEndedError) as raised:
        store.answer("s1", "q1", "yes", asked_seq=closed.seq - 1)  # not the asking that closed
    assert not isinstance(raised.value, LateAnswerError)
    assert len(store.log.records) == before
    with pytest.raises(LateAnswerError):
        store.answer("s1", "q1", "yes", asked_seq=closed.seq)
    assert len(store.log.records) == before + 1


def test_answer_to_another_question_after_close_raises_and_appends_nothing() -> None:
    store = _asked()
    store.expire_if_due("s1", AFTER)
    before = len(store.log.records)
    with pytest.raises(SessionEndedError):
        store.answer("s1", "q-other", "yes")
    assert len(store.log.records) == before


def test_raw_late_answer_after_close_keeps_by_in_the_rejection() -> None:
    s = fold_all(
        [
            started(event_id="st"),
            ask("q1", "Deploy?", expires_at="2025-01-01T00:00:00Z", event_id="q"),
            window_closed("q1", event_id="w"),
            answer("q1", "yes", by={"id": "actor:member:42", "verified": False}, event_id="a"),
        ]
    )
    assert s.rejections[-1].code == "late_answer"
    assert s.rejections[-1].by == Principal("actor:member:42", verified=False)
    assert s.rejections[-1].seq == 4
    assert s.rejections[-1].event_id == "a"
    assert s.rejections[-1].producer == "agent-1"


def test_raw_answer_to_another_question_after_close_is_session_ended() -> None:
    s = fold_all(
        [
            started(),
            ask("q1", "Deploy?"),
            window_closed("q1"),
            answer("q2", "yes", by={"id": "actor:member:42"}),
        ]
    )
    assert s.rejections[-1].code == "session_ended"


# -- the race between an answer and the closing ---------------------------------------------------


def test_answer_first_then_expire_if_due_returns_false_and_one_decision() -> None:
    store = _asked()
    store.answer("s1", "q1", "yes", by=Principal.from_terminal("rod", "laptop"))
    before = len(store.log.records)
    assert store.expire_if_due("s1", AFTER) is False
    assert len(store.log.records) == before
    s = store.load("s1")
    assert len(s.decisions) == 1
    assert s.decisions[0].answer == "yes"
    assert s.ended is False


def test_raw_window_closed_after_an_answer_is_a_noop() -> None:
    prefix = [
        started(event_id="st"),
        ask("q1", "Deploy?", expires_at="2025-01-01T00:00:00Z", event_id="q"),
        answer("q1", "yes", event_id="a"),
    ]
    state: Session = fold_all(prefix)
    result = step(state, window_closed("q1", event_id="w"))
    assert result.outcome.kind is Kind.NOOP
    assert result.outcome.seq == 4
    assert result.outcome.rejection is None
    s = result.state
    assert s.seq == 4
    assert len(s.decisions) == 1
    assert s.decisions[0].answer == "yes"
    assert s.ended is False
    assert s.rejections == ()


def test_window_closed_for_another_question_is_a_noop() -> None:
    state = fold_all([started(), ask("q1", "Deploy?")])
    result = step(state, window_closed("q-other"))
    assert result.outcome.kind is Kind.NOOP
    assert result.state.question is not None
    assert result.state.ended is False


def test_second_window_closed_is_a_noop() -> None:
    state = fold_all([started(), ask("q1", "Deploy?"), window_closed("q1")])
    result = step(state, window_closed("q1"))
    assert result.outcome.kind is Kind.NOOP
    assert len(result.state.decisions) == 1


def test_window_closed_after_an_explicit_end_is_rejected_session_ended() -> None:
    state = fold_all([started(), ask("q1", "Deploy?"), ended("stopped by hand")])
    result = step(state, window_closed("q1", event_id="w-late"))
    assert result.outcome.kind is Kind.REJECTED
    assert result.outcome.rejection is not None
    assert result.outcome.rejection.code == "session_ended"
    assert result.state.ended_because == "stopped by hand"
    assert result.state.decisions == ()


def test_window_closed_for_an_answered_question_after_the_end_is_a_noop() -> None:
    state = fold_all([started(), ask("q1", "Deploy?"), answer("q1", "yes"), ended("done")])
    result = step(state, window_closed("q1"))
    assert result.outcome.kind is Kind.NOOP
    assert result.state.rejections == ()
    assert len(result.state.decisions) == 1


def test_a_closing_of_a_re_asked_question_after_the_end_changes_nothing() -> None:
    """q1 answered, asked again, then the session ended by hand with it open: a closing naming
    q1 (no asking) is a no-op. Applied, it would add a decision to an ended session and write
    over the operator's reason for ending it."""
    state = fold_all(
        [
            started(),
            ask("q1", "Deploy?"),
            answer("q1", "no"),
            ask("q1", "Deploy now?"),
            ended("stopped: misbehaving"),
        ]
    )
    result = step(state, window_closed("q1"))
    assert result.outcome.kind is Kind.NOOP
    assert result.state.ended_because == "stopped: misbehaving"
    assert [d.answer for d in result.state.decisions] == ["no"]
    assert result.state.rejections == ()


def test_a_closing_naming_the_asking_open_at_the_end_is_refused_as_after_any_end() -> None:
    """The same closing of the same still-open asking is refused whether or not an earlier
    asking of that id was answered: only a closing that lost the race is a no-op."""
    asked_again = fold_all(
        [
            started(),
            ask("q1", "Deploy?"),
            answer("q1", "no"),
            ask("q1", "Deploy now?"),  # seq 4
            ended("stopped by hand"),
        ]
    )
    result = step(asked_again, window_closed("q1", asked_seq=4))
    assert result.outcome.kind is Kind.REJECTED
    assert result.outcome.rejection is not None
    assert result.outcome.rejection.code == "session_ended"
    assert result.state.ended_because == "stopped by hand"
    named_earlier = step(asked_again, window_closed("q1", asked_seq=2))
    assert named_earlier.outcome.kind is Kind.NOOP  # the answered asking: it lost the race


# -- a late answer never raises trust ---------------------------------------------------------


def test_late_answer_claiming_verified_without_signature_keeps_an_unverified_by() -> None:
    s = fold_all(
        [
            started(),
            ask("q1", "Deploy?"),
            window_closed("q1"),
            answer("q1", "yes", by={"id": "actor:member:42", "verified": True}),
        ]
    )
    assert s.rejections[-1].code == "late_answer"
    assert s.rejections[-1].by == Principal("actor:member:42", verified=False)


def test_late_answer_signed_by_a_trusted_key_keeps_a_verified_by() -> None:
    signer = Signer.generate("answering-1")
    counter = itertools.count(1)
    store = SessionStore.in_memory(
        signer=signer, clock=lambda: T0, new_id=lambda: f"ev-{next(counter)}"
    )
    store.start("s1", "goal")
    store.ask("s1", _q(DEADLINE))
    store.expire_if_due("s1", AFTER)
    human = Principal("actor:member:42", verified=True)
    with pytest.raises(SessionEndedError):
        store.answer("s1", "q1", "yes", by=human)
    s = store.load("s1")
    assert s.rejections[-1].code == "late_answer"
    assert s.rejections[-1].by == human


def test_a_closing_of_an_earlier_asking_does_not_close_the_question_asked_again() -> None:
    # q1 asked (due at noon), answered, asked again (due at one); the scheduler's closing of the
    # first asking, noticed at noon and delayed, lands after the second asking.
    noon = datetime(2025, 1, 2, 12, 0, tzinfo=UTC)
    state = fold_all(
        [
            started(),
            ask("q1", "Deploy?", expires_at="2025-01-02T12:00:00Z"),
            answer("q1", "no"),
            ask("q1", "Deploy now?", expires_at="2025-01-02T13:00:00Z"),
        ]
    )
    stale = step(state, window_closed("q1", at=noon + timedelta(milliseconds=1)))
    assert stale.outcome.kind is Kind.NOOP
    assert stale.state.question is not None and not stale.state.ended
    due = step(state, window_closed("q1", at=noon + timedelta(hours=1)))
    assert due.outcome.kind is Kind.APPLIED and due.state.ended


@pytest.mark.parametrize("expires_at", [None, "not-a-date"])
def test_a_closing_naming_an_earlier_asking_leaves_a_re_asked_question_with_no_deadline_open(
    expires_at: str | None,
) -> None:
    # The asking's own deadline cannot tell an earlier asking's closing when it has none: the
    # closing names its asking (v4), and the fold ignores one naming another.
    noon = datetime(2025, 1, 2, 12, 0, tzinfo=UTC)
    state = fold_all(
        [
            started(),
            ask("q1", "Deploy?", expires_at="2025-01-02T12:00:00Z"),  # seq 2
            answer("q1", "no"),
            ask("q1", "Deploy now?", expires_at=expires_at),  # seq 4
        ]
    )
    assert state.question is not None and state.question.seq == 4
    late = noon + timedelta(milliseconds=1)
    stale = step(state, window_closed("q1", at=late, asked_seq=2))
    assert stale.outcome.kind is Kind.NOOP
    assert stale.state.question == state.question and not stale.state.ended
    own = step(state, window_closed("q1", at=late, asked_seq=4))
    assert own.outcome.kind is Kind.APPLIED and own.state.ended


def test_the_scheduler_s_closing_names_the_asking_it_closes() -> None:
    closing = scheduled_window_closed("s1", "q1", 4, AFTER, "milpa-scheduler", event_id="c4")
    assert closing.payload["asked_seq"] == 4
    state = fold_all([started(), ask("q1", expires_at=DEADLINE), answer("q1", "no")])
    reasked = step(state, ask("q1", expires_at=DEADLINE)).state
    assert reasked.question is not None and reasked.question.seq == 4
    first = scheduled_window_closed("s1", "q1", 2, AFTER, "milpa-scheduler", event_id="c2")
    assert step(reasked, first).outcome.kind is Kind.NOOP
    assert step(reasked, closing).state.ended


@pytest.mark.parametrize("expires_at", ["0001-01-01T00:00:00Z", "0001-01-01T00:00:00+01:00"])
def test_a_closing_of_a_question_due_at_the_calendar_s_first_instant_closes_it(
    expires_at: str,
) -> None:
    # `deadline - 1 ms` does not exist there: the check must not raise (a poison pill for every
    # worker and rebuild that reads the closing).
    state = fold_all([started(), ask("q1", expires_at=expires_at)])
    closed = step(state, window_closed("q1", at=AFTER))
    assert closed.outcome.kind is Kind.APPLIED and closed.state.ended
