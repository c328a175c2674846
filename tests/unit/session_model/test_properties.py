"""Properties of the fold over random, valid-ish event sequences (spec: Principles 2, 3 and 5).

The generator draws sequences over every event type, with payloads drawn from small pools so that
they interact (the same question ids, card ids, tools): valid events, events the fold rejects
(bad modes, empty ids, answers to nothing, writes after the end, stale `expected_seq`), no-ops,
events of unknown types and exact duplicates of earlier events.
"""

from __future__ import annotations

import copy
from dataclasses import replace
from datetime import UTC, datetime, timedelta

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from schemas import events as ev
from schemas.events import Event
from session_model.fold import Kind, apply, fold, step
from session_model.session import Session

SID = "s1"
T0 = datetime(2025, 1, 1, 12, 0, tzinfo=UTC)
UNKNOWN_TYPE = "session.unknown_future_type"

SETTINGS = settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)

_QIDS = ["q1", "q2", ""]
_TODO_IDS = ["a", "b", "c", ""]
_STATUSES = ["pending", "in_progress", "done", "blocked", "bogus"]
_MODES = ["ask", "acknowledge", "auto", "turbo", None]
_TOOLS = ["lint", "make", "rm", ""]
_BY = [
    None,
    {"id": "cli:rod@laptop", "verified": False},
    {"id": "actor:member:42", "verified": True},
    {"id": "actor:member:43", "verified": "true"},
    {"verified": True},
]

_AT = T0 + timedelta(hours=1)

# Payload variants per type, drawn by index (cheap to generate, easy to shrink).
_PAYLOADS: dict[str, list[dict]] = {
    ev.STARTED: [
        {"goal": goal, "mode": mode, "parent_id": parent}
        for goal in ("g", "other")
        for mode in _MODES
        for parent in (None, "p1")
    ],
    ev.TURN: [
        {"role": role, "content": content}
        for role in ("user", "assistant", "system", "robot")
        for content in ("hi", "")
    ],
    ev.TOOL_CALLED: [
        {"tool": tool, "arguments": {}, "result": "ok", "ok": ok, "mutating": mutating}
        for tool in _TOOLS
        for ok in (True, False)
        for mutating in (True, False, "yes")
    ],
    ev.MESSAGE_SENT: [{"from": "s2", "content": "ping"}, {"from": "", "content": "yes"}],
    ev.PLAN_SET: [{"plan": "P1"}, {"plan": "P2"}],
    ev.TODO_CHANGED: [
        {"id": todo_id, "text": text, "status": status, "replaces": replaces}
        for todo_id in _TODO_IDS
        for text in ("A", "B")
        for status in _STATUSES
        for replaces in (None, "a")
    ],
    ev.QUESTION_ASKED: [
        {
            "question_id": qid,
            "question": "Proceed?",
            "options": options,
            "why": why,
            "expires_at": expires,
            "reason": reason,
        }
        for qid in _QIDS
        for options in (["yes", "no"], [])
        for why in (None, '{"operation":"deploy","target":"prod"}')
        for expires in (None, "2025-01-01T13:00:00Z", "tomorrow")
        for reason in (None, "permission", "target_not_named")
    ],
    ev.QUESTION_ANSWERED: [
        {"question_id": qid, "answer": answer, "by": by, "executor": executor}
        for qid in ("q1", "q1", "q2", "")
        for answer in ("yes", "no")
        for by in _BY
        for executor in (None, "runner-1")
    ],
    ev.ANSWER_WINDOW_CLOSED: [{"question_id": qid, "at": _AT} for qid in ("q1", "q1", "q2", "")],
    ev.PERMISSION_GRANTED: [{"operation": op} for op in ("deploy", "rm", "")],
    ev.PERMISSION_REVOKED: [{"operation": op} for op in ("deploy", "rm", "")],
    ev.MODE_CHANGED: [{"mode": mode} for mode in _MODES],
    ev.OPTION_REMOVED: [
        {"option": option, "reason": reason}
        for option in ("force-push", "")
        for reason in ({"code": "policy"}, {"code": ""}, {"code": "x", "message": "m"})
    ],
    ev.PREREQUISITE_SET: [
        {"tools": tools}
        for tools in ([], ["lint"], ["plan", "todo"], ["lint", "", " "], ["make", "lint"])
    ],
    ev.COMPACTED: [
        {"summary": summary, "through": through}
        for summary in ("S1", "S2")
        for through in range(15)
    ],
    ev.TODOS_TRANSFERRED: [
        {"to": to, "todos": todos}
        for to in ("s2", "")
        for todos in ([], [{"id": "a", "version": 1}], [{"id": "b", "version": 2}, {"id": "c"}])
    ],
    ev.EFFECT_OBSERVED: [
        {"known": known, "artifacts": artifacts, "evidence": evidence, "observer": "probe"}
        for known in (True, False)
        for artifacts in ([], ["f:1"], ["f:1", "f:2"])
        for evidence in ([], ["t:1"])
    ],
    ev.EXECUTION_RECORDED: [
        {"operation": op, "argument_digest": digest, "artifact": "svc", "executor": None}
        for op in ("deploy", "")
        for digest in ("d1", "")
    ],
    ev.ENDED: [{"because": "done"}, {"because": "stopped"}],
    UNKNOWN_TYPE: [{"x": 1}, {}],
}

# Weighted so that sessions usually start early and usually stay alive for a while.
_QUESTION_TYPES = [ev.QUESTION_ASKED, ev.QUESTION_ANSWERED, ev.ANSWER_WINDOW_CLOSED]
_TYPES = [
    *[t for t in _PAYLOADS if t not in (ev.STARTED, ev.ENDED)] * 3,
    *_QUESTION_TYPES * 3,
    ev.STARTED,
    ev.ENDED,
]


def _event(i: int, type_: str, payload: dict, expected_seq: int | None) -> Event:
    return Event(
        event_id=f"g{i}",
        session_id=SID,
        type=type_,
        occurred_at=T0 + timedelta(seconds=i),
        producer=f"p{i % 3}",
        payload=copy.deepcopy(payload),
        expected_seq=expected_seq,
    )


def _payload(draw: st.DrawFn, type_: str) -> dict:
    variants = _PAYLOADS[type_]
    return variants[draw(st.integers(0, len(variants) - 1))]


@st.composite
def event_sequences(draw: st.DrawFn, max_size: int = 30) -> list[Event]:
    """A stream: usually opened by `started`, then anything, with duplicates mixed in."""
    events: list[Event] = []
    if draw(st.integers(0, 9)) > 0:
        events.append(_event(0, ev.STARTED, _payload(draw, ev.STARTED), None))
    n = draw(st.integers(0, max_size))
    for i in range(1, n + 1):
        kind = draw(st.integers(0, 19))
        if events and kind == 0:
            events.append(events[draw(st.integers(0, len(events) - 1))])  # an exact duplicate
            continue
        expected = draw(st.integers(0, 12)) if kind in (1, 2) else None
        type_ = _TYPES[draw(st.integers(0, len(_TYPES) - 1))]
        events.append(_event(i, type_, _payload(draw, type_), expected))
    return events


def _fold(events: list[Event]) -> Session:
    return fold(SID, events)


def _states(events: list[Event]) -> list[Session]:
    """The state after each event (index k = after k+1 events)."""
    state, out = Session(SID), []
    for e in events:
        state = apply(state, e)
        out.append(state)
    return out


# -- determinism and replay -----------------------------------------------------------------------


@SETTINGS
@given(event_sequences())
def test_fold_is_deterministic(events):
    again = copy.deepcopy(events)
    assert _fold(events) == _fold(again)
    assert _fold(events) == _fold(events)


@SETTINGS
@given(event_sequences())
def test_folding_one_event_at_a_time_equals_folding_the_list(events):
    states = _states(events)
    final = states[-1] if states else Session(SID)
    assert final == _fold(events)


@SETTINGS
@given(event_sequences(), st.data())
def test_replaying_a_prefix_gives_the_intermediate_state(events, data):
    k = data.draw(st.integers(0, len(events)))
    states = _states(events)
    expected = states[k - 1] if k else Session(SID)
    assert _fold(events[:k]) == expected


@SETTINGS
@given(event_sequences())
def test_step_state_equals_apply_and_seq_matches_outcome(events):
    state = Session(SID)
    for e in events:
        result = step(state, e)
        assert result.state == apply(state, e)
        if result.outcome.kind is Kind.DUPLICATE:
            assert result.outcome.seq is None
            assert result.state == state
        else:
            assert result.outcome.seq == state.seq + 1 == result.state.seq
        state = result.state


# -- duplicates -----------------------------------------------------------------------------------


@SETTINGS
@given(event_sequences(), st.data())
def test_duplicates_of_seen_events_change_nothing_at_all(events, data):
    if not events:
        return
    original = _fold(events)
    # Re-deliver some already-seen events (possibly with a different payload: the id decides).
    redelivered = data.draw(st.lists(st.sampled_from(events), min_size=1, max_size=5))
    changed = [replace(e, payload={"garbage": True}, expected_seq=99) for e in redelivered]
    assert _fold([*events, *redelivered]) == original
    assert _fold([*events, *changed]) == original


@SETTINGS
@given(event_sequences(), st.data())
def test_a_duplicate_inserted_after_its_original_changes_nothing(events, data):
    if not events:
        return
    i = data.draw(st.integers(0, len(events) - 1))
    j = data.draw(st.integers(i + 1, len(events)))
    with_duplicate = [*events[:j], events[i], *events[j:]]
    assert _fold(with_duplicate) == _fold(events)
    # ... and every intermediate state is the same as well (the duplicate is invisible).
    states = _states(with_duplicate)
    assert states[j] == states[j - 1]


# -- unknown types --------------------------------------------------------------------------------


def _strip_seq(s: Session) -> Session:
    """The session with every seq-numbered field blanked out.

    Unknown events take a seq (the spec says so), so inserting them renumbers everything after
    them; these fields are compared separately, through the renumbering, in the test below.
    """
    return replace(
        s,
        seq=0,
        skipped=0,
        event_ids=frozenset(),
        compacted_through=0,
        turns=tuple(replace(t, seq=0) for t in s.turns),
        question=replace(s.question, seq=0) if s.question else None,
        closed_question=replace(s.closed_question, seq=0) if s.closed_question else None,
        decisions=tuple(replace(d, seq=0, asked_seq=0) for d in s.decisions),
        rejections=tuple(replace(r, seq=0) for r in s.rejections),
        calls=tuple(replace(c, seq=0) for c in s.calls),
        executions=tuple(replace(x, seq=0) for x in s.executions),
        observations=tuple(replace(o, seq=0) for o in s.observations),
    )


@SETTINGS
@given(event_sequences(), st.data())
def test_inserting_unknown_types_anywhere_changes_nothing_but_seq_numbering(events, data):
    """Unknown-type events are skipped: they only take a seq.

    Honest comparison: an unknown event shifts the seq of every later event by one, and two
    payload fields are *about* seqs (`expected_seq` and `compacted.through`). So the augmented
    stream is the original stream with unknown events inserted AND those two seq references
    renumbered the way the shift renumbers the events they point at (`g` below, a strictly
    monotone map, so every comparison the fold makes between seqs keeps its answer). Then:
    every non-seq field is equal (`_strip_seq`); every seq field of the original maps through `g`
    to the augmented one; `seq` and `skipped` grow by exactly the number inserted.
    """
    # Where the inserted events go: before original index i, `counts[i]` of them (the last
    # slot is after the end).
    counts = data.draw(
        st.lists(st.integers(0, 2), min_size=len(events) + 1, max_size=len(events) + 1)
    )
    total = sum(counts)
    before = [sum(counts[: i + 1]) for i in range(len(events))]  # unknowns before event i

    # The seq each original event got, and how far it moves.
    state, shift_of_seq = Session(SID), {}
    for i, e in enumerate(events):
        result = step(state, e)
        if result.outcome.seq is not None:
            shift_of_seq[result.outcome.seq] = before[i]
        state = result.state
    original = state

    def g(seq: int) -> int:
        if seq <= 0:
            return seq
        return seq + shift_of_seq.get(seq, total)

    augmented: list[Event] = []
    n_unknown = 0
    for i, e in enumerate(events):
        for _ in range(counts[i]):
            n_unknown += 1
            augmented.append(_event(1000 + n_unknown, UNKNOWN_TYPE, {"n": n_unknown}, None))
        payload = dict(e.payload)
        if e.type == ev.COMPACTED and isinstance(payload.get("through"), int):
            payload["through"] = g(payload["through"])
        expected = None if e.expected_seq is None else e.expected_seq + before[i]
        augmented.append(replace(e, payload=payload, expected_seq=expected))
    for _ in range(counts[-1]):
        n_unknown += 1
        augmented.append(_event(1000 + n_unknown, UNKNOWN_TYPE, {"n": n_unknown}, None))
    assert n_unknown == total

    result = _fold(augmented)
    assert _strip_seq(result) == _strip_seq(original)
    assert result.seq == original.seq + total
    assert result.skipped == original.skipped + total
    assert [t.seq for t in result.turns] == [g(t.seq) for t in original.turns]
    assert [r.seq for r in result.rejections] == [g(r.seq) for r in original.rejections]
    assert [d.seq for d in result.decisions] == [g(d.seq) for d in original.decisions]
    assert [d.asked_seq for d in result.decisions] == [g(d.asked_seq) for d in original.decisions]
    assert result.compacted_through == g(original.compacted_through)
    if original.question is not None:
        assert result.question is not None
        assert result.question.seq == g(original.question.seq)


@SETTINGS
@given(event_sequences(), st.data())
def test_unknown_types_without_seq_references_change_only_seq_skipped_and_ids(events, data):
    """The plain form: with no `expected_seq` and no compaction in the stream, appending unknown
    events at the END changes exactly `seq`, `skipped` and `event_ids` and nothing else."""
    plain = [replace(e, expected_seq=None) for e in events if e.type != ev.COMPACTED]
    extra = data.draw(st.integers(1, 3))
    tail = [_event(2000 + k, UNKNOWN_TYPE, {}, None) for k in range(extra)]
    a, b = _fold(plain), _fold([*plain, *tail])
    assert replace(b, seq=a.seq, skipped=a.skipped, event_ids=a.event_ids) == a
    assert b.seq == a.seq + extra
    assert b.skipped == a.skipped + extra
