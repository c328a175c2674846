"""Authority is signed, not claimed; acknowledge announces; a removed option never returns."""

from __future__ import annotations

from dataclasses import replace

import pytest

from producers.store import SessionStore
from schemas import events as ev
from schemas.errors import InvalidCall, UnauthorizedError
from schemas.events import Event
from session_model.authority import Authority, Cutover
from session_model.fold import Kind, fold, step
from session_model.modes import Mode
from session_model.policy import SessionPolicy, Verdict
from session_model.projection import BatchFolder, Position, Record
from session_model.session import Question, Session
from session_model.signing import Signer, TrustedKeys
from tests.unit.builders import OPERATOR, make_event, sign, started, trusted

TRUSTED = trusted()


def _grant(operation: str = "deploy", *, signed: bool = False) -> Event:
    return make_event(ev.PERMISSION_GRANTED, {"operation": operation}, signed=signed)


def _mode(mode: str, *, signed: bool = False) -> Event:
    return make_event(ev.MODE_CHANGED, {"mode": mode}, signed=signed)


def test_an_unsigned_grant_is_rejected_unauthorized_and_changes_nothing() -> None:
    before = fold("s1", [started()], TRUSTED)
    result = step(before, _grant(), TRUSTED)
    assert result.outcome.kind is Kind.REJECTED
    assert result.outcome.rejection is not None
    assert result.outcome.rejection.code == "unauthorized"
    assert result.state.permissions == ()
    assert [r.code for r in result.state.rejections] == ["unauthorized"]
    assert result.state.seq == 2  # a rejection takes its seq and stays on record


def test_the_issue_repro_an_unsigned_grant_and_auto_leave_the_policy_asking() -> None:
    s = fold("s1", [started(), _grant(), _mode("auto")], TRUSTED)
    assert s.mode is Mode.ASK
    verdict = SessionPolicy().decide(s, "deploy", mutating=True, requires_signature=False)
    assert verdict is Verdict.ASK_PERMISSION
    assert [r.code for r in s.rejections] == ["unauthorized", "unauthorized"]


def test_a_signed_grant_is_believed_only_under_a_trusted_key() -> None:
    grant = _grant(signed=True)
    assert fold("s1", [started(), grant], TRUSTED).permissions == ("deploy",)
    # The same log with the operator's key removed from the trusted set: a rebuild rejects it.
    assert fold("s1", [started(), grant], TrustedKeys.none()).permissions == ()
    stranger = Signer.generate("stranger")
    by_stranger = sign(_grant(), stranger)
    assert fold("s1", [started(), by_stranger], TRUSTED).permissions == ()


def test_a_signature_names_its_event_fields_and_id() -> None:
    grant = _grant(signed=True)
    moved = replace(grant, payload={**grant.payload, "operation": "rm"})
    assert fold("s1", [started(), moved], TRUSTED).permissions == ()
    replayed = replace(grant, event_id="another-id")
    assert fold("s1", [started(), replayed], TRUSTED).permissions == ()
    elsewhere = replace(grant, session_id="s2")
    assert fold("s2", [started(session_id="s2"), elsewhere], TRUSTED).permissions == ()


def test_a_stricter_mode_needs_no_signature_and_a_looser_one_does() -> None:
    s = fold("s1", [started(mode="auto"), _mode("acknowledge"), _mode("ask")], TRUSTED)
    assert (s.mode, s.rejections) == (Mode.ASK, ())
    s = fold("s1", [started(), _mode("acknowledge")], TRUSTED)
    assert s.mode is Mode.ASK
    assert [r.code for r in s.rejections] == ["unauthorized"]
    assert fold("s1", [started(), _mode("auto", signed=True)], TRUSTED).mode is Mode.AUTO


def test_an_invalid_unsigned_event_reports_invalid_not_unauthorized() -> None:
    s = fold("s1", [started(), _mode("yolo"), _grant("  ")], TRUSTED)
    assert [r.code for r in s.rejections] == ["invalid", "invalid"]


def test_an_unsigned_relaxed_start_starts_in_the_unsigned_start_mode_and_records_it() -> None:
    result = step(Session("s1"), started(mode="auto", signed=False), TRUSTED)
    assert result.outcome.kind is Kind.APPLIED
    assert result.state.started
    assert result.state.mode is Mode.ASK
    assert result.outcome.rejection is not None
    assert [r.code for r in result.state.rejections] == ["unauthorized"]
    lenient = Authority(TRUSTED, start_mode=Mode.ACKNOWLEDGE)
    assert step(Session("s1"), started(mode="acknowledge", signed=False), lenient).state.mode is (
        Mode.ACKNOWLEDGE
    )
    assert step(Session("s1"), started(mode="auto", signed=False), lenient).state.mode is (
        Mode.ACKNOWLEDGE
    )


def test_records_before_the_cutover_are_legacy_and_believed_unsigned() -> None:
    events = [started(), _grant("deploy"), _grant("rm")]
    records = [Record(e, Position(0, i)) for i, e in enumerate(events)]
    folder = BatchFolder(TRUSTED, cutover=Cutover({0: 2}))
    (update,) = folder.fold({}, records)
    assert update.state.permissions == ("deploy",)  # offset 1 is legacy, offset 2 is not
    assert [r.code for r in update.state.rejections] == ["unauthorized"]
    (strict,) = BatchFolder(TRUSTED).fold({}, records)
    assert strict.state.permissions == ()


def test_a_cutover_reads_partition_offset_pairs() -> None:
    cut = Cutover.parse(" 0:12, 3:7 ")
    assert cut.before == {0: 12, 3: 7}
    assert cut.is_legacy(0, 11) and not cut.is_legacy(0, 12) and not cut.is_legacy(1, 0)
    assert Cutover.parse("").before == {}
    with pytest.raises(ValueError, match="partition:offset"):
        Cutover.parse("12")
    assert cut.topic_id is None


def test_a_cutover_names_the_topic_its_offsets_were_read_from() -> None:
    cut = Cutover.parse(" Qn2bUJxtQ1uyEhB3Zr1A4w@0:12, 3:7 ")
    assert (cut.topic_id, cut.before) == ("Qn2bUJxtQ1uyEhB3Zr1A4w", {0: 12, 3: 7})
    with pytest.raises(ValueError, match="topic id"):
        Cutover.parse("@0:12")


def test_a_writer_without_an_operator_key_is_refused_up_front() -> None:
    store = SessionStore.in_memory(keys=TRUSTED)
    store.start("s1", "g")
    appended = len(store.log.records)
    with pytest.raises(UnauthorizedError, match="operator"):
        store.grant("s1", "deploy")
    with pytest.raises(UnauthorizedError):
        store.set_mode("s1", "auto")
    with pytest.raises(UnauthorizedError):
        store.start("s2", "g", "acknowledge")
    assert len(store.log.records) == appended
    store.revoke("s1", "deploy")  # safer: anyone may
    store.set_mode("s1", "ask")
    assert store.load("s1").rejections == ()


def test_a_writer_with_the_operator_key_grants_and_relaxes() -> None:
    store = SessionStore.in_memory(signer=OPERATOR)
    store.start("s1", "g", "acknowledge")
    store.grant("s1", "deploy")
    store.set_mode("s1", "auto")
    s = store.load("s1")
    assert (s.mode, s.permissions, s.rejections) == (Mode.AUTO, ("deploy",), ())


def test_a_mutating_call_in_acknowledge_is_announced_on_the_timeline() -> None:
    store = SessionStore.in_memory(signer=OPERATOR)
    store.start("s1", "g", "acknowledge")
    store.record_tool_call("s1", "deploy", {"v": 2, "env": "prod"}, "ok", mutating=True)
    store.record_tool_call("s1", "read_file", {"path": "a"}, "ok")
    store.set_mode("s1", "auto")
    store.record_tool_call("s1", "deploy", {"v": 3}, "ok", mutating=True)
    announced = [e for e in store.timeline("s1") if e["kind"] == "announced"]
    assert announced == [
        {
            "session": "s1",
            "kind": "announced",
            "seq": 2,
            "operation": "deploy",
            "arguments": '{"env":"prod","v":2}',
        }
    ]


def test_a_removed_option_cannot_be_offered_again() -> None:
    store = SessionStore.in_memory(signer=OPERATOR)
    store.start("s1", "g")
    store.remove_option("s1", "force-push", "policy")
    with pytest.raises(InvalidCall, match="force-push"):
        store.ask("s1", Question("how", "How to publish?", ("rebase", "force-push")))
    assert store.load("s1").question is None
    forged = make_event(
        ev.QUESTION_ASKED,
        {"question_id": "how", "question": "How?", "options": ["rebase", "force-push"]},
    )
    result = step(store.load("s1"), forged, TRUSTED)
    assert result.outcome.rejection is not None
    assert result.outcome.rejection.code == "invalid"
    assert result.state.question is None
    store.ask("s1", Question("how", "How to publish?", ("rebase", "merge")))
