"""Signatures over calls and answers, principals, and trust that is never raised on read.

Spec: "Autonomy, policy and signatures" (the signature gate) and "Principals and trust".
"""

from __future__ import annotations

import hashlib
import itertools
from datetime import UTC, datetime
from typing import Any

import pytest

from producers.store import SessionStore
from schemas import events as ev
from session_model.canonical import argument_digest, canonical_json
from session_model.fold import fold
from session_model.principal import Principal
from session_model.session import Question, Session
from session_model.signing import CallSignature, Signer, TrustedKeys, verify_call
from tests.unit.builders import OPERATOR, answer, ask, started

T0 = datetime(2026, 1, 1, 10, 0, 0, tzinfo=UTC)
HUMAN = Principal("actor:member:42", verified=True)

# One key pair per role, generated once (key generation is the slow part).
APPROVER = Signer.generate("approver-1")
ANSWERING = Signer.generate("answering-1")
ANSWERING_NEW = Signer.generate("answering-2")
AGENT = Signer.generate("agent-key")


def _keys(*signers: Signer) -> TrustedKeys:
    return TrustedKeys.from_raw({s.key_id: s.public_raw() for s in signers})


def _store(**kwargs: Any) -> SessionStore:
    counter = itertools.count(1)
    kwargs.setdefault("signer", OPERATOR)
    return SessionStore.in_memory(clock=lambda: T0, new_id=lambda: f"ev-{next(counter)}", **kwargs)


def _asked(store: SessionStore, sid: str = "s1") -> None:
    store.start(sid, "goal", "ask")
    store.ask(sid, _question())


def _question() -> Question:
    return Question("q1", "Deploy to prod?", ("yes", "no"), reason="permission")


def _events(store: SessionStore) -> list[Any]:
    return [r.event for r in store.log.records]


# -- the signature gate ---------------------------------------------------------------------------

ARGS = {"target": "prod", "replicas": 3}


def _signed(session_id: str = "s1", operation: str = "deploy", args: Any = None) -> CallSignature:
    return APPROVER.sign_call(
        session_id=session_id,
        operation=operation,
        argument_digest=argument_digest(ARGS if args is None else args),
    )


def _verify(sig: CallSignature | None, keys: TrustedKeys | None = None, **over: Any) -> bool:
    call = {"session_id": "s1", "operation": "deploy", "argument_digest": argument_digest(ARGS)}
    call.update(over)
    return verify_call(keys if keys is not None else _keys(APPROVER), sig, **call)


def test_signed_call_verifies_with_trusted_key_over_exactly_that_call() -> None:
    assert _verify(_signed()) is True


def test_signed_call_fails_for_another_session() -> None:
    assert _verify(_signed(), session_id="s2") is False


def test_signed_call_fails_for_another_operation() -> None:
    assert _verify(_signed(), operation="delete") is False


def test_signed_call_fails_for_other_arguments() -> None:
    other = argument_digest({"target": "prod", "replicas": 4})
    assert _verify(_signed(), argument_digest=other) is False


def test_signed_call_fails_with_untrusted_key() -> None:
    sig = AGENT.sign_call(
        session_id="s1", operation="deploy", argument_digest=argument_digest(ARGS)
    )
    assert _verify(sig) is False


def test_signed_call_fails_when_no_key_is_trusted() -> None:
    assert _verify(_signed(), keys=TrustedKeys.none()) is False


def test_signed_call_fails_when_key_id_is_claimed_by_another_key() -> None:
    impostor = Signer("approver-1", AGENT.private_key)
    sig = impostor.sign_call(
        session_id="s1", operation="deploy", argument_digest=argument_digest(ARGS)
    )
    assert _verify(sig) is False


def test_tampered_call_signature_fails() -> None:
    sig = _signed()
    tampered = bytes([sig.signature[0] ^ 0x01]) + sig.signature[1:]
    assert _verify(CallSignature(sig.key_id, tampered)) is False


def test_missing_call_signature_fails() -> None:
    assert _verify(None) is False


def test_call_signature_survives_encoding() -> None:
    sig = _signed()
    decoded = CallSignature.decode(sig.encoded())
    assert decoded == sig
    assert sig.encoded().startswith("approver-1:")
    assert _verify(decoded) is True


def test_argument_digest_is_sha256_of_canonical_json() -> None:
    expected = hashlib.sha256(b'{"replicas":3,"target":"prod"}').hexdigest()
    assert argument_digest(ARGS) == expected
    assert canonical_json(ARGS) == '{"replicas":3,"target":"prod"}'


def test_argument_digest_ignores_key_order() -> None:
    a = {"a": 1, "b": {"x": [1, 2], "y": "é"}}
    b = {"b": {"y": "é", "x": [1, 2]}, "a": 1}
    assert argument_digest(a) == argument_digest(b)
    assert len(argument_digest(a)) == 64


def test_argument_digest_sees_value_changes() -> None:
    assert argument_digest({"a": [1, 2]}) != argument_digest({"a": [2, 1]})


def test_signature_over_reordered_arguments_still_verifies() -> None:
    sig = _signed(args={"replicas": 3, "target": "prod"})
    assert _verify(sig, argument_digest=argument_digest({"target": "prod", "replicas": 3})) is True


# -- principals -----------------------------------------------------------------------------------


def test_from_terminal_is_unverified_with_cli_prefix() -> None:
    p = Principal.from_terminal("rod", "laptop")
    assert p == Principal("cli:rod@laptop", verified=False)
    assert p.verified is False


def test_principal_default_is_unverified() -> None:
    assert Principal("actor:member:42").verified is False


def test_from_record_exact_true_is_verified() -> None:
    assert Principal.from_record({"id": "actor:member:42", "verified": True}) == HUMAN


@pytest.mark.parametrize("claim", ["true", 1, "yes", None, 1.0])
def test_from_record_never_raises_trust(claim: object) -> None:
    p = Principal.from_record({"id": "actor:member:42", "verified": claim})
    assert p == Principal("actor:member:42", verified=False)


def test_from_record_missing_verified_is_unverified() -> None:
    assert Principal.from_record({"id": "cli:rod@laptop"}) == Principal("cli:rod@laptop", False)


@pytest.mark.parametrize("record", [{"verified": True}, {"id": "", "verified": True}, {"id": None}])
def test_from_record_without_id_is_no_principal(record: dict[str, Any]) -> None:
    assert Principal.from_record(record) is None


def test_from_record_none_stays_none() -> None:
    assert Principal.from_record(None) is None


def test_principal_record_round_trip() -> None:
    assert HUMAN.to_record() == {"id": "actor:member:42", "verified": True}
    assert Principal.from_record(HUMAN.to_record()) == HUMAN


# -- verified answers through the store -----------------------------------------------------------


def test_store_with_signer_stores_a_verified_decision() -> None:
    store = _store(signer=ANSWERING)
    _asked(store)
    store.answer("s1", "q1", "yes", by=HUMAN)
    s = store.load("s1")
    assert s.decisions[-1].by == HUMAN
    assert s.downgrades == 0
    payload = store.log.records[-1].event.payload
    assert payload["signature"]["key_id"] == "answering-1"


def test_store_without_signer_downgrades_a_verified_claim() -> None:
    store = _store(signer=None)
    _asked(store)
    store.answer("s1", "q1", "yes", by=HUMAN)
    s = store.load("s1")
    assert s.decisions[-1].by == Principal("actor:member:42", verified=False)
    assert s.downgrades == 1
    assert store.log.records[-1].event.payload["signature"] is None


def test_store_with_untrusted_signer_downgrades() -> None:
    store = _store(keys=_keys(ANSWERING_NEW), signer=ANSWERING)
    _asked(store)
    store.answer("s1", "q1", "yes", by=HUMAN)
    s = store.load("s1")
    assert s.decisions[-1].by == Principal("actor:member:42", verified=False)
    assert s.downgrades == 1


def test_unverified_answer_is_not_a_downgrade() -> None:
    store = _store(signer=ANSWERING)
    _asked(store)
    store.answer("s1", "q1", "yes", by=Principal.from_terminal("rod", "laptop"))
    s = store.load("s1")
    assert s.decisions[-1].by == Principal("cli:rod@laptop", verified=False)
    assert s.downgrades == 0


def test_downgraded_answer_shows_unverified_on_the_timeline() -> None:
    store = _store(signer=None)
    _asked(store)
    store.answer("s1", "q1", "yes", by=HUMAN, executor="runner-7")
    answered = [e for e in store.timeline("s1") if e["kind"] == "answered"]
    assert answered == [
        {
            "session": "s1",
            "kind": "answered",
            "seq": 3,
            "question_id": "q1",
            "answer": "yes",
            "by": {"id": "actor:member:42", "verified": False},
            "executor": "runner-7",
        }
    ]


def _raw_answer(store: SessionStore, payload: dict[str, Any], event_id: str) -> None:
    store.append(store.event("s1", ev.QUESTION_ANSWERED, payload, event_id=event_id))


def test_agent_forging_a_verified_answer_with_its_own_key_is_downgraded() -> None:
    store = _store(signer=ANSWERING)
    _asked(store)
    signature = AGENT.sign_answer(
        session_id="s1",
        question_id="q1",
        answer="yes",
        principal_id=HUMAN.id,
        event_id="forged-1",
    )
    _raw_answer(
        store,
        {
            "question_id": "q1",
            "answer": "yes",
            "by": {"id": HUMAN.id, "verified": True},
            "executor": None,
            "signature": signature,
        },
        "forged-1",
    )
    s = store.load("s1")
    assert s.decisions[-1].by == Principal(HUMAN.id, verified=False)
    assert s.downgrades == 1


def test_agent_forging_with_a_trusted_key_id_but_its_own_key_is_downgraded() -> None:
    store = _store(signer=ANSWERING)
    _asked(store)
    impostor = Signer(ANSWERING.key_id, AGENT.private_key)
    signature = impostor.sign_answer(
        session_id="s1", question_id="q1", answer="yes", principal_id=HUMAN.id, event_id="f-2"
    )
    _raw_answer(
        store,
        {"question_id": "q1", "answer": "yes", "by": HUMAN.to_record(), "signature": signature},
        "f-2",
    )
    assert store.load("s1").downgrades == 1


def test_verified_claim_without_signature_field_is_downgraded() -> None:
    store = _store(signer=ANSWERING)
    _asked(store)
    _raw_answer(store, {"question_id": "q1", "answer": "yes", "by": HUMAN.to_record()}, "f-3")
    s = store.load("s1")
    assert s.decisions[-1].by == Principal(HUMAN.id, verified=False)
    assert s.downgrades == 1


def _valid_signature(answer_text: str = "yes", event_id: str = "a-1") -> dict[str, object]:
    return ANSWERING.sign_answer(
        session_id="s1",
        question_id="q1",
        answer=answer_text,
        principal_id=HUMAN.id,
        event_id=event_id,
    )


def test_valid_signature_raw_event_is_believed() -> None:
    store = _store(signer=ANSWERING)
    _asked(store)
    _raw_answer(
        store,
        {
            "question_id": "q1",
            "answer": "yes",
            "by": HUMAN.to_record(),
            "signature": _valid_signature(),
        },
        "a-1",
    )
    s = store.load("s1")
    assert s.decisions[-1].by == HUMAN
    assert s.downgrades == 0


def test_valid_signature_copied_onto_another_answer_is_downgraded() -> None:
    store = _store(signer=ANSWERING)
    _asked(store)
    _raw_answer(
        store,
        {
            "question_id": "q1",
            "answer": "no",
            "by": HUMAN.to_record(),
            "signature": _valid_signature("yes", "a-1"),
        },
        "a-1",
    )
    s = store.load("s1")
    assert s.decisions[-1].answer == "no"
    assert s.decisions[-1].by == Principal(HUMAN.id, verified=False)
    assert s.downgrades == 1


def test_valid_signature_copied_onto_another_event_id_is_downgraded() -> None:
    store = _store(signer=ANSWERING)
    _asked(store)
    _raw_answer(
        store,
        {
            "question_id": "q1",
            "answer": "yes",
            "by": HUMAN.to_record(),
            "signature": _valid_signature("yes", "a-1"),
        },
        "a-2",
    )
    s = store.load("s1")
    assert s.decisions[-1].by == Principal(HUMAN.id, verified=False)
    assert s.downgrades == 1


def test_valid_signature_copied_onto_another_principal_is_downgraded() -> None:
    store = _store(signer=ANSWERING)
    _asked(store)
    _raw_answer(
        store,
        {
            "question_id": "q1",
            "answer": "yes",
            "by": {"id": "actor:member:7", "verified": True},
            "signature": _valid_signature("yes", "a-1"),
        },
        "a-1",
    )
    s = store.load("s1")
    assert s.decisions[-1].by == Principal("actor:member:7", verified=False)
    assert s.downgrades == 1


def test_valid_signature_copied_into_another_session_is_downgraded() -> None:
    store = _store(signer=ANSWERING)
    _asked(store, "s2")
    store.append(
        store.event(
            "s2",
            ev.QUESTION_ANSWERED,
            {
                "question_id": "q1",
                "answer": "yes",
                "by": HUMAN.to_record(),
                "signature": _valid_signature("yes", "a-1"),
            },
            event_id="a-1",
        )
    )
    assert store.load("s2").downgrades == 1


# -- key sets as an explicit input of the fold: rotation, removal, replay ------------------------


def _signed_answer_stream(signer: Signer, sid: str = "s1") -> list[Any]:
    sig = signer.sign_answer(
        session_id=sid, question_id="q1", answer="yes", principal_id=HUMAN.id, event_id=f"{sid}-a"
    )
    return [
        started(session_id=sid, event_id=f"{sid}-start"),
        ask("q1", "Deploy?", session_id=sid, event_id=f"{sid}-ask"),
        answer(
            "q1",
            "yes",
            by=HUMAN.to_record(),
            extra={"signature": sig},
            session_id=sid,
            event_id=f"{sid}-a",
        ),
    ]


def _verified(session: Session) -> bool:
    by = session.decisions[-1].by
    assert by is not None
    return by.verified


def test_fold_believes_a_signature_by_a_trusted_key() -> None:
    s = fold("s1", _signed_answer_stream(ANSWERING), _keys(ANSWERING))
    assert _verified(s) is True
    assert s.downgrades == 0


def test_key_rotation_adds_a_key_id_old_signatures_still_verify() -> None:
    old = _signed_answer_stream(ANSWERING, "s1")
    new = _signed_answer_stream(ANSWERING_NEW, "s2")
    rotated = _keys(ANSWERING, ANSWERING_NEW)
    assert rotated.key_ids() == ("answering-1", "answering-2")
    assert _verified(fold("s1", old, rotated)) is True
    assert _verified(fold("s2", new, rotated)) is True
    # Before the rotation the new key's signatures were not believed.
    assert _verified(fold("s2", new, _keys(ANSWERING))) is False


def test_removing_a_compromised_key_and_refolding_reads_its_signatures_unverified() -> None:
    events = _signed_answer_stream(ANSWERING)
    before = fold("s1", events, _keys(ANSWERING, ANSWERING_NEW))
    after = fold("s1", events, _keys(ANSWERING_NEW))
    assert _verified(before) is True
    assert _verified(after) is False
    assert after.downgrades == 1
    assert after.decisions[-1].answer == "yes"


def test_replay_under_the_same_keys_is_identical() -> None:
    events = _signed_answer_stream(ANSWERING)
    keys = _keys(ANSWERING)
    assert fold("s1", events, keys) == fold("s1", events, keys)
    assert fold("s1", events, TrustedKeys.none()) == fold("s1", events, TrustedKeys.none())


def test_no_keys_trusts_nobody() -> None:
    s = fold("s1", _signed_answer_stream(ANSWERING), TrustedKeys.none())
    assert _verified(s) is False
    assert s.downgrades == 1


def test_store_rebuilt_without_the_key_reads_the_same_log_unverified() -> None:
    store = _store(signer=ANSWERING)
    _asked(store)
    store.answer("s1", "q1", "yes", by=HUMAN)
    events = _events(store)
    assert _verified(fold("s1", events, _keys(ANSWERING))) is True
    rebuilt = fold("s1", events, _keys(ANSWERING_NEW))
    assert _verified(rebuilt) is False
    assert rebuilt.downgrades == 1


def test_signature_must_be_bytes_not_text() -> None:
    sig = _valid_signature("yes", "a-9")
    text_sig = {"key_id": sig["key_id"], "signature": str(sig["signature"])}
    events = [
        started(event_id="st"),
        ask("q1", "Deploy?", event_id="q"),
        answer("q1", "yes", by=HUMAN.to_record(), extra={"signature": text_sig}, event_id="a-9"),
    ]
    s = fold("s1", events, _keys(ANSWERING))
    assert _verified(s) is False
    assert s.downgrades == 1
