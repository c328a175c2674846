"""A signature-gated operation can be approved for exactly one call, once."""

from __future__ import annotations

from dataclasses import replace

import pytest

from producers.store import SessionStore
from schemas import events as ev
from schemas.errors import UnauthorizedError
from session_model.canonical import argument_digest
from session_model.fold import Kind, step
from session_model.policy import SessionPolicy, Verdict, signature_question
from session_model.principal import Principal
from session_model.signing import Signer
from tests.unit.builders import OPERATOR

ARGS = {"env": "prod", "version": "1.4.2"}
HUMAN = Principal("actor:member:42", verified=True)


def _store(signer: Signer | None = OPERATOR) -> SessionStore:
    return SessionStore.in_memory(keys=OPERATOR.trusted_keys(), signer=signer)


def _agent_and_human() -> tuple[SessionStore, SessionStore]:
    human = _store()
    agent = SessionStore(human.log, human.projections, producer="agent-1")
    agent.start("s1", "release")
    agent.ask("s1", signature_question("deploy", ARGS))
    return agent, human


def _decide(store: SessionStore, arguments: dict[str, object]) -> Verdict:
    session = store.load("s1")
    return SessionPolicy().decide(
        session, "deploy", mutating=True, requires_signature=True, arguments=arguments
    )


def test_a_signed_approval_allows_exactly_that_call_once() -> None:
    agent, human = _agent_and_human()
    assert _decide(agent, ARGS) is Verdict.REQUIRE_SIGNATURE
    human.answer("s1", "sign:deploy", "approved", HUMAN, executor="console")
    session = agent.load("s1")
    assert session.decisions[-1].affirmative
    (approval,) = session.approvals
    assert (approval.operation, approval.argument_digest) == ("deploy", argument_digest(ARGS))
    assert _decide(agent, ARGS) is Verdict.ALLOW
    assert _decide(agent, {**ARGS, "version": "9.9.9"}) is Verdict.REQUIRE_SIGNATURE
    assert (
        SessionPolicy().decide(session, "deploy", mutating=True, requires_signature=True)
        is Verdict.REQUIRE_SIGNATURE
    )  # without the arguments nothing names the call
    agent.record_tool_call("s1", "deploy", {"version": "9.9.9", "env": "prod"}, "no", mutating=True)
    assert _decide(agent, ARGS) is Verdict.ALLOW  # another call consumed nothing
    agent.record_tool_call("s1", "deploy", dict(reversed(ARGS.items())), "ok", mutating=True)
    assert _decide(agent, ARGS) is Verdict.REQUIRE_SIGNATURE  # used: single use
    assert agent.load("s1").approvals[0].consumed_at == agent.load("s1").seq


def test_an_agent_cannot_answer_a_signature_question() -> None:
    agent, _ = _agent_and_human()
    with pytest.raises(UnauthorizedError, match="signature over one call"):
        agent.answer("s1", "sign:deploy", "approved", HUMAN)
    assert agent.load("s1").question is not None


def _answer_event(human: SessionStore, approval: dict[str, object]) -> ev.Event:
    payload = {
        "question_id": "sign:deploy",
        "answer": "approved",
        "by": None,
        "executor": None,
        "signature": None,
        "approval": approval,
    }
    return human.event("s1", ev.QUESTION_ANSWERED, payload)


def _signed(
    signer: Signer, operation: str, digest: str, question_seq: int | None = 2
) -> dict[str, object]:
    call = signer.sign_call(
        session_id="s1", operation=operation, argument_digest=digest, question_seq=question_seq
    )
    return {
        "operation": operation,
        "argument_digest": digest,
        "key_id": call.key_id,
        "signature": call.signature,
    }


@pytest.mark.parametrize(
    "approval",
    [
        None,
        _signed(Signer.generate(OPERATOR.key_id), "deploy", argument_digest(ARGS)),  # untrusted
        _signed(OPERATOR, "deploy", argument_digest({"env": "dev"})),  # other arguments
        _signed(OPERATOR, "rollback", argument_digest(ARGS)),  # another operation
        _signed(OPERATOR, "deploy", argument_digest(ARGS), 9),  # another asking
        _signed(OPERATOR, "deploy", argument_digest(ARGS), None),  # no asking named
    ],
    ids=[
        "missing",
        "untrusted-key",
        "other-arguments",
        "other-operation",
        "other-question",
        "no-question",
    ],
)
def test_a_bad_approval_is_refused_unauthorized_and_the_question_stays_open(
    approval: dict[str, object] | None,
) -> None:
    agent, human = _agent_and_human()
    before = agent.load("s1")
    assert before.question is not None and before.question.seq == 2
    good = _signed(OPERATOR, "deploy", argument_digest(ARGS))
    assert step(before, _answer_event(human, good), OPERATOR.trusted_keys()).state.approvals
    result = step(before, _answer_event(human, approval), OPERATOR.trusted_keys())
    assert result.outcome.kind is Kind.REJECTED
    assert result.outcome.rejection is not None
    assert result.outcome.rejection.code == "unauthorized"
    assert result.state.question is not None
    assert result.state.approvals == ()


def test_a_replayed_approval_is_refused_for_the_next_call() -> None:
    agent, human = _agent_and_human()
    human.answer("s1", "sign:deploy", "approved", HUMAN)
    used = human.log.records[-1].event.payload["approval"]
    agent.record_tool_call("s1", "deploy", ARGS, "ok", mutating=True)
    agent.ask("s1", replace(signature_question("deploy", ARGS), id="sign:deploy"))
    result = step(agent.load("s1"), _answer_event(human, used), OPERATOR.trusted_keys())
    assert result.outcome.rejection is not None
    assert result.outcome.rejection.code == "unauthorized"
    human.answer("s1", "sign:deploy", "approved", HUMAN)  # a fresh signature is fine
    assert _decide(agent, ARGS) is Verdict.ALLOW
