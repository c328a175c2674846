"""Compaction: a factual summary of old turns is appended; recent turns and the history stay.

Spec: "Compaction", the `session.compacted` row, `window()`, and "Rejections and no-ops".
"""

from __future__ import annotations

import itertools
import json
from datetime import UTC, datetime
from typing import Any

import pytest

from producers.store import SessionStore
from schemas import events as ev
from schemas.codec import EventCodec
from schemas.errors import ConfigurationError
from session_model.canonical import argument_digest
from session_model.compaction import (
    FACTS_CHARS,
    FACTS_HEADER,
    FACTS_VERSION,
    PROSE_CHARS,
    Compactor,
    FactualSummarizer,
    SessionFacts,
    compaction_due,
)
from session_model.fold import Kind, step
from session_model.principal import Principal
from session_model.session import Message, Question, Session
from tests.unit.builders import (
    OPERATOR,
    answer,
    ask,
    fold_all,
    make_event,
    plan,
    started,
    tool,
    turn,
)

T0 = datetime(2026, 1, 1, 10, 0, 0, tzinfo=UTC)
SUMMARY_PREFIX = "Summary of what already happened in this session:\n"


def _store() -> SessionStore:
    counter = itertools.count(1)
    return SessionStore.in_memory(
        signer=OPERATOR, clock=lambda: T0, new_id=lambda: f"ev-{next(counter)}"
    )


def _with_turns(n: int, *, plan: bool = False) -> SessionStore:
    """s1: started (seq 1), optionally plan (seq 2) + todo (seq 3), then n user turns."""
    store = _store()
    store.start("s1", "ship it", "ask")
    if plan:
        store.set_plan("s1", "build then ship")
        store.set_todo("s1", "t1", "build", "in_progress")
    for i in range(1, n + 1):
        store.record_turn("s1", "user", f"turn {i}")
    return store


def _facts_of(summary: str) -> dict[str, Any]:
    _head, sep, tail = summary.partition(FACTS_HEADER + "\n")
    assert sep, "the facts header is missing"
    return json.loads(tail)


# -- configuration ------------------------------------------------------------------------------


def test_defaults_are_forty_and_twelve() -> None:
    c = Compactor()
    assert (c.max_turns, c.keep_recent) == (40, 12)
    assert isinstance(c.summarizer, FactualSummarizer)


@pytest.mark.parametrize(("max_turns", "keep_recent"), [(12, 12), (5, 6), (0, 0)])
def test_compactor_requires_max_turns_above_keep_recent(max_turns: int, keep_recent: int) -> None:
    with pytest.raises(ConfigurationError):
        Compactor(max_turns=max_turns, keep_recent=keep_recent)


def test_compactor_accepts_max_turns_one_above_keep_recent() -> None:
    c = Compactor(max_turns=3, keep_recent=2)
    assert (c.max_turns, c.keep_recent) == (3, 2)


# -- when and where to cut ----------------------------------------------------------------------


def test_nothing_due_at_exactly_max_turns() -> None:
    session = _with_turns(4).load("s1")
    c = Compactor(max_turns=4, keep_recent=2)
    assert c.cut(session) is None
    assert c.plan(session) is None


def test_cut_is_the_unsummarised_turn_at_len_minus_keep_recent_minus_one() -> None:
    session = _with_turns(5).load("s1")  # turns at seq 2..6
    assert [t.seq for t in session.turns] == [2, 3, 4, 5, 6]
    assert Compactor(max_turns=4, keep_recent=2).cut(session) == 4


def test_cut_with_keep_recent_zero_covers_every_turn_but_none_after() -> None:
    session = _with_turns(3).load("s1")  # seq 2..4
    assert Compactor(max_turns=2, keep_recent=0).cut(session) == 4


def test_non_turn_events_do_not_count() -> None:
    store = _with_turns(4)
    for i in range(10):
        store.set_plan("s1", f"plan {i}")
        store.grant("s1", f"op{i}")
    assert Compactor(max_turns=4, keep_recent=2).cut(store.load("s1")) is None


def test_tool_calls_and_messages_count_as_turns() -> None:
    store = _store()
    store.start("s1", "goal")
    store.start("s2", "goal")
    for i in range(3):
        store.record_tool_call("s1", "make", {"i": i}, "ok")
    store.message("s1", "s2", "hello")
    store.message("s1", "s2", "again")
    session = store.load("s1")
    assert [t.role for t in session.turns] == ["tool", "tool", "tool", "user", "user"]
    assert Compactor(max_turns=4, keep_recent=1).cut(session) == session.turns[3].seq


def test_plan_summary_and_through_match_summary_and_cut() -> None:
    session = _with_turns(5).load("s1")
    c = Compactor(max_turns=4, keep_recent=2)
    planned = c.plan(session)
    assert planned is not None
    assert planned.through == 4
    assert planned.summary == c.summary(session, 4)


def test_ended_session_is_not_compacted() -> None:
    store = _with_turns(6)
    store.end("s1", "done")
    assert Compactor(max_turns=4, keep_recent=2).plan(store.load("s1")) is None


# -- compacting through the store ---------------------------------------------------------------


def _compact(store: SessionStore, compactor: Compactor) -> int:
    planned = compactor.plan(store.load("s1"))
    assert planned is not None
    store.compact("s1", planned.summary, planned.through)
    return planned.through


def test_compact_appends_compacted_with_summary_and_through() -> None:
    store = _with_turns(5)
    c = Compactor(max_turns=4, keep_recent=2)
    planned = c.plan(store.load("s1"))
    assert planned is not None
    store.compact("s1", planned.summary, planned.through)
    event = store.log.records[-1].event
    assert event.type == ev.COMPACTED
    assert dict(event.payload) == {"summary": planned.summary, "through": 4}
    s = store.load("s1")
    assert s.summary == planned.summary
    assert s.compacted_through == 4


def test_window_is_summary_then_briefing_then_the_recent_turns() -> None:
    store = _with_turns(5, plan=True)  # turns at seq 4..8
    c = Compactor(max_turns=4, keep_recent=2)
    through = _compact(store, c)
    assert through == 6
    s = store.load("s1")
    assert s.window() == (
        Message("system", SUMMARY_PREFIX + (s.summary or "")),
        Message("system", "Plan of this session: build then ship\nTodos:\n[~] t1: build"),
        Message("user", "turn 4"),
        Message("user", "turn 5"),
    )


def test_window_without_briefing_is_summary_then_recent_turns() -> None:
    store = _with_turns(5)
    _compact(store, Compactor(max_turns=4, keep_recent=2))
    window = store.load("s1").window()
    assert [m.role for m in window] == ["system", "user", "user"]
    assert window[0].content.startswith(SUMMARY_PREFIX)
    assert [m.content for m in window[1:]] == ["turn 4", "turn 5"]


def test_history_keeps_every_turn_after_compaction() -> None:
    store = _with_turns(5)
    _compact(store, Compactor(max_turns=4, keep_recent=2))
    history = store.history("s1")
    assert [(t.role, t.content, t.seq) for t in history] == [
        ("user", f"turn {i}", i + 1) for i in range(1, 6)
    ]
    s = store.load("s1")
    assert [t.seq for t in s.turns] == [5, 6]
    assert s.turn_count == 5


def test_the_log_keeps_every_turn_event_after_compaction() -> None:
    store = _with_turns(5)
    _compact(store, Compactor(max_turns=4, keep_recent=2))
    types = [r.event.type for r in store.log.records]
    assert types == [ev.STARTED] + [ev.TURN] * 5 + [ev.COMPACTED]


def test_count_starts_over_after_compaction() -> None:
    store = _with_turns(5)
    c = Compactor(max_turns=4, keep_recent=2)
    _compact(store, c)
    store.record_turn("s1", "user", "turn 6")
    s = store.load("s1")
    assert s.turn_count == 6  # more than max_turns in total ...
    assert c.cut(s) is None  # ... but only 3 unsummarised: nothing due
    store.record_turn("s1", "user", "turn 7")
    assert c.cut(store.load("s1")) is None
    store.record_turn("s1", "user", "turn 8")
    # unsummarised: seq 5, 6, 8, 9, 10 -> cut at index 2 = seq 8
    assert c.cut(store.load("s1")) == 8


def test_second_compaction_counts_the_turns_summarised_before() -> None:
    store = _with_turns(5)
    c = Compactor(max_turns=4, keep_recent=2)
    _compact(store, c)
    first = store.load("s1").summary or ""
    assert "This summary covers 3 turns; the full record remains in session s1." in first
    for i in range(6, 9):
        store.record_turn("s1", "user", f"turn {i}")
    through = _compact(store, c)
    assert through == 8
    s = store.load("s1")
    assert "This summary covers 6 turns; the full record remains in session s1." in (
        s.summary or ""
    )
    assert SessionFacts(s).turns_covered(8) == 6
    assert [m.content for m in s.window()[1:]] == ["turn 7", "turn 8"]
    assert len(store.history("s1")) == 8


def test_duplicate_compaction_event_is_a_noop() -> None:
    store = _with_turns(5)
    _compact(store, Compactor(max_turns=4, keep_recent=2))
    before = store.load("s1")
    store.compact("s1", "another summary", 4)
    after = store.load("s1")
    assert after.summary == before.summary
    assert after.compacted_through == 4
    assert after.turns == before.turns
    assert after.rejections == ()
    assert after.seq == before.seq + 1  # a no-op still takes a seq


def test_older_compaction_event_is_a_noop_in_the_fold() -> None:
    store = _with_turns(5)
    _compact(store, Compactor(max_turns=4, keep_recent=2))
    state = store.load("s1")
    older = store.event("s1", ev.COMPACTED, {"summary": "older", "through": 3})
    result = step(state, older)
    assert result.outcome.kind is Kind.NOOP
    assert result.state.summary == state.summary


def test_compaction_through_its_own_seq_is_rejected_invalid() -> None:
    store = _with_turns(3)  # seq 1..4, the compacted event would be seq 5
    store.compact("s1", "too far", 5)
    s = store.load("s1")
    assert s.summary is None
    assert s.compacted_through == 0
    assert s.rejection_counts() == {"invalid": 1}


# -- compact_if_needed (spec: returns the summary it appended, or None) ---------------------------


def test_compact_if_needed_appends_and_returns_the_summary() -> None:
    store = _with_turns(5)
    c = Compactor(max_turns=4, keep_recent=2)
    session = store.load("s1")
    expected = c.summary(session, 4)
    returned = c.compact_if_needed(store, session)  # type: ignore[attr-defined]
    assert returned == expected
    assert store.log.records[-1].event.type == ev.COMPACTED
    assert dict(store.log.records[-1].event.payload) == {"summary": expected, "through": 4}
    assert store.load("s1").summary == expected


def test_compact_if_needed_returns_none_and_appends_nothing_when_not_due() -> None:
    store = _with_turns(4)
    before = len(store.log.records)
    c = Compactor(max_turns=4, keep_recent=2)
    assert c.compact_if_needed(store, store.load("s1")) is None  # type: ignore[attr-defined]
    assert len(store.log.records) == before


# -- the factual summary ------------------------------------------------------------------------


def _busy_session() -> SessionStore:
    store = _store()
    store.start("s1", "ship the release", "ask")
    store.set_plan("s1", "build, test, deploy")
    store.record_tool_call("s1", "make", {"t": "a"}, "ok", mutating=True)
    store.record_tool_call("s1", "pytest", {}, "3 passed")
    store.record_tool_call("s1", "make", {"t": "b"}, "ok", mutating=True)
    store.record_tool_call("s1", "make", {"t": "c"}, "ok", mutating=True)
    store.grant("s1", "deploy")
    store.set_todo("s1", "t1", "build", "done")
    store.set_todo("s1", "t2", "test", "in_progress")
    store.set_todo("s1", "t3", "deploy", "blocked")
    store.set_todo("s1", "t4", "announce", "pending")
    store.ask("s1", Question("q1", "Deploy to prod?", ("yes", "no"), reason="permission"))
    store.answer("s1", "q1", "yes", by=Principal.from_terminal("rod", "laptop"))
    return store


def test_factual_summary_lists_the_facts_in_order() -> None:
    s = _busy_session().load("s1")
    prose = FactualSummarizer().summarize(s, s.seq)
    assert prose.split("\n") == [
        "Goal: ship the release",
        "Plan (version 1): build, test, deploy",
        "Tools used: make ×3, pytest ×1",
        "Permissions granted: deploy",
        "Done: t1: build",
        "Pending: t2: test; t3: deploy [blocked]; t4: announce",
        "Human decision: Deploy to prod? → «yes»",
        "This summary covers 5 turns; the full record remains in session s1.",
    ]


def test_factual_summary_tool_counts_use_the_times_sign() -> None:
    s = _busy_session().load("s1")
    prose = FactualSummarizer().summarize(s, s.seq)
    assert "make ×3" in prose
    assert "pytest ×1" in prose


def test_factual_summary_pending_marks_blocked() -> None:
    s = _busy_session().load("s1")
    assert "t3: deploy [blocked]" in FactualSummarizer().summarize(s, s.seq)


def test_factual_summary_human_decision_line() -> None:
    s = _busy_session().load("s1")
    assert "Deploy to prod? → «yes»" in FactualSummarizer().summarize(s, s.seq)


def test_factual_summary_closing_line_counts_covered_turns() -> None:
    store = _with_turns(5)
    s = store.load("s1")
    prose = FactualSummarizer().summarize(s, 4)
    assert prose.split("\n")[-1] == (
        "This summary covers 3 turns; the full record remains in session s1."
    )


def test_factual_summary_of_a_bare_session() -> None:
    s = _with_turns(2).load("s1")
    assert FactualSummarizer().summarize(s, 3) == (
        "Goal: ship it\nThis summary covers 2 turns; the full record remains in session s1."
    )


def test_summary_is_prose_then_facts_header_then_json() -> None:
    s = _busy_session().load("s1")
    summary = Compactor().summary(s, s.seq)
    prose = FactualSummarizer().summarize(s, s.seq)
    facts = json.dumps(
        SessionFacts(s).operational_facts(),
        sort_keys=True,
        separators=(",", ":"),
        ensure_ascii=False,
    )
    assert summary == f"{prose}\n\n{FACTS_HEADER}\n{facts}"
    assert FACTS_HEADER == "Operational facts (JSON, version 4):"


class _Poet:
    def summarize(self, session: Session, through: int) -> str:
        return f"A quiet session named {session.id}."


def test_custom_summarizer_replaces_only_the_prose() -> None:
    s = _busy_session().load("s1")
    summary = Compactor(summarizer=_Poet()).summary(s, s.seq)
    assert summary.startswith("A quiet session named s1.\n\n" + FACTS_HEADER + "\n")
    assert "Goal:" not in summary
    facts = _facts_of(summary)
    assert facts == SessionFacts(s).operational_facts()
    assert facts["version"] == 4
    assert facts["execution_effect_currentness"] == "unknown"


def test_custom_summarizer_summary_lands_in_the_window() -> None:
    store = _with_turns(5)
    _compact(store, Compactor(max_turns=4, keep_recent=2, summarizer=_Poet()))
    first = store.load("s1").window()[0]
    assert first.role == "system"
    assert first.content.startswith(SUMMARY_PREFIX + "A quiet session named s1.\n\n")
    assert FACTS_HEADER in first.content


# -- the operational-facts block ----------------------------------------------------------------


def _facts_session() -> tuple[SessionStore, str]:
    store = _store()
    store.start("s1", "goal", "ask")  # 1
    store.record_tool_call(  # 2
        "s1", "write", {"p": "a.py"}, "x" * 600, mutating=True, artifact="file:a.py"
    )
    store.record_tool_call(  # 3
        "s1", "pytest", {}, "1 passed", artifact="file:a.py", verdict="pass"
    )
    store.record_tool_call("s1", "ls", {}, "a.py", ok=False)  # 4
    store.record_execution(  # 5
        "s1", "deploy", {"target": "prod"}, artifact="file:a.py", executor="runner-1"
    )
    obs = store.record_effect_observation(  # 6
        "s1", known=True, artifacts=["file:a.py"], evidence=["test:t1"], observer="probe"
    )
    store.ask(  # 7
        "s1", Question("q1", "Ship?", ("yes", "no"), why='{"x":1}', reason="permission")
    )
    store.answer("s1", "q1", "yes", by=Principal("actor:member:42"))  # 8
    return store, obs


def test_facts_block_has_version_three_and_unknown_currentness() -> None:
    store, _ = _facts_session()
    facts = SessionFacts(store.load("s1")).operational_facts()
    assert sorted(facts) == [
        "artifacts",
        "calls",
        "decisions",
        "evidence",
        "execution_effect_currentness",
        "executions",
        "tools",
        "verdicts",
        "version",
    ]
    assert facts["version"] == 4
    assert facts["execution_effect_currentness"] == "unknown"


def test_facts_calls_keep_tool_artifact_bounded_result_ok_mutating_seq_latest() -> None:
    store, _ = _facts_session()
    calls = SessionFacts(store.load("s1")).operational_facts()["calls"]
    assert calls == [
        {
            "tool": "write",
            "artifact": "file:a.py",
            "result": "x" * 500,
            "ok": True,
            "mutating": True,
            "seq": 2,
            "latest_for_artifact": False,
        },
        {
            "tool": "pytest",
            "artifact": "file:a.py",
            "result": "1 passed",
            "ok": True,
            "mutating": False,
            "seq": 3,
            "latest_for_artifact": True,
        },
        {
            "tool": "ls",
            "artifact": None,
            "result": "a.py",
            "ok": False,
            "mutating": False,
            "seq": 4,
            "latest_for_artifact": False,
        },
    ]


def test_facts_executions_keep_operation_digest_artifact_executor() -> None:
    store, _ = _facts_session()
    executions = SessionFacts(store.load("s1")).operational_facts()["executions"]
    assert executions == [
        {
            "operation": "deploy",
            "argument_digest": argument_digest({"target": "prod"}),
            "artifact": "file:a.py",
            "executor": "runner-1",
            "seq": 5,
        }
    ]


def test_facts_calls_and_executions_are_not_joined() -> None:
    store, _ = _facts_session()
    facts = SessionFacts(store.load("s1")).operational_facts()
    # The execution targets the same artifact as two calls, and still nothing links them.
    for call in facts["calls"]:
        assert set(call) == {
            "tool",
            "artifact",
            "result",
            "ok",
            "mutating",
            "seq",
            "latest_for_artifact",
        }
    assert set(facts["executions"][0]) == {
        "operation",
        "argument_digest",
        "artifact",
        "executor",
        "seq",
    }
    assert facts["execution_effect_currentness"] == "unknown"


def test_facts_verdicts_decisions_and_evidence() -> None:
    store, obs = _facts_session()
    facts = SessionFacts(store.load("s1")).operational_facts()
    assert facts["verdicts"] == [
        {"tool": "pytest", "artifact": "file:a.py", "verdict": "pass", "seq": 3}
    ]
    assert facts["decisions"] == [
        {
            "question_id": "q1",
            "question": "Ship?",
            "answer": "yes",
            "by": {"id": "actor:member:42", "verified": False},
            "reason": "permission",
            "why": '{"x":1}',
            "expired": False,
            "seq": 8,
        }
    ]
    assert facts["evidence"] == [
        {
            "observation": obs,
            "known": True,
            "artifacts": ["file:a.py"],
            "evidence": ["test:t1"],
            "observer": "probe",
            "seq": 6,
        }
    ]


def test_facts_block_survives_in_the_compacted_summary() -> None:
    store, _ = _facts_session()
    for i in range(5):
        store.record_turn("s1", "assistant", f"step {i}")
    c = Compactor(max_turns=4, keep_recent=1, summarizer=_Poet())
    session = store.load("s1")
    expected = SessionFacts(session).operational_facts()
    _compact(store, c)
    assert _facts_of(store.load("s1").summary or "") == expected


@pytest.mark.parametrize("n_turns", [0, 3, 4, 5, 9])
def test_the_due_index_and_the_compactor_follow_one_rule(n_turns: int) -> None:
    session = _with_turns(n_turns).load("s1")
    compactor = Compactor(max_turns=4, keep_recent=2)
    assert compaction_due(session, compactor.max_turns) == (compactor.cut(session) is not None)
    assert compaction_due(session, compactor.max_turns) == (n_turns > 4)
    assert not compaction_due(session, None)


def test_a_summary_of_texts_as_long_as_events_may_be_fits_in_an_event() -> None:
    huge = "x" * 600_000
    s = fold_all(
        [
            started(huge),
            plan(huge),
            ask("q1", huge, options=("yes", "no")),
            answer("q1", "yes"),
            *[turn("user", f"t{i}") for i in range(8)],
        ]
    )
    compactor = Compactor(max_turns=4, keep_recent=2)
    summary = compactor.summary(s, s.turns[-3].seq)
    assert len(summary) <= PROSE_CHARS + FACTS_CHARS + 200
    assert "[…cut: 600000 characters in all" in summary
    facts = json.loads(summary.split(FACTS_HEADER, 1)[1])
    assert facts["version"] == FACTS_VERSION and facts["decisions"]  # still the facts, cut
    event = make_event(ev.COMPACTED, {"summary": summary, "through": s.turns[-3].seq})
    assert len(EventCodec().encode(event)) < 1_000_000  # a produce request carries it


def test_two_long_tool_names_alike_at_first_stay_two_in_a_cut_summary() -> None:
    long_a, long_b = "t" * 700_000 + "a", "t" * 700_000 + "b"
    s = fold_all(
        [
            started(),
            tool(long_a, {"x": 1}, "ok"),
            tool(long_b, {"x": 2}, "ok"),
            *[turn("user", f"t{i}") for i in range(8)],
        ]
    )
    summary = Compactor(max_turns=4, keep_recent=2).summary(s, s.turns[-3].seq)
    facts = json.loads(summary.split(FACTS_HEADER, 1)[1])
    assert list(facts["tools"].values()) == [1, 1]  # two tools, each called once
