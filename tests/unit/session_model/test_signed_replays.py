"""A signed act, sent again long after, is a duplicate: never applied a second time.

The dedupe window (`session_model.dedupe`) recognises a repeated event id among a session's last
256 events only. An operator's signed grant, less strict mode or verified answer copied and sent
again after that would otherwise be applied again, with nobody signing: a revoked grant back, a
stricter mode undone, a refusal of a re-asked question turned into a verified yes.
"""

from __future__ import annotations

from dataclasses import replace

from schemas import events as ev
from schemas.events import Event
from session_model.dedupe import HORIZON
from session_model.fold import Kind, fold, step
from session_model.modes import Mode
from session_model.principal import Principal
from session_model.signing import Signer
from tests.unit.builders import answer, ask, make_event, started, trusted, turn

TRUSTED_OPERATOR = trusted()
ANSWERING = Signer.generate("console")
KEYS = trusted(ANSWERING.trusted_keys())
HUMAN = Principal("operator:alice", verified=True)
PAST_THE_WINDOW = HORIZON + 64  # more turns than the window holds ids


def _turns(n: int) -> list[Event]:
    return [turn("user", f"t{i}") for i in range(n)]


def test_a_signed_grant_sent_again_after_its_revocation_grants_nothing() -> None:
    grant = make_event(ev.PERMISSION_GRANTED, {"operation": "deploy"}, signed=True)
    revoke = make_event(ev.PERMISSION_REVOKED, {"operation": "deploy"})
    before = fold("s1", [started(), grant, revoke, *_turns(PAST_THE_WINDOW)], TRUSTED_OPERATOR)
    assert grant.event_id not in before.event_ids  # out of the window
    again = step(before, grant, TRUSTED_OPERATOR)
    assert again.outcome.kind is Kind.DUPLICATE
    assert again.state.permissions == () and again.state.seq == before.seq


def test_a_signed_mode_sent_again_after_a_stricter_one_changes_nothing() -> None:
    relax = make_event(ev.MODE_CHANGED, {"mode": "auto"}, signed=True)
    tighten = make_event(ev.MODE_CHANGED, {"mode": "ask"})
    before = fold("s1", [started(), relax, tighten, *_turns(PAST_THE_WINDOW)], TRUSTED_OPERATOR)
    again = step(before, relax, TRUSTED_OPERATOR)
    assert again.outcome.kind is Kind.DUPLICATE
    assert again.state.mode is Mode.ASK


def test_a_signed_mode_applied_as_no_relaxation_is_still_remembered() -> None:
    # Signed from a stale read (`acknowledge` while the session was already `auto`): applied as a
    # stricter mode, it must still never relax the session when a copy arrives later.
    stale = make_event(ev.MODE_CHANGED, {"mode": "acknowledge"}, signed=True)
    tighten = make_event(ev.MODE_CHANGED, {"mode": "ask"})
    events = [started(mode="auto", signed=True), stale, tighten, *_turns(PAST_THE_WINDOW)]
    before = fold("s1", events, TRUSTED_OPERATOR)
    assert before.mode is Mode.ASK and stale.event_id not in before.event_ids
    again = step(before, stale, TRUSTED_OPERATOR)
    assert again.outcome.kind is Kind.DUPLICATE
    assert again.state.mode is Mode.ASK


def test_an_unsigned_stricter_mode_is_not_remembered_as_signed() -> None:
    tighten = make_event(ev.MODE_CHANGED, {"mode": "ask"}, signed=False)
    after = fold("s1", [started(mode="auto", signed=True), tighten], TRUSTED_OPERATOR)
    assert tighten.event_id not in after.signed_ids


def test_a_signed_start_sent_again_is_a_duplicate() -> None:
    start = started(mode="auto", signed=True)
    before = fold("s1", [start, *_turns(PAST_THE_WINDOW)], TRUSTED_OPERATOR)
    assert step(before, start, TRUSTED_OPERATOR).outcome.kind is Kind.DUPLICATE


def test_a_verified_answer_sent_again_to_the_re_asked_question_is_a_duplicate() -> None:
    signature = ANSWERING.sign_answer(
        session_id="s1",
        question_id="perm:deploy",
        answer="yes",
        principal_id=HUMAN.id,
        event_id="a1",
    )
    yes = answer(
        "perm:deploy", "yes", by=HUMAN.to_record(), extra={"signature": signature}, event_id="a1"
    )
    events = [started(), ask("perm:deploy", reason="permission"), yes, *_turns(PAST_THE_WINDOW)]
    before = fold("s1", [*events, ask("perm:deploy", reason="permission")], KEYS)
    assert before.decisions[-1].by == HUMAN and before.question is not None
    again = step(before, yes, KEYS)
    assert again.outcome.kind is Kind.DUPLICATE
    assert again.state.question == before.question  # still waiting for a human


def test_unsigned_events_keep_the_bounded_window_and_signed_ids_stay_few() -> None:
    grant = make_event(ev.PERMISSION_GRANTED, {"operation": "deploy"}, signed=True)
    first = turn("user", "hello")
    s = fold("s1", [started(), grant, first, *_turns(PAST_THE_WINDOW)], TRUSTED_OPERATOR)
    assert s.signed_ids == frozenset({grant.event_id})
    # An unsigned event's id beyond the window is folded as new, as `session_model.dedupe` says.
    assert step(s, first, TRUSTED_OPERATOR).outcome.kind is Kind.APPLIED


def test_an_unauthorised_grant_is_not_remembered_as_signed() -> None:
    unsigned = make_event(ev.PERMISSION_GRANTED, {"operation": "deploy"}, signed=False)
    s = fold("s1", [started(), unsigned], TRUSTED_OPERATOR)
    assert s.signed_ids == frozenset() and s.permissions == ()


def test_a_signed_grant_refused_then_sent_again_after_a_revocation_grants_nothing() -> None:
    """Refused once (`seq_conflict`: its writer's read was stale), its signature still verified:
    a copy sent once its id left the dedupe window must not grant at a time nobody chose, here
    after the operator revoked the grant they made instead."""
    refused = make_event(ev.PERMISSION_GRANTED, {"operation": "deploy"}, expected_seq=99)
    regrant = make_event(ev.PERMISSION_GRANTED, {"operation": "deploy"}, signed=True)
    revoke = make_event(ev.PERMISSION_REVOKED, {"operation": "deploy"})
    events = [started(), refused, regrant, revoke, *_turns(PAST_THE_WINDOW)]
    before = fold("s1", events, TRUSTED_OPERATOR)
    assert [r.code for r in before.rejections] == ["seq_conflict"]
    assert refused.event_id not in before.event_ids and refused.event_id in before.signed_ids
    again = step(before, replace(refused, expected_seq=None), TRUSTED_OPERATOR)
    assert again.outcome.kind is Kind.DUPLICATE
    assert again.state.permissions == ()


def test_a_refused_event_with_a_forged_signature_is_not_remembered() -> None:
    """Only a signature that verifies is remembered: an agent cannot fill `signed_ids`."""
    forged = make_event(
        ev.PERMISSION_GRANTED,
        {"operation": "deploy", "authority": {"key_id": "operator-test", "signature": "AAAA"}},
        expected_seq=99,
        signed=False,  # (as written: not signed over by the builder)
    )
    after = fold("s1", [started(), forged], TRUSTED_OPERATOR)
    assert [r.code for r in after.rejections] == ["seq_conflict"]
    assert forged.event_id not in after.signed_ids
