"""The hot state is bounded: what only grows keeps its recent part, exact indexes, and a window of
event ids whose guarantee does not depend on batching (`session_model.dedupe`)."""

from __future__ import annotations

import json

import pytest

from projections.codec import session_from_blob, session_to_blob
from schemas import events as ev
from session_model.compaction import Compactor, SessionFacts
from session_model.dedupe import CHUNK, HORIZON, KEPT, RecentIds
from session_model.fold import Kind, fold, step
from session_model.session import (
    OTHER_NAMES,
    PAUSE_REASONS,
    RECENT_ARTIFACTS,
    RECENT_DECISIONS,
    RECENT_FACTS,
    RECENT_REJECTIONS,
    TOOL_NAMES,
    CallFact,
    Session,
)
from tests.unit.builders import OPERATOR, fold_all, make_event, started, tool, trusted, turn

# -- the event-id window -----------------------------------------------------------------------


def test_the_window_keeps_the_current_chunk_and_kept_full_chunks() -> None:
    ids = [f"id-{n}" for n in range(1, 2000)]
    window = RecentIds.from_ids(ids)
    seq = len(ids)
    current = (seq - 1) % CHUNK + 1
    assert len(window) == current + KEPT * CHUNK
    assert set(window) == set(ids[-(current + KEPT * CHUNK) :])
    assert ids[-HORIZON] in window and ids[-(current + HORIZON) - 1] not in window


def test_the_window_is_the_same_from_its_chunks_as_from_its_ids() -> None:
    ids = [f"id-{n}" for n in range(1, 700)]
    window = RecentIds.from_ids(ids)
    assert RecentIds.of(window.chunks()) == window
    for n in (0, 1, CHUNK, CHUNK + 1, HORIZON + CHUNK):
        assert RecentIds.of(RecentIds.from_ids(ids[:n]).chunks()) == RecentIds.from_ids(ids[:n])


def _long_session(n: int) -> list[ev.Event]:
    events = [started()]
    for i in range(n):
        events.append(turn("user", f"t{i}") if i % 2 else tool("make", f"r{i}"))
    return events


def test_a_retry_within_the_horizon_is_a_duplicate_and_takes_no_seq() -> None:
    events = _long_session(HORIZON + 300)
    state = fold_all(events)
    retried = events[-HORIZON]  # its original is the HORIZON-th event from the end
    result = step(state, retried, trusted())
    assert result.outcome.kind is Kind.DUPLICATE
    assert result.state is state


def test_a_copy_far_beyond_the_horizon_takes_a_seq() -> None:
    events = _long_session(HORIZON + 3 * CHUNK)
    state = fold_all(events)
    old = events[5]  # a turn or a call: applied again, documented in session_model.dedupe
    result = step(state, old, trusted())
    assert result.outcome.kind is Kind.APPLIED
    assert result.state.seq == state.seq + 1


# -- what only grows is bounded ------------------------------------------------------------------


def test_calls_since_the_last_summary_are_bounded_and_counted_in_full() -> None:
    state = fold_all(_long_session(3 * RECENT_FACTS))
    assert len(state.calls) == RECENT_FACTS
    assert state.calls[-1].seq == state.seq - 1 or state.calls[-1].seq == state.seq
    assert state.tools == {"make": state.tool_calls}
    assert state.tool_calls == 3 * RECENT_FACTS // 2


def test_a_summary_takes_what_it_covers_out_of_the_hot_state() -> None:
    events = _long_session(60)
    state = fold_all(events)
    plan = Compactor(max_turns=40, keep_recent=12).plan(state)
    assert plan is not None
    summary = make_event(ev.COMPACTED, {"summary": plan.summary, "through": plan.through})
    after = step(state, summary, trusted()).state
    assert after.calls and all(c.seq > plan.through for c in after.calls)
    assert after.tools == state.tools  # the counts stay whole


def test_the_latest_call_of_each_artifact_is_carried_across_summaries() -> None:
    events = [
        started(),
        tool("write", "ok", True, extra={"artifact": "file:a.py"}),
        tool("write", "ok", True, extra={"artifact": "file:b.py"}),
    ]
    events += [turn("user", f"t{i}") for i in range(50)]
    state = fold_all(events)
    plan = Compactor(max_turns=40, keep_recent=12).plan(state)
    assert plan is not None
    after = step(
        state,
        make_event(ev.COMPACTED, {"summary": plan.summary, "through": plan.through}),
        trusted(),
    ).state
    assert after.calls == ()  # both calls were summarised
    facts = SessionFacts(after).operational_facts()
    assert [a["artifact"] for a in facts["artifacts"]] == ["file:a.py", "file:b.py"]
    assert facts["tools"] == {"write": 2}
    assert facts["calls"] == []


def _touching(names: list[str]) -> list[ev.Event]:
    return [started()] + [tool("write", "ok", True, extra={"artifact": n}) for n in names]


def test_the_artifact_index_keeps_the_artifacts_called_last() -> None:
    names = [f"file:{i}.py" for i in range(RECENT_ARTIFACTS + 40)]
    names += ["file:3.py", "file:50.py"]  # called again: they are recent again
    state = fold_all(_touching(names))
    assert len(state.artifacts) == RECENT_ARTIFACTS
    kept = set(state.artifacts)
    assert {"file:3.py", "file:50.py"} <= kept
    # 0 to 39 left as RECENT_ARTIFACTS to RECENT_ARTIFACTS + 39 came; then 3, called again, took
    # the place of 40.
    assert not kept & {f"file:{i}.py" for i in range(41) if i != 3}
    assert "file:41.py" in kept and f"file:{RECENT_ARTIFACTS + 39}.py" in kept
    seqs = [c.seq for c in state.artifacts.values()]
    assert seqs == sorted(seqs) and state.artifacts["file:50.py"].seq == state.seq
    assert state.tools == {"write": len(names)}  # the counts stay whole


def test_an_artifact_index_read_back_folds_on_as_if_never_stored() -> None:
    """Stored and read half way (a worker's restart, a snapshot), then folded on: the same state
    as one fold; and an index stored before the bound, or in another order, is read bounded."""
    names = [f"file:{i % 400}.py" for i in range(700)]
    events = _touching(names)
    half = fold_all(events[:350])
    resumed = _read_back(half)
    for event in events[350:]:
        resumed = step(resumed, event, trusted()).state
    whole = fold_all(events)
    assert list(resumed.artifacts.items()) == list(whole.artifacts.items())  # order too

    # As layout 6 stored it before the bound: every artifact, in the order first called.
    every = {c.artifact: c for c in sorted(_calls_of(events), key=lambda c: c.seq)}
    every = dict(sorted(every.items(), key=lambda item: item[0]))  # and in another order
    assert len(every) == 400
    read = _read_back(whole.evolve(artifacts=every)).artifacts
    assert list(read.items()) == list(whole.artifacts.items())


def _read_back(state: Session) -> Session:
    blob = session_to_blob(state)
    return session_from_blob(blob, state.id, state.turns, state.event_ids, state.summary)


def _calls_of(events: list[ev.Event]) -> list[CallFact]:
    """The latest call of every artifact, as the index without its bound would hold them."""
    latest: dict[str, CallFact] = {}
    for seq, e in enumerate(events[1:], start=2):
        name = e.payload["artifact"]
        latest[name] = CallFact(seq, e.payload["tool"], "", True, True, name)
    return list(latest.values())


def test_a_summary_of_a_session_past_its_artifact_bound_keeps_its_facts() -> None:
    names = [f"src/module_{i:05d}/implementation.py" for i in range(3000)]
    events = _touching(names) + [turn("user", f"t{i}") for i in range(50)]
    state = fold_all(events)
    plan = Compactor(max_turns=40, keep_recent=12).plan(state)
    assert plan is not None
    facts = json.loads(plan.summary.split("\n", 2)[-1].split(":\n", 1)[1])
    assert "omitted" not in facts
    assert len(facts["artifacts"]) == RECENT_ARTIFACTS
    assert {a["artifact"] for a in facts["artifacts"]} == set(names[-RECENT_ARTIFACTS:])


def test_a_call_since_the_summary_always_has_its_artifact_in_the_index() -> None:
    # What `latest_for_artifact` relies on: the calls kept are fewer than the artifacts kept.
    assert RECENT_FACTS <= RECENT_ARTIFACTS


def _question(i: int) -> list[ev.Event]:
    why = json.dumps({"operation": "deploy", "target": f"t{i}"})
    return [
        make_event(
            ev.QUESTION_ASKED,
            {
                "question_id": f"q{i}",
                "question": f"Deploy t{i}?",
                "options": ["yes", "no"],
                "why": why,
                "reason": "target_not_named",
            },
        ),
        make_event(ev.QUESTION_ANSWERED, {"question_id": f"q{i}", "answer": "yes"}),
    ]


def test_decisions_keep_the_recent_ones_and_the_exact_indexes() -> None:
    events = [started()]
    for i in range(RECENT_DECISIONS + 5):
        events += _question(i)
    state = fold_all(events)
    assert len(state.decisions) == RECENT_DECISIONS
    assert state.decided == {f"q{i}" for i in range(RECENT_DECISIONS + 5)}
    assert state.confirmed("deploy", "t0")  # decided long before the recent ones
    assert not state.confirmed("deploy", "t999")


def test_rejections_keep_the_recent_ones_and_count_every_one() -> None:
    events = [started()]
    events += [
        make_event(ev.QUESTION_ANSWERED, {"question_id": f"nope{i}", "answer": "x"})
        for i in range(RECENT_REJECTIONS * 2)
    ]
    state = fold_all(events)
    assert len(state.rejections) == RECENT_REJECTIONS
    assert state.rejection_counts() == {"no_open_question": RECENT_REJECTIONS * 2}


@pytest.mark.parametrize("n", [1_000, 10_000])
def test_the_stored_state_of_a_compacted_session_does_not_grow_with_its_age(n: int) -> None:
    """A session compacted as the scheduler would: its stored state stays under a few KB."""
    compactor = Compactor()
    auth = trusted()
    state = Session("s1")
    for event in [started(), *_long_session(n)[1:]]:
        state = step(state, event, auth).state
        plan = compactor.plan(state)
        if plan is not None:
            summary = make_event(ev.COMPACTED, {"summary": plan.summary, "through": plan.through})
            state = step(state, summary, auth).state
    blob = session_to_blob(state)
    assert len(blob) < 16_384
    reloaded = session_from_blob(blob, "s1", state.turns, state.event_ids, state.summary)
    assert reloaded == state


def test_folding_again_from_nothing_gives_the_same_bounded_state() -> None:
    events = _long_session(2 * HORIZON)
    assert fold("s1", events, trusted()) == fold_all(events)
    assert OPERATOR.key_id  # the builders' operator signs the start


# -- counts by a name the agent chooses ------------------------------------------------------------


def test_tools_are_counted_apart_up_to_the_bound_and_the_rest_together() -> None:
    names = [f"mcp__t{i}" for i in range(TOOL_NAMES + 30)] + ["mcp__t0", "mcp__t140"]
    state = fold_all([started()] + [tool(n, "ok") for n in names])
    assert len(state.tools) == TOOL_NAMES + 1
    assert list(state.tools)[:TOOL_NAMES] == names[:TOOL_NAMES]  # the first used stay apart
    assert state.tools["mcp__t0"] == 2
    assert state.tools[OTHER_NAMES] == 31  # 30 names past the bound, one of them twice
    assert sum(state.tools.values()) == len(names) == state.tool_calls


def _asked_and_answered(reasons: list[str]) -> list[ev.Event]:
    events = [started()]
    for i, reason in enumerate(reasons):
        ask = {"question_id": f"q{i}", "question": "?", "options": ["yes"], "reason": reason}
        events.append(make_event(ev.QUESTION_ASKED, ask))
        events.append(make_event(ev.QUESTION_ANSWERED, {"question_id": f"q{i}", "answer": "yes"}))
    return events


def test_pause_reasons_are_counted_apart_up_to_the_bound_and_the_rest_together() -> None:
    reasons = [f"code_{i}" for i in range(PAUSE_REASONS + 5)]
    state = fold_all(_asked_and_answered(reasons))
    assert len(state.pauses) == PAUSE_REASONS + 1
    assert state.pauses[OTHER_NAMES] == 5 and state.pauses["code_0"] == 1


def test_counts_read_back_fold_on_as_one_fold_and_unbounded_counts_are_read_bounded() -> None:
    names = [f"tool_{i % 300}" for i in range(600)]
    events = [started()] + [tool(n, "ok") for n in names]
    whole = fold_all(events)
    resumed = _read_back(fold_all(events[:200]))
    for event in events[200:]:
        resumed = step(resumed, event, trusted()).state
    assert list(resumed.tools.items()) == list(whole.tools.items())  # order too

    # As a state stored before the bound holds them: every name, in the order first used.
    every = {f"tool_{i}": 2 for i in range(300)}
    assert list(_read_back(whole.evolve(tools=every)).tools.items()) == list(whole.tools.items())
