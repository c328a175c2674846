"""The long-session projector workload: compactions where the scheduler would put them, a fleet."""

from __future__ import annotations

from collections import Counter

from bench import workload
from bench.figures.projector_long import long_fleet, long_script, with_compactions
from producers.memory import InMemoryEventLog
from schemas import events as ev
from session_model.authority import Authority
from session_model.compaction import Compactor, compaction_due
from session_model.fold import fold, step
from session_model.session import RECENT_ARTIFACTS, Session


def _session(n: int, sid: str = "s-1") -> list:
    collecting = InMemoryEventLog()
    long_script(workload.writer(collecting), sid, 3, n)
    return [r.event for r in collecting.records]


def test_a_compaction_follows_each_event_that_makes_one_due() -> None:
    compactor = Compactor()
    events, count = with_compactions(_session(400), compactor, workload.OPERATOR_KEYS)
    kinds = [e.type for e in events]
    assert count == kinds.count(ev.COMPACTED) > 0
    assert len(events) == 400 + count
    auth = Authority(workload.OPERATOR_KEYS)
    state = Session("s-1")
    for i, event in enumerate(events):
        state = step(state, event, auth).state
        upcoming = events[i + 1].type if i + 1 < len(events) else None
        # Never left due past one event: the next event is its compaction.
        assert not compaction_due(state, compactor.max_turns) or upcoming == ev.COMPACTED
    assert len(state.turns) <= compactor.max_turns
    assert state.compacted_through > 0


def test_the_compactions_are_the_schedulers_and_deterministic() -> None:
    agent = _session(200)
    first, _ = with_compactions(agent, Compactor(), workload.OPERATOR_KEYS)
    again, _ = with_compactions(agent, Compactor(), workload.OPERATOR_KEYS)
    assert [e.event_id for e in first] == [e.event_id for e in again]
    compactions = [e for e in first if e.type == ev.COMPACTED]
    assert all(e.producer == "milpa-scheduler" for e in compactions)
    assert len({e.payload["through"] for e in compactions}) == len(compactions)


def test_the_fleet_interleaves_every_session_and_keeps_each_in_order() -> None:
    fleet = long_fleet(6, 300, "t", Compactor(), partitions=3)
    assert len(fleet.sessions) == 6
    per = Counter(e.session_id for e in fleet.events)
    assert set(per) == set(fleet.sessions)
    assert sum(per.values()) == 6 * 300 + fleet.compactions
    # All live at once: every stretch of a few rounds holds events of every session.
    for start in range(0, len(fleet.events) - 30, len(fleet.events) // 7):
        assert {e.session_id for e in fleet.events[start : start + 30]} == set(fleet.sessions)
    for sid in fleet.sessions:
        state = fold(sid, (e for e in fleet.events if e.session_id == sid), workload.OPERATOR_KEYS)
        assert state.seq == per[sid] and not state.rejections


def test_a_long_session_keeps_touching_new_files_past_the_artifact_bound() -> None:
    events = _session(3_000)
    named = [e.payload["artifact"] for e in events if e.payload.get("artifact")]
    assert len(set(named)) > RECENT_ARTIFACTS  # the index's bound is what the figure measures
    assert len(set(named)) < len(named)  # and the agent comes back to some files
