"""An answer names the asking it answers (`asked_seq`), and a verified answer's signature covers it.

A question id can be asked again once its first asking is decided. A writer that read a
projection lagging behind the re-asking answers what it saw: its answer must not land on the new
asking (a verified human's "yes" given to another question than the one shown).
"""

from __future__ import annotations

from typing import Any

from schemas.events import Event
from session_model.dedupe import HORIZON
from session_model.fold import Kind, fold, step
from session_model.principal import Principal
from session_model.session import Session
from session_model.signing import Signer, answer_signing_bytes
from tests.unit.builders import answer, ask, started, trusted, turn, window_closed

CONSOLE = Signer.generate("console")
KEYS = trusted(CONSOLE.trusted_keys())
HUMAN = Principal("operator:alice", verified=True)


def _signed_yes(event_id: str, asked_seq: int | None, **payload: Any) -> Event:
    """A verified human's yes to `perm:deploy`, signed naming `asked_seq` (unless None)."""
    signature = CONSOLE.sign_answer(
        session_id="s1",
        question_id="perm:deploy",
        answer="yes",
        principal_id=HUMAN.id,
        event_id=event_id,
        asked_seq=asked_seq,
    )
    extra = {"signature": signature, "asked_seq": asked_seq, **payload}
    return answer("perm:deploy", "yes", by=HUMAN.to_record(), extra=extra, event_id=event_id)


def _asked_twice() -> Session:
    """perm:deploy asked (seq 2), refused, asked again (seq 4): the second asking is open."""
    events = [
        started(),
        ask("perm:deploy", reason="permission"),
        answer("perm:deploy", "no"),
        ask("perm:deploy", reason="permission"),
    ]
    s = fold("s1", events, KEYS)
    assert s.question is not None and s.question.seq == 4
    return s


def test_an_answer_naming_the_open_asking_is_applied_verified() -> None:
    s = _asked_twice()
    result = step(s, _signed_yes("a1", asked_seq=4), KEYS)
    assert result.outcome.kind is Kind.APPLIED
    decision = result.state.decisions[-1]
    assert (decision.answer, decision.by, decision.asked_seq) == ("yes", HUMAN, 4)


def test_an_answer_naming_an_earlier_asking_of_the_same_id_is_stale() -> None:
    s = _asked_twice()
    result = step(s, _signed_yes("a1", asked_seq=2), KEYS)  # written from a lagging read
    assert result.outcome.kind is Kind.REJECTED
    assert [r.code for r in result.state.rejections] == ["stale_question"]
    assert result.state.question == s.question  # still waiting for its own answer
    assert result.state.decisions == s.decisions


def test_an_asked_seq_that_is_not_a_number_is_stale() -> None:
    s = _asked_twice()
    result = step(s, answer("perm:deploy", "yes", extra={"asked_seq": "4"}), KEYS)
    assert [r.code for r in result.state.rejections] == ["stale_question"]


def test_a_signed_answer_moved_to_another_asking_loses_its_verification() -> None:
    s = _asked_twice()
    moved = _signed_yes("a1", asked_seq=2)
    moved = answer(
        "perm:deploy",
        "yes",
        by=HUMAN.to_record(),
        extra={"signature": moved.payload["signature"], "asked_seq": 4},  # re-pointed
        event_id="a1",
    )
    result = step(s, moved, KEYS)
    assert result.outcome.kind is Kind.APPLIED
    assert result.state.decisions[-1].by == Principal(HUMAN.id, verified=False)
    assert result.state.downgrades == s.downgrades + 1


def test_a_signed_answer_stripped_of_its_asking_loses_its_verification() -> None:
    s = _asked_twice()
    bound = _signed_yes("a1", asked_seq=4)
    stripped = answer(
        "perm:deploy",
        "yes",
        by=HUMAN.to_record(),
        extra={"signature": bound.payload["signature"], "asked_seq": None},
        event_id="a1",
    )
    assert step(s, stripped, KEYS).state.decisions[-1].by == Principal(HUMAN.id, verified=False)


def test_an_answer_written_before_answers_named_their_asking_is_taken_for_the_open_one() -> None:
    s = _asked_twice()
    result = step(s, _signed_yes("a1", asked_seq=None), KEYS)
    assert result.outcome.kind is Kind.APPLIED
    assert result.state.decisions[-1].by == HUMAN  # the v1 signature bytes still verify


def test_the_signed_bytes_name_the_asking_only_when_given() -> None:
    common = {
        "key_id": "console",
        "session_id": "s1",
        "question_id": "perm:deploy",
        "answer": "yes",
        "principal_id": HUMAN.id,
        "event_id": "a1",
    }
    legacy = answer_signing_bytes(**common)
    assert b"asked_seq" not in legacy
    assert answer_signing_bytes(**common, asked_seq=4) != legacy
    assert answer_signing_bytes(**common, asked_seq=4) != answer_signing_bytes(
        **common, asked_seq=2
    )


def test_a_refused_signed_answer_sent_again_to_a_later_asking_is_a_duplicate() -> None:
    """A human's signed yes that came too late for its asking (the agent answered first) is
    refused; the same record sent again after its id left the dedupe window, once the question
    is asked again, must not become a verified yes to the new asking — also without
    `asked_seq` (answers written before v3 name no asking)."""
    yes = _signed_yes("a1", asked_seq=None)
    events = [
        started(),
        ask("perm:deploy", reason="permission"),
        answer("perm:deploy", "no"),  # the agent's own answer got there first
        yes,  # refused: no_open_question
        *[turn("user", f"t{i}") for i in range(HORIZON + 64)],
        ask("perm:deploy", reason="permission"),
    ]
    before = fold("s1", events, KEYS)
    assert [r.code for r in before.rejections][:1] == ["no_open_question"]
    assert yes.event_id in before.signed_ids
    again = step(before, yes, KEYS)
    assert again.outcome.kind is Kind.DUPLICATE
    assert again.state.question == before.question


def test_a_refused_answer_whose_claim_is_not_signed_is_not_remembered() -> None:
    forged = answer("perm:deploy", "yes", by=HUMAN.to_record(), event_id="f1")
    s = fold("s1", [started(), forged], KEYS)
    assert [r.code for r in s.rejections] == ["no_open_question"]
    assert s.signed_ids == frozenset()


def _closed_after_a_second_asking() -> Session:
    """perm:deploy asked (seq 2), refused, asked again (seq 4) with a deadline, and closed."""
    events = [
        started(),
        ask("perm:deploy", reason="permission"),
        answer("perm:deploy", "no"),
        ask("perm:deploy", reason="permission", expires_at="2025-01-01T00:00:00Z"),
        window_closed("perm:deploy"),
    ]
    s = fold("s1", events, KEYS)
    assert s.closed_question is not None and s.closed_question.seq == 4
    return s


def test_a_late_answer_naming_the_closed_asking_is_late() -> None:
    s = _closed_after_a_second_asking()
    result = step(s, _signed_yes("a1", asked_seq=4), KEYS)
    assert [(r.code, r.by) for r in result.state.rejections] == [("late_answer", HUMAN)]


def test_an_answer_naming_an_earlier_asking_after_the_close_is_not_shown_as_late() -> None:
    s = _closed_after_a_second_asking()
    result = step(s, _signed_yes("a1", asked_seq=2), KEYS)  # the first asking, refused long ago
    assert [(r.code, r.by) for r in result.state.rejections] == [("session_ended", None)]
