"""Decisions, question changes and dead letters too large for a produce request are cut."""

from __future__ import annotations

from datetime import UTC, datetime

from processors.fitting import KEPT_CHARS, KEPT_KEY_BYTES, MAX_RECORD_BYTES, fit, fit_dead_letter
from producers.decisions import decision_record
from producers.questions import change_record
from schemas.codec import EventCodec
from session_model.principal import Principal
from session_model.questions import QuestionChange, QuestionStatus
from session_model.session import Decision

CODEC = EventCodec()
AT = datetime(2026, 1, 1, tzinfo=UTC)
BIG = 600_000  # characters: two such texts are more than a produce request holds


def _decision(question: str, why: str) -> Decision:
    return Decision(
        question_id="perm:deploy",
        question=question,
        answer="yes",
        by=Principal("operator:alice", verified=True),
        executor="console",
        reason="permission",
        why=why,
        seq=7,
        event_id="e7",
        decided_at=AT,
    )


def test_a_decision_that_fits_is_encoded_whole_and_not_cut() -> None:
    record = decision_record("s1", _decision("Deploy?", '{"env": "prod"}'))
    value, cut = fit(record, CODEC.encode_decision)
    assert not cut and value == CODEC.encode_decision(record)


def test_a_decision_too_large_for_a_request_is_cut_to_fit_its_ids_whole() -> None:
    record = decision_record("s1", _decision("q" * BIG, "w" * BIG))
    assert len(CODEC.encode_decision(record)) > MAX_RECORD_BYTES
    value, cut = fit(record, CODEC.encode_decision)
    assert cut and len(value) <= MAX_RECORD_BYTES
    read = CODEC.decode_decision(value)
    assert (read["session_id"], read["question_id"], read["event_id"]) == (
        "s1",
        "perm:deploy",
        "e7",
    )
    assert read["answer"] == "yes" and read["by"] == {"id": "operator:alice", "verified": True}
    assert read["question"].startswith("q" * KEPT_CHARS)
    assert f"cut: {BIG} characters in all" in read["question"] and "cut" in read["why"]


def test_a_question_change_too_large_is_cut_options_included() -> None:
    change = QuestionChange(
        session_id="s1",
        status=QuestionStatus.OPEN,
        question_id="q1",
        question="q" * BIG,
        options=tuple(f"option {i} " + "o" * 20_000 for i in range(100)),
        reason="style",
        why=None,
        expires_at=None,
        asked_at=AT,
        seq=3,
        mode="ask",
        goal="g" * BIG,
        event_id="e3",
        at=AT,
    )
    record = change_record(change)
    value, cut = fit(record, CODEC.encode_question_change)
    assert cut and len(value) <= MAX_RECORD_BYTES
    read = CODEC.decode_question_change(value)
    assert read["question_id"] == "q1" and read["event_id"] == "e3"
    assert len(read["options"]) == 64 and read["options"][0].startswith("option 0 ")


def test_a_refused_record_that_fits_is_dead_lettered_whole() -> None:
    value = b"x" * (MAX_RECORD_BYTES - 10)
    assert fit_dead_letter(b"k" * 10, value) == (b"k" * 10, value, "")
    assert fit_dead_letter(None, b"") == (None, b"", "")


def test_a_refused_record_near_the_broker_limit_is_cut_and_says_what_it_was() -> None:
    key, value = b"s-1", bytes(range(256)) * 4095  # 1,048,320 bytes: the broker took it
    kept_key, kept, cut = fit_dead_letter(key, value)
    assert kept_key == key
    assert len(kept_key) + len(kept) == MAX_RECORD_BYTES
    assert value.startswith(kept)
    assert cut == f"key:3,value:{len(value)}"


def test_a_huge_key_is_cut_too() -> None:
    key, value = b"k" * 900_000, b"v" * 200_000
    kept_key, kept, cut = fit_dead_letter(key, value)
    assert kept_key == b"k" * KEPT_KEY_BYTES
    assert kept == value  # the value fits beside the cut key
    assert cut == "key:900000,value:200000"
