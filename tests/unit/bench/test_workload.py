"""The bench's session workload: what a fold that trusts the bench's operator does with it."""

from __future__ import annotations

from collections import Counter
from datetime import UTC, datetime

from bench import workload
from schemas import events as ev
from schemas.events import Event
from session_model.authority import Authority
from session_model.fold import fold
from session_model.policy import APPROVAL, SIGNATURE
from session_model.session import Session
from session_model.signing import TrustedKeys

BASE = datetime(2026, 3, 1, 9, 0, tzinfo=UTC)


def _folded(work: workload.Workload, keys: TrustedKeys) -> dict[str, Session]:
    per_session: dict[str, list[Event]] = {sid: [] for sid in work.sessions}
    for e in work.events:
        per_session[e.session_id].append(e)
    return {sid: fold(sid, events, Authority(keys)) for sid, events in per_session.items()}


def test_every_event_is_applied_and_signature_questions_are_approved_by_the_operator() -> None:
    work = workload.sessions_workload(400, "wl", 100, base=BASE, partitions=1)
    assert len(work.events) == 19 * 400
    states = _folded(work, workload.OPERATOR_KEYS)

    assert not [(sid, s.rejections) for sid, s in states.items() if s.rejection_counts()]
    # Each session's first question is decided by its answer: a signature question (100 of them)
    # by the operator's signed approval, the others by their first option.
    firsts = Counter((s.decisions[0].reason, s.decisions[0].answer) for s in states.values())
    assert firsts == {
        ("permission", "yes"): 109,
        (SIGNATURE, APPROVAL): 100,
        ("target_not_named", "yes"): 96,
        (None, "left"): 95,
    }
    assert all(len(s.decisions) == 1 and s.decisions[0].affirmative for s in states.values())
    signed = [s for s in states.values() if s.decisions[0].reason == SIGNATURE]
    assert all(len(s.approvals) == 1 and s.approvals[0].consumed_at is None for s in signed)
    answers = [e for e in work.events if e.type == ev.QUESTION_ANSWERED]
    by_console = [e for e in answers if e.producer == "bench-console"]
    assert len(by_console) == 100
    assert all(e.payload["approval"] is not None for e in by_console)
    # One session in ten stays paused on its second question; the others ended.
    paused = [sid for sid, s in states.items() if not s.ended]
    assert len(paused) == 40
    assert all(states[sid].question is not None for sid in paused)


def test_without_the_operators_key_the_approvals_are_refused() -> None:
    """The approvals are what makes the signature answers stand: a fold that does not trust the
    bench's operator refuses them (and the other signed acts) as `unauthorized`."""
    work = workload.sessions_workload(40, "wl", 10, base=BASE, partitions=1)
    states = _folded(work, TrustedKeys.none())
    refused = Counter(
        r.type for s in states.values() for r in s.rejections if r.code == "unauthorized"
    )
    signature = sum(
        e.type == ev.QUESTION_ANSWERED and e.payload["approval"] is not None for e in work.events
    )
    assert signature > 0
    assert refused[ev.QUESTION_ANSWERED] == signature
    assert not any(s.approvals for s in states.values())
