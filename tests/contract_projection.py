"""The contract every `ProjectionStore` (session_model/ports.py) passes, written once.

Not collected by itself (the module name does not start with `test_`). A suite runs the contract
for a concrete store by subclassing `ProjectionStoreContract` in a `test_*.py` module that defines a
`projection_store` fixture yielding a fresh, empty store:

    from tests.contract_projection import ProjectionStoreContract

    @pytest.fixture(params=sorted(STORES))
    def projection_store(request): ...

    class TestMyStore(ProjectionStoreContract):
        pass

`tests/unit/test_projection_contract.py` runs it against `InMemoryProjectionStore`;
`tests/integration` runs the same class against the Redis store. Each test uses only the port:
`folded`, `commit`, `load(at_least, timeout)`, `ids`, `history`, `timeline`, `clear` — plus the
pure `BatchFolder` and the shared `Projector` loop. `VISIBILITY_TIMEOUT` keeps a real store's
bounded wait for an unapplied position short.
"""

from __future__ import annotations

import itertools
import json
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from projections.projector import MAX_CONFLICT_RETRIES, Projector
from schemas import events as ev
from schemas.errors import InvalidCall, NotYetVisibleError, ProjectionError
from schemas.events import Event
from session_model.dedupe import CHUNK, HORIZON
from session_model.fold import fold, step
from session_model.ports import CommitResult, ProjectionStore
from session_model.projection import BatchFolder, Folded, Position, Record, SessionUpdate
from session_model.session import RECENT_FACTS, CallFact, ExecutionFact, History, Observation
from session_model.signing import Signer, TrustedKeys
from session_model.timeline import translate

VISIBILITY_TIMEOUT = 0.05
BASE_TIME = datetime(2026, 1, 1, 10, 0, 0, tzinfo=UTC)


class Log:
    """A tiny in-test log: deterministic events at consecutive offsets of partition 0."""

    def __init__(self) -> None:
        self.records: list[Record] = []
        self._ids: Iterator[int] = itertools.count(1)

    def add(
        self, session_id: str, type_: str, payload: dict[str, Any], event_id: str | None = None
    ) -> Record:
        n = next(self._ids)
        event = Event(
            event_id=f"{session_id}-e{n}" if event_id is None else event_id,
            session_id=session_id,
            type=type_,
            occurred_at=BASE_TIME + timedelta(seconds=n),
            producer="contract",
            payload=payload,
        )
        record = Record(event, Position(0, len(self.records)))
        self.records.append(record)
        return record

    def started(self, sid: str, goal: str = "goal") -> Record:
        return self.add(sid, ev.STARTED, {"goal": goal, "mode": "ask"})

    def turn(self, sid: str, content: str, role: str = "user") -> Record:
        return self.add(sid, ev.TURN, {"role": role, "content": content})

    def events(self, sid: str) -> list[Event]:
        return [r.event for r in self.records if r.event.session_id == sid]


def _project(store: ProjectionStore, records: Sequence[Record]) -> tuple[SessionUpdate, ...]:
    return Projector(store, BatchFolder(TrustedKeys.none())).project(records)


def _snapshot(store: ProjectionStore, sids: Sequence[str]) -> Any:
    return (
        store.folded(list(sids)),
        {sid: store.history(sid) for sid in sids},
        {sid: store.timeline(sid) for sid in sids},
    )


@dataclass
class _StaleFolded:
    """A store whose `folded` answers from an old snapshot `stale_reads` times (a lost owner)."""

    inner: ProjectionStore
    stale: dict[str, Folded]
    stale_reads: int = 1
    commits: int = 0

    def folded(self, session_ids: Sequence[str]) -> dict[str, Folded]:
        if self.stale_reads > 0:
            self.stale_reads -= 1
            return {sid: f for sid, f in self.stale.items() if sid in session_ids}
        return self.inner.folded(session_ids)

    def commit(self, updates: Sequence[SessionUpdate]) -> CommitResult:
        self.commits += 1
        return self.inner.commit(updates)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


class ProjectionStoreContract:
    """Contract tests; subclass in a test module that provides the `projection_store` fixture."""

    # -- commit ---------------------------------------------------------------------------------

    def test_commit_applies_state_and_mark(self, projection_store: ProjectionStore) -> None:
        log = Log()
        log.started("s1")
        log.turn("s1", "hello")
        (update,) = BatchFolder().fold({}, log.records)
        assert update.base is None
        assert update.mark == Position(0, 1)
        result = projection_store.commit([update])
        assert result == CommitResult(applied=("s1",), conflicts=())
        assert projection_store.folded(["s1"]) == {"s1": Folded(update.state, Position(0, 1))}
        assert projection_store.load("s1") == update.state

    def test_folded_returns_only_known_sessions(self, projection_store: ProjectionStore) -> None:
        log = Log()
        log.started("s1")
        _project(projection_store, log.records)
        known = projection_store.folded(["s1", "ghost"])
        assert list(known) == ["s1"]
        assert known["s1"].mark == Position(0, 0)
        assert projection_store.folded(["ghost"]) == {}

    def test_commit_continues_from_the_stored_mark(self, projection_store: ProjectionStore) -> None:
        log = Log()
        log.started("s1")
        _project(projection_store, log.records)
        log.turn("s1", "next")
        known = projection_store.folded(["s1"])
        (update,) = BatchFolder().fold(known, log.records[1:])
        assert update.base == Position(0, 0)
        assert projection_store.commit([update]).applied == ("s1",)
        assert projection_store.folded(["s1"])["s1"].mark == Position(0, 1)
        assert [t.content for t in projection_store.history("s1")] == ["next"]

    def test_stale_update_is_refused_and_writes_nothing(
        self, projection_store: ProjectionStore
    ) -> None:
        log = Log()
        log.started("s1")
        log.turn("s1", "one")
        _project(projection_store, log.records)
        before = _snapshot(projection_store, ["s1"])
        log.turn("s1", "two")
        # Folded from an old mark (nothing known): base None != stored mark 0:1.
        (stale,) = BatchFolder().fold({}, log.records)
        assert stale.base is None
        result = projection_store.commit([stale])
        assert result == CommitResult(applied=(), conflicts=("s1",))
        assert _snapshot(projection_store, ["s1"]) == before

    def test_conflict_on_one_session_does_not_block_another(
        self, projection_store: ProjectionStore
    ) -> None:
        log = Log()
        log.started("s1")
        _project(projection_store, log.records)
        log.turn("s1", "late")
        log.started("s2")
        updates = BatchFolder().fold({}, log.records)  # s1 stale, s2 new
        result = projection_store.commit(updates)
        assert result.applied == ("s2",)
        assert result.conflicts == ("s1",)
        assert projection_store.history("s1") == []
        assert projection_store.load("s2") is not None

    def test_same_update_committed_twice_is_a_conflict(
        self, projection_store: ProjectionStore
    ) -> None:
        log = Log()
        log.started("s1")
        log.turn("s1", "once")
        (update,) = BatchFolder().fold({}, log.records)
        assert projection_store.commit([update]).applied == ("s1",)
        assert projection_store.commit([update]).conflicts == ("s1",)
        assert [t.content for t in projection_store.history("s1")] == ["once"]
        assert len(projection_store.timeline("s1")) == 1

    # -- redelivery and retries -----------------------------------------------------------------

    def test_redelivered_batch_changes_nothing(self, projection_store: ProjectionStore) -> None:
        log = Log()
        log.started("s1")
        log.turn("s1", "a")
        log.turn("s1", "b", role="assistant")
        _project(projection_store, log.records)
        before = _snapshot(projection_store, ["s1"])
        assert _project(projection_store, log.records) == ()
        assert _snapshot(projection_store, ["s1"]) == before
        assert [t.content for t in projection_store.history("s1")] == ["a", "b"]
        assert [e["seq"] for e in projection_store.timeline("s1")] == [2, 3]

    def test_partly_redelivered_batch_applies_only_the_new_records(
        self, projection_store: ProjectionStore
    ) -> None:
        log = Log()
        log.started("s1")
        log.turn("s1", "a")
        _project(projection_store, log.records)
        log.turn("s1", "b")
        _project(projection_store, log.records)  # 0:0 and 0:1 again, 0:2 new
        assert [t.content for t in projection_store.history("s1")] == ["a", "b"]
        assert [e["seq"] for e in projection_store.timeline("s1")] == [2, 3]
        assert projection_store.folded(["s1"])["s1"].mark == Position(0, 2)

    def test_projector_retries_a_conflict(self, projection_store: ProjectionStore) -> None:
        log = Log()
        log.started("s1")
        log.turn("s1", "a")
        _project(projection_store, log.records)
        log.turn("s1", "b")
        flaky = _StaleFolded(projection_store, stale={})  # first read misses the stored mark
        updates = Projector(flaky, BatchFolder()).project(log.records)  # type: ignore[arg-type]
        assert flaky.commits == 2
        assert [u.session_id for u in updates] == ["s1"]
        assert [t.content for t in projection_store.history("s1")] == ["a", "b"]
        assert projection_store.load("s1") == fold("s1", log.events("s1"))

    def test_projector_gives_up_after_repeated_conflicts(
        self, projection_store: ProjectionStore
    ) -> None:
        log = Log()
        log.started("s1")
        _project(projection_store, log.records)
        before = _snapshot(projection_store, ["s1"])
        log.turn("s1", "never")
        flaky = _StaleFolded(projection_store, stale={}, stale_reads=MAX_CONFLICT_RETRIES)
        with pytest.raises(ProjectionError):
            Projector(flaky, BatchFolder()).project(log.records)  # type: ignore[arg-type]
        assert flaky.commits == MAX_CONFLICT_RETRIES
        assert _snapshot(projection_store, ["s1"]) == before

    # -- load(at_least) -------------------------------------------------------------------------

    def test_load_at_an_applied_position_returns_the_session(
        self, projection_store: ProjectionStore
    ) -> None:
        log = Log()
        first = log.started("s1")
        last = log.turn("s1", "a")
        _project(projection_store, log.records)
        for position in (first.position, last.position):
            session = projection_store.load("s1", at_least=position, timeout=VISIBILITY_TIMEOUT)
            assert session is not None
            assert session.seq == 2

    def test_load_at_an_unapplied_position_is_not_yet_visible(
        self, projection_store: ProjectionStore
    ) -> None:
        log = Log()
        log.started("s1")
        _project(projection_store, log.records)
        with pytest.raises(NotYetVisibleError):
            projection_store.load("s1", at_least=Position(0, 1), timeout=VISIBILITY_TIMEOUT)

    def test_load_of_an_unknown_session_at_a_position_is_not_yet_visible(
        self, projection_store: ProjectionStore
    ) -> None:
        with pytest.raises(NotYetVisibleError):
            projection_store.load("ghost", at_least=Position(0, 0), timeout=VISIBILITY_TIMEOUT)

    def test_load_of_an_unknown_session_is_none(self, projection_store: ProjectionStore) -> None:
        assert projection_store.load("ghost") is None

    # -- history, timeline, ids, clear ----------------------------------------------------------

    def test_history_keeps_summarised_turns_after_compaction(
        self, projection_store: ProjectionStore
    ) -> None:
        log = Log()
        log.started("s1")
        for i in range(1, 5):
            log.turn("s1", f"t{i}")  # seq 2..5
        log.add("s1", ev.COMPACTED, {"summary": "so far", "through": 4})
        _project(projection_store, log.records[:3])
        _project(projection_store, log.records)
        session = projection_store.load("s1")
        assert session is not None
        assert [t.seq for t in session.turns] == [5]
        assert session.compacted_through == 4
        history = projection_store.history("s1")
        assert [(t.role, t.content, t.seq) for t in history] == [
            ("user", "t1", 2),
            ("user", "t2", 3),
            ("user", "t3", 4),
            ("user", "t4", 5),
        ]

    def test_a_long_summary_and_a_unicode_one_load_back_exactly(
        self, projection_store: ProjectionStore
    ) -> None:
        """The latest summary, whatever its length (Redis: a long one is stored deflated)."""
        log = Log()
        facts = ",".join(
            f'{{"tool":"make","result":"step {i}: ok 🙂","seq":{i}}}' for i in range(99)
        )
        log.started("s1")
        for i in range(1, 9):
            log.turn("s1", f"t{i}")  # seq 2..9
        log.add("s1", ev.COMPACTED, {"summary": f"Goal: ünï\n\n[{facts}]", "through": 4})
        _project(projection_store, log.records)
        assert projection_store.load("s1") == fold("s1", log.events("s1"))
        log.add("s1", ev.COMPACTED, {"summary": "ÿ short 🙂", "through": 6})
        _project(projection_store, log.records)
        session = projection_store.load("s1")
        assert session == fold("s1", log.events("s1"))
        assert session is not None and session.summary == "ÿ short 🙂"

    @pytest.mark.parametrize("turns", [3, 40], ids=["inline", "in its list"])
    def test_the_latest_entries_are_the_end_of_the_whole_timeline(
        self, projection_store: ProjectionStore, turns: int
    ) -> None:
        """A page of the last entries, read alone, is what the whole timeline ends with."""
        log = Log()
        log.started("s1")
        for k in range(turns):
            log.turn("s1", f"turn {k} " + "x" * 20)  # 40 turns outgrow the state hash's share
        _project(projection_store, log.records)
        whole = projection_store.timeline("s1")
        assert len(whole) == turns
        for latest in (0, 1, 2, turns - 1, turns, turns + 5):
            assert (
                projection_store.timeline("s1", latest=latest)
                == whole[max(len(whole) - latest, 0) :]
            )
            since = whole[turns // 2]["seq"]
            after = [e for e in whole if e["seq"] > since]
            expected = after[max(len(after) - latest, 0) :]
            assert projection_store.timeline("s1", since=since, latest=latest) == expected
        with pytest.raises(InvalidCall):
            projection_store.timeline("s1", latest=-1)

    def test_timeline_since_returns_entries_after_seq_in_order(
        self, projection_store: ProjectionStore
    ) -> None:
        log = Log()
        log.started("s1")
        log.turn("s1", "a")
        log.turn("s1", "b", role="assistant")
        log.add("s1", ev.PLAN_SET, {"plan": "p"})
        _project(projection_store, log.records)
        assert [e["seq"] for e in projection_store.timeline("s1")] == [2, 3, 4]
        assert projection_store.timeline("s1", since=2) == [
            {
                "session": "s1",
                "kind": "activity",
                "seq": 3,
                "state": "ready",
                "role": "assistant",
                "content": "b",
            },
            {
                "session": "s1",
                "kind": "plan",
                "seq": 4,
                "plan": {"text": "p", "version": 1, "supersedes": None},
            },
        ]
        assert projection_store.timeline("s1", since=4) == []
        assert projection_store.timeline("ghost") == []

    def test_ids_are_every_projected_session_sorted(
        self, projection_store: ProjectionStore
    ) -> None:
        log = Log()
        for sid in ("zeta", "alpha", "mid"):
            log.started(sid)
        _project(projection_store, log.records)
        assert projection_store.ids() == ["alpha", "mid", "zeta"]

    def test_clear_drops_every_projection(self, projection_store: ProjectionStore) -> None:
        log = Log()
        log.started("s1")
        log.turn("s1", "a")
        log.started("s2")
        _project(projection_store, log.records)
        projection_store.clear()
        assert projection_store.ids() == []
        assert projection_store.folded(["s1", "s2"]) == {}
        assert projection_store.load("s1") is None
        assert projection_store.history("s1") == []
        assert projection_store.timeline("s1") == []

    def test_rebuild_after_clear_gives_the_same_projection(
        self, projection_store: ProjectionStore
    ) -> None:
        log = Log()
        log.started("s1")
        log.turn("s1", "a")
        _project(projection_store, log.records)
        before = _snapshot(projection_store, ["s1"])
        projection_store.clear()
        _project(projection_store, log.records)
        assert _snapshot(projection_store, ["s1"]) == before

    # -- the store is the fold ------------------------------------------------------------------

    def test_folding_through_the_store_equals_fold(self, projection_store: ProjectionStore) -> None:
        log = Log()
        log.started("s1")
        log.started("s2")
        log.add("s1", ev.PLAN_SET, {"plan": "build"})
        log.add("s1", ev.TODO_CHANGED, {"id": "t1", "text": "build", "status": "in_progress"})
        log.add(
            "s1",
            ev.TOOL_CALLED,
            {"tool": "make", "arguments": {}, "result": "ok", "ok": True, "mutating": True},
        )
        log.turn("s2", "hi")
        log.add(
            "s1",
            ev.QUESTION_ASKED,
            {"question_id": "q1", "question": "Ship?", "options": ["yes", "no"]},
        )
        log.add("s1", ev.QUESTION_ANSWERED, {"question_id": "q1", "answer": "yes", "by": None})
        log.add("s1", ev.TURN, {"role": "tool", "content": "bad role"})  # rejected: invalid
        log.add("s1", "session.from_the_future", {"x": 1})  # skipped
        log.add("s1", ev.TODO_CHANGED, {"id": "t1", "text": "build", "status": "done"})
        log.add("s1", ev.ENDED, {"because": "shipped"})
        # In uneven batches, each redelivered once.
        for cut in (3, 7, len(log.records)):
            _project(projection_store, log.records[:cut])
        for sid in ("s1", "s2"):
            assert projection_store.load(sid) == fold(sid, log.events(sid))
        s1 = projection_store.load("s1")
        assert s1 is not None
        assert s1.rejection_counts() == {"invalid": 1}
        assert s1.skipped == 1
        assert s1.ended_because == "shipped"

    # -- what a store keeps, exactly (Redis: every form of its layout) -------------------------

    def test_a_long_session_in_uneven_batches_is_the_fold(
        self, projection_store: ProjectionStore
    ) -> None:
        """Enough events, entries and state to outgrow every inline form a store may have."""
        log = Log()
        sid = "long-session-ü"
        log.started(sid, goal="g" * 300)
        for i in range(45):
            if i % 3 == 0:
                log.add(
                    sid,
                    ev.TODO_CHANGED,
                    {"id": f"t{i}", "text": f"card «{i}»", "status": "pending"},
                )
            elif i % 3 == 1:
                log.turn(sid, f"turn {i}\nsecond line 🙂", role="assistant")
            else:
                log.add(
                    sid, ev.PLAN_SET, {"plan": f"plan {i} " + "p" * (40 * i)}, str(uuid.uuid4())
                )
        log.add(sid, ev.PLAN_SET, {"plan": "short again"})  # the state shrinks
        for cut in (1, 2, 5, 17, 18, 30, len(log.records)):
            _project(projection_store, log.records[:cut])
            events = [r.event for r in log.records[:cut]]
            assert projection_store.load(sid) == fold(sid, events)
            assert projection_store.timeline(sid) == _timeline(sid, events)
        assert [t.seq for t in projection_store.history(sid)] == [
            r.position.offset + 1 for r in log.records if r.event.type == ev.TURN
        ]

    def test_a_duplicate_event_id_is_ignored_after_a_reload(
        self, projection_store: ProjectionStore
    ) -> None:
        """The stored event ids (UUIDs and any other text) are exactly what the fold saw."""
        log = Log()
        ids = [
            str(uuid.uuid4()),
            "plain-id",
            "",
            "ünïcode-🙂",
            "X" * 300,
            str(uuid.uuid4()).upper(),
        ]
        log.add("s1", ev.STARTED, {"goal": "g", "mode": "ask"}, ids[0])
        for i, event_id in enumerate(ids[1:]):
            log.add(
                "s1", ev.TODO_CHANGED, {"id": f"t{i}", "text": "x", "status": "pending"}, event_id
            )
        _project(projection_store, log.records)
        before = projection_store.load("s1")
        assert before is not None and set(before.event_ids) == set(ids)
        for event_id in ids:  # each again, at a new offset, read back from the store
            log.add("s1", ev.TURN, {"role": "user", "content": "again"}, event_id)
            _project(projection_store, log.records)
        after = projection_store.load("s1")
        assert after is not None
        assert (after.seq, after.event_ids, after.turns) == (before.seq, before.event_ids, ())
        assert len(projection_store.timeline("s1")) == len(ids) - 1

    def test_many_events_then_a_duplicate_of_the_first(
        self, projection_store: ProjectionStore
    ) -> None:
        log = Log()
        first = log.add("s1", ev.STARTED, {"goal": "g", "mode": "ask"}, str(uuid.uuid4()))
        for i in range(40):
            log.add("s1", ev.TURN, {"role": "user", "content": f"t{i}"}, str(uuid.uuid4()))
            _project(projection_store, log.records)
        log.add("s1", ev.STARTED, {"goal": "again", "mode": "ask"}, first.event.event_id)
        _project(projection_store, log.records)
        events = log.events("s1")
        assert projection_store.load("s1") == fold("s1", events)
        assert projection_store.folded(["s1"])["s1"].state.seq == 41

    def test_the_id_window_survives_reloads_in_any_batching(
        self, projection_store: ProjectionStore
    ) -> None:
        """Past the dedupe horizon, every cut of the log reloads to the fold's state (the window
        of ids included), and a retry within the horizon is still a duplicate after a reload."""
        log = Log()
        sid = "s-window"
        log.started(sid)
        n = HORIZON + 3 * CHUNK + 7
        for i in range(n):
            log.add(sid, ev.TURN, {"role": "user", "content": f"t{i}"}, _id(i))
        cuts = [1, 3, 16, 17, 63, 64, 65, 66, 200, HORIZON + CHUNK, 577, 578, 600, len(log.records)]
        for cut in cuts:
            _project(projection_store, log.records[:cut])
            stored = projection_store.folded([sid])[sid].state
            assert stored == fold(sid, log.events(sid)[:cut])
        retried = log.records[-HORIZON].event
        log.add(sid, ev.TURN, {"role": "user", "content": "retry"}, retried.event_id)
        _project(projection_store, log.records)
        after = projection_store.folded([sid])[sid].state
        assert after.seq == n + 1  # the retry took no seq
        assert after == fold(sid, log.events(sid))

    def test_a_signed_grant_sent_again_past_the_window_is_a_duplicate_after_reloads(
        self, projection_store: ProjectionStore
    ) -> None:
        """The ids of signed acts outlive the dedupe window in the stored state too."""
        operator = Signer.generate("ops")
        log = Log()
        sid = "s-signed"
        log.started(sid)
        grant_id = str(uuid.uuid4())
        signature = operator.sign_authority(
            session_id=sid,
            event_id=grant_id,
            event_type=ev.PERMISSION_GRANTED,
            fields={"operation": "deploy"},
        )
        grant = {"operation": "deploy", "authority": signature}
        log.add(sid, ev.PERMISSION_GRANTED, grant, grant_id)
        log.add(sid, ev.PERMISSION_REVOKED, {"operation": "deploy"})
        for i in range(HORIZON + CHUNK):
            log.turn(sid, f"t{i}")
        projector = Projector(projection_store, BatchFolder(operator.trusted_keys()))
        for at in range(0, len(log.records), 97):  # reloaded from the store between batches
            projector.project(log.records[at : at + 97])
        before = projection_store.folded([sid])[sid].state
        assert before.signed_ids == frozenset({grant_id}) and before.permissions == ()
        log.add(sid, ev.PERMISSION_GRANTED, grant, grant_id)  # the same record, sent again
        Projector(projection_store, BatchFolder(operator.trusted_keys())).project(log.records)
        after = projection_store.folded([sid])[sid].state
        assert (after.seq, after.permissions) == (before.seq, ())
        assert after == fold(sid, log.events(sid), operator.trusted_keys())

    def test_the_history_keeps_every_fact_the_state_lets_go(
        self, projection_store: ProjectionStore
    ) -> None:
        """Calls, observations, executions, decisions and rejections: all of them, in order."""
        log = Log()
        sid = "s-history"
        log.started(sid)
        for i in range(RECENT_FACTS + 10):
            log.add(sid, ev.TOOL_CALLED, {"tool": "make", "result": f"r{i}", "artifact": f"a{i}"})
            if i % 7 == 0:
                log.add(sid, ev.EFFECT_OBSERVED, {"known": True, "artifacts": [f"a{i}"]})
                log.add(sid, ev.EXECUTION_RECORDED, {"operation": "op", "argument_digest": f"d{i}"})
            if i % 3 == 0:
                log.add(sid, ev.QUESTION_ASKED, {"question_id": f"q{i}", "question": "?"})
                log.add(sid, ev.QUESTION_ANSWERED, {"question_id": f"q{i}", "answer": "yes"})
                log.add(sid, ev.QUESTION_ANSWERED, {"question_id": f"q{i}", "answer": "again"})
        for at in range(0, len(log.records), 37):
            _project(projection_store, log.records[: at + 37])
        steps, state = [], fold(sid, [])
        for event in log.events(sid):
            result = step(state, event)
            state = result.state
            steps.append(result.outcome)
        history = projection_store.facts(sid)
        assert history.seq == state.seq
        assert history.calls == tuple(o.fact for o in steps if isinstance(o.fact, CallFact))
        assert len(history.calls) == RECENT_FACTS + 10 > len(state.calls)
        assert history.observations == tuple(
            o.fact for o in steps if isinstance(o.fact, Observation)
        )
        assert history.executions == tuple(
            o.fact for o in steps if isinstance(o.fact, ExecutionFact)
        )
        assert history.decisions == tuple(o.decision for o in steps if o.decision is not None)
        assert len(history.decisions) > len(state.decisions)
        assert history.rejections == tuple(o.rejection for o in steps if o.rejection is not None)
        assert [r.code for r in history.rejections] == ["no_open_question"] * 25
        assert state.rejection_counts() == {"no_open_question": 25}
        decided = projection_store.facts(sid, kinds=["decisions"])
        assert decided == History(sid, history.seq, decisions=history.decisions)
        assert projection_store.facts(sid, kinds=[]) == History(sid, history.seq)
        with pytest.raises(InvalidCall, match="no history kind turns"):
            projection_store.facts(sid, kinds=["decisions", "turns"])

    def test_ids_with_pattern_characters(self, projection_store: ProjectionStore) -> None:
        log = Log()
        sids = ["a*b", "[x]", "q?", "back\\slash", "}brace{", "sp ace", "ü"]
        for sid in sids:
            log.started(sid)
        _project(projection_store, log.records)
        assert projection_store.ids() == sorted(sids)
        for sid in sids:
            session = projection_store.load(sid)
            assert session is not None and session.id == sid


def _id(n: int) -> str:
    """Event ids of both stored forms: canonical UUIDs and other text."""
    return str(uuid.UUID(int=n + 1, version=4)) if n % 3 else f"plain-{n}"


def _timeline(session_id: str, events: Sequence[Event]) -> list[dict[str, Any]]:
    """What `timeline()` returns for these events: the fold's entries after a trip through JSON."""
    state, entries = fold(session_id, []), []
    for event in events:
        result = step(state, event)
        state = result.state
        entries.extend(translate(result))
    return [json.loads(json.dumps(e, default=str)) for e in entries]
