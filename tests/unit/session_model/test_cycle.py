"""The sans-I/O projection cycle: which requests it yields, and what it makes of the replies."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from datetime import timedelta
from typing import Any
from unittest.mock import ANY

import pytest

from projections.memory import InMemoryProjectionStore
from projections.requests import Retention
from schemas import events as ev
from schemas.errors import ProjectionError
from session_model import fold as fold_module
from session_model.cycle import (
    PAUSE,
    Committed,
    Folding,
    ProjectionCycle,
    Read,
    ReadDecisions,
    Steps,
    Write,
    run,
)
from session_model.fold import fold
from session_model.ports import CommitResult
from session_model.projection import UNREADABLE, BatchFolder, Fault, Folded, Position, Record
from session_model.questions import QuestionStatus
from session_model.session import RECENT_DECISIONS
from tests.unit.builders import answer, ask, make_event, started, turn


def _records(events: Sequence[Any], partition: int = 0, start: int = 0) -> list[Record]:
    return [Record(e, Position(partition, start + i)) for i, e in enumerate(events)]


def _script(steps: Steps[Any], replies: Sequence[Any], reply: Any = None) -> tuple[list[Any], Any]:
    """Feed `replies` to the cycle in order (after `reply`, the answer to a request it made
    already); the requests it made and its result."""
    requests: list[Any] = []
    answers = iter(replies)
    while True:
        try:
            requests.append(steps.send(reply))
        except StopIteration as done:
            return requests, done.value
        reply = next(answers)


def test_a_batch_of_new_sessions_reads_once_and_commits_once() -> None:
    events = [started(session_id="a"), started(session_id="b"), turn("user", "x", session_id="a")]
    cycle = ProjectionCycle(BatchFolder())
    requests, (folding, committed) = _script(
        cycle.project(_records(events)), [{}, CommitResult(("a", "b"))]
    )
    assert requests[0] == Read(("a", "b"))
    assert type(requests[1]) is Write
    assert [u.session_id for u in requests[1].updates] == ["a", "b"]
    assert len(requests) == 2
    assert [len(u.steps) for u in folding.updates] == [2, 1]
    assert committed == Committed(folding.updates)
    assert cycle.cache["a"].state == fold("a", [events[0], events[2]])


def test_slices_pause_between_them_and_still_give_one_update_per_session() -> None:
    events = [started(), *[turn("user", f"t{i}") for i in range(6)]]
    cycle = ProjectionCycle(BatchFolder(), slice_size=3)
    requests, folding = _script(cycle.fold(_records(events)), [{}, None, None])
    assert requests == [Read(("s1",)), PAUSE, PAUSE]
    assert len(folding.updates) == 1
    assert folding.updates[0].state == fold("s1", events)
    assert folding.updates[0].base is None


def test_a_conflict_rereads_the_session_and_folds_again_onto_the_stored_state() -> None:
    events = [started(), *[turn("user", f"t{i}") for i in range(4)]]
    records = _records(events)
    store = InMemoryProjectionStore()
    run(ProjectionCycle(BatchFolder()).project(records[:3]), store)  # another writer's work
    stale = ProjectionCycle(BatchFolder())
    stale.cache["s1"] = Folded(fold("s1", events[:1]), records[0].position)
    folding, committed = run(stale.project(records), store)
    assert committed.conflicts == 1
    assert [len(u.steps) for u in committed.updates] == [2]
    assert store.load("s1") == fold("s1", events)
    # Record 0 was below the stale mark; the re-fold found records 0 to 2 applied: 3 in all.
    assert folding.redelivered == 1
    assert folding.redelivered + committed.redelivered == 3


def test_records_held_for_a_parked_partition_are_never_counted_redelivered(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A conflict's re-fold takes back what the first fold counted: not the held records, which
    # it never counted (`milpa_redelivered` is a counter: it must not go down).
    def buggy(s: Any, e: Any, seq: int, auth: Any) -> Any:
        raise TypeError("a bug in the fold")

    events = [started(), turn("user", "t0"), make_event(ev.PLAN_SET, {"plan": "p"})]
    events.append(turn("user", "t1"))
    records = _records(events)
    store = InMemoryProjectionStore()
    run(ProjectionCycle(BatchFolder()).project(records[:2]), store)  # another writer's work
    monkeypatch.setitem(fold_module._HANDLERS, ev.PLAN_SET, buggy)
    stale = ProjectionCycle(BatchFolder(parked={}))
    stale.cache["s1"] = Folded(fold("s1", events[:1]), records[0].position)
    folding, committed = run(stale.project(records), store)
    assert committed.conflicts == 1 and stale.folder.parked is not None
    assert stale.folder.parked[0].position == records[2].position
    # Records 0 and 1 were applied by the other writer; 2 and 3 wait, held, counted nowhere.
    assert folding.redelivered + committed.redelivered == 2
    assert committed.redelivered >= 0
    assert store.load("s1") == fold("s1", events[:2])


def test_a_fault_found_after_a_fold_does_not_change_what_that_fold_counted() -> None:
    # A later batch's fold parks the partition at record 1 while this batch, which folded
    # records 0 to 2, waits to be committed; its commit conflicts (record 0 applied meanwhile by
    # another writer).
    events = [started(), turn("user", "t0"), turn("user", "t1")]
    records = _records(events)
    store = InMemoryProjectionStore()
    stale = ProjectionCycle(BatchFolder(parked={}))
    folding = run(stale.fold(records), store)
    assert folding.redelivered == 0 and folding.held_from == {}
    run(ProjectionCycle(BatchFolder()).project(records[:1]), store)  # another writer's work
    assert stale.folder.parked is not None
    stale.folder.parked[0] = Fault(Position(0, 1), "s2", "CorruptProjectionError", "s2: bad")
    committed = run(stale.commit(folding), store)
    assert committed.conflicts == 1
    # Only record 0 was applied before (by the other writer); 1 and 2 wait, held.
    assert folding.redelivered + committed.redelivered == 1
    assert store.load("s1") == fold("s1", events[:1])


def test_a_session_that_keeps_conflicting_gives_up_after_max_rounds() -> None:
    cycle = ProjectionCycle(BatchFolder(), max_rounds=2)
    steps = cycle.project(_records([started()]))
    with pytest.raises(ProjectionError, match="kept conflicting"):
        _script(steps, [{}, CommitResult((), ("s1",)), {}, CommitResult((), ("s1",))])


def test_records_at_or_below_the_mark_are_redelivered_and_their_decisions_returned() -> None:
    events = [started(), turn("user", "a")]
    records = _records(events)
    store = InMemoryProjectionStore()
    run(ProjectionCycle(BatchFolder()).project(records), store)
    folding, committed = run(ProjectionCycle(BatchFolder()).project(records), store)
    assert folding == Folding(tuple(records), (), redelivered=2)
    assert committed == Committed(())


def _questions_answered(count: int) -> list[Any]:
    events: list[Any] = [started()]
    for n in range(count):
        events += [ask(f"q{n}"), answer(f"q{n}", "yes")]
    return events


class _Counting(InMemoryProjectionStore):
    """Counts the decision history reads a shell makes for the cycle."""

    decision_reads: int = 0

    def facts(self, session_id: str) -> Any:
        self.decision_reads += 1
        return super().facts(session_id)


def test_a_redelivery_returns_every_decision_also_those_older_than_the_state_keeps() -> None:
    # A worker stopped after Redis took the batch and before its decisions were published: the
    # next one must publish all of them, not only the RECENT_DECISIONS the state keeps.
    count = RECENT_DECISIONS + 5
    records = _records(_questions_answered(count))
    store = _Counting()
    first, _ = run(ProjectionCycle(BatchFolder()).project(records), store)
    made = [d for u in first.updates for d, _ in u.decisions]
    assert len(made) == count
    assert len(store.load("s1").decisions) == RECENT_DECISIONS  # type: ignore[union-attr]

    requests, folding = _script(
        ProjectionCycle(BatchFolder()).fold(records),
        [store.folded(("s1",)), {"s1": store.facts("s1").decisions}],
    )
    assert requests == [Read(("s1",)), ReadDecisions(("s1",), (len(records),))]
    assert [d for _, d in folding.again] == made  # every one, in seq order
    answered = [c for c in folding.reasked if c.status is not QuestionStatus.OPEN]
    assert [c.question_id for c in answered] == [f"q{n}" for n in range(count)]
    assert folding.updates == ()

    reads = store.decision_reads
    folding, _ = run(ProjectionCycle(BatchFolder()).project(records), store)  # through the shell
    assert [d for _, d in folding.again] == made
    assert store.decision_reads == reads + 1


def test_a_history_left_out_of_the_answer_holds_the_session_s_records_or_is_asked_again() -> None:
    # A parking worker leaves a history that does not decode out of its answer, having put the
    # session in `unreadable`: its records are held (their partition parks), not skipped as
    # redelivered. One left out and let go of meanwhile (it reads now) is asked for again, so
    # its decisions are published before its offsets are committed.
    count = RECENT_DECISIONS + 5
    records = _records(_questions_answered(count))
    store = _Counting()
    run(ProjectionCycle(BatchFolder()).project(records), store)
    history = {"s1": store.facts("s1").decisions}
    asked = ReadDecisions(("s1",), (len(records),))

    folder = BatchFolder(parked={})
    cycle = ProjectionCycle(folder)
    steps = cycle.fold(records)
    assert steps.send(None) == Read(("s1",))
    assert steps.send(store.folded(("s1",))) == asked
    folder.unreadable["s1"] = "s1: the stored decisions cannot be read"  # as the worker does
    requests, folding = _script(steps, [], reply={})  # without s1: no request follows
    assert requests == []
    assert folding.again == () and folding.reasked == () and folding.redelivered == 0
    assert folder.parked == {0: Fault(Position(0, 0), "s1", UNREADABLE, ANY, unreadable=True)}
    assert folder.held == len(records)

    folder = BatchFolder(parked={})
    steps = ProjectionCycle(folder).fold(records)
    steps.send(None)
    assert steps.send(store.folded(("s1",))) == asked
    requests, folding = _script(steps, [history], reply={})  # left out, not (or no longer)
    # put in `unreadable`
    assert requests == [asked]  # asked again
    assert [d.event_id for _, d in folding.again] == [d.event_id for d in history["s1"]]
    assert folder.parked == {} and folding.redelivered == len(records)


def test_a_redelivery_behind_a_park_publishes_its_decisions_once_read_again() -> None:
    # Partition 0 parked at offset 4 (another session's record the fold raised on). Records
    # already applied at or after it are read again from there once the partition is let go:
    # their decisions are published then, not now as well; those before it, now.
    events = [
        started(session_id="a"),
        ask("qa", session_id="a"),
        answer("qa", "yes", session_id="a"),
    ]
    events += [
        started(session_id="b"),
        ask("qb", session_id="b"),
        answer("qb", "yes", session_id="b"),
    ]
    records = _records(events)
    store = InMemoryProjectionStore()
    first, _ = run(ProjectionCycle(BatchFolder()).project(records), store)
    assert {u.session_id for u in first.updates if u.decisions} == {"a", "b"}

    fault = Fault(Position(0, 4), "z", "ValueError", "ValueError('boom')")
    folder = BatchFolder(parked={0: fault})
    folding, _ = run(ProjectionCycle(folder).project(records), store)
    assert [sid for sid, _ in folding.again] == ["a"]
    assert {c.question_id for c in folding.reasked} == {"qa"}
    assert folding.redelivered == len(records)  # skipped as applied, not held

    let_go, _ = run(ProjectionCycle(BatchFolder(parked={})).project(records[4:]), store)
    assert [sid for sid, _ in let_go.again] == ["b"]  # read again: published now


def test_a_redelivered_tail_of_a_long_session_reads_only_the_decisions_it_can_have_made() -> None:
    # Long: many more decisions than the state keeps. Redelivered: the last records only (the
    # offsets committed before them). What it asks for is bounded by the redelivery, not the age.
    count = 5 * RECENT_DECISIONS
    records = _records(_questions_answered(count))
    store = InMemoryProjectionStore()
    first, _ = run(ProjectionCycle(BatchFolder()).project(records), store)
    made = {d.event_id: d for u in first.updates for d, _ in u.decisions}
    tail = records[-(RECENT_DECISIONS + 3) * 2 :]  # three answers beyond what the state keeps
    history = store.facts("s1").decisions
    requests, folding = _script(
        ProjectionCycle(BatchFolder()).fold(tail),
        [store.folded(("s1",)), {"s1": history[-len(tail) :]}],
    )
    assert requests[-1] == ReadDecisions(("s1",), (len(tail),))
    assert len(tail) < len(history)
    assert [d for _, d in folding.again] == [
        made[r.event.event_id] for r in tail if r.event.type == ev.QUESTION_ANSWERED
    ]
    # The store's latest decisions, as many as asked: the same through the shell.
    again, _ = run(ProjectionCycle(BatchFolder()).project(tail), store)
    assert again.again == folding.again


def test_a_commit_while_a_slice_waits_for_decisions_history_does_not_leave_a_stale_state() -> None:
    # Batch N+1 is folded while N is committed: N's conflict re-reads a session N+1 folded onto,
    # during N+1's history read. N+1 must not commit what it folded onto N's stale state.
    store = InMemoryProjectionStore()
    many = _records(
        [e for n in range(RECENT_DECISIONS + 4) for e in (ask(f"q{n}"), answer(f"q{n}", "y"))],
        partition=1,
        start=1,
    )
    many = [Record(started(session_id="s2"), Position(1, 0))] + [
        Record(replace(r.event, session_id="s2"), r.position) for r in many
    ]
    run(ProjectionCycle(BatchFolder()).project(many), store)
    first, second = turn("user", "A", session_id="s1"), turn("user", "B", session_id="s1")
    begun = started(session_id="s1")
    run(
        ProjectionCycle(BatchFolder()).project(
            [Record(begun, Position(0, 0)), Record(first, Position(0, 1))]
        ),
        store,
    )  # another writer got there first
    cycle = ProjectionCycle(BatchFolder())
    stale = fold("s1", [started(goal="STALE", session_id="s1")])
    cycle.cache["s1"] = Folded(stale, Position(0, 0))  # read while that write was in flight
    cycle.cache["s2"] = store.folded(("s2",))["s2"]
    batch_n = run(cycle.fold([Record(first, Position(0, 1))]), store)
    steps = cycle.fold([Record(second, Position(0, 2)), many[4]])  # N+1: q1 answered again
    reply: Any = None
    waited = False
    while True:
        try:
            request = steps.send(reply)
        except StopIteration as done:
            batch_n1 = done.value
            break
        if type(request) is ReadDecisions:
            waited = True
            run(cycle.commit(batch_n), store)  # N conflicts on s1 and re-folds it meanwhile
            reply = {sid: store.facts(sid).decisions for sid in request.session_ids}
        else:
            reply = run(_one(request), store)
    assert waited
    run(cycle.commit(batch_n1), store)
    stored = store.load("s1")
    assert stored is not None and stored.goal == "g"
    assert [t.content for t in stored.turns] == ["A", "B"]
    assert [d.question_id for _, d in batch_n1.again] == ["q1"]


def _one(request: Any) -> Steps[Any]:
    """A cycle of one request, for `run` to answer."""
    return (yield request)


def test_a_redelivery_of_a_session_with_few_decisions_reads_no_history() -> None:
    records = _records(_questions_answered(RECENT_DECISIONS - 1))
    store = _Counting()
    run(ProjectionCycle(BatchFolder()).project(records), store)
    reads = store.decision_reads
    folding, _ = run(ProjectionCycle(BatchFolder()).project(records), store)
    assert len(folding.again) == RECENT_DECISIONS - 1
    assert store.decision_reads == reads


def test_a_record_of_a_session_projected_from_another_partition_is_foreign() -> None:
    store = InMemoryProjectionStore()
    run(ProjectionCycle(BatchFolder()).project(_records([started()], partition=0)), store)
    stray = _records([turn("user", "x")], partition=3, start=7)
    folding, committed = run(ProjectionCycle(BatchFolder()).project(stray), store)
    assert folding.foreign == tuple(stray)
    assert folding.records == ()
    assert committed.updates == ()


def test_keep_false_forgets_after_each_batch_and_a_limit_trims_the_older_half() -> None:
    batch = _records([started(session_id=f"s{i}") for i in range(4)])
    store = InMemoryProjectionStore()
    once = ProjectionCycle(BatchFolder(), keep=False)
    run(once.project(batch[:2]), store)
    assert once.cache == {}
    bounded = ProjectionCycle(BatchFolder(), cache_limit=3)
    run(bounded.project(batch), store.__class__())
    assert list(bounded.cache) == ["s2", "s3"]


def test_states_reads_only_what_it_does_not_know() -> None:
    cycle = ProjectionCycle(BatchFolder())
    known = Folded(fold("a", [started(session_id="a")]), Position(0, 0))
    cycle.cache["a"] = known
    requests, found = _script(cycle.states(["a", "b"]), [{}])
    assert requests == [Read(("b",))]
    assert found == {"a": known}


# -- a batch folded while the one before is committed (the worker's pipeline) -------------------


class _Driver:
    """Answers a cycle's requests from an in-memory store, one request at a time if asked."""

    def __init__(self, store: InMemoryProjectionStore) -> None:
        self.store = store

    def answer(self, request: Any) -> Any:
        if type(request) is Read:
            return self.store.folded(request.session_ids)
        if type(request) is Write:
            return self.store.commit(request.updates)
        return None

    def finish(self, steps: Steps[Any], reply: Any = None) -> Any:
        """Run to the end, answering every request."""
        while True:
            try:
                request = steps.send(reply)
            except StopIteration as done:
                return done.value
            reply = self.answer(request)

    def until_write(self, steps: Steps[Any]) -> Write:
        """Run until it asks to write; that request is returned unanswered (a write in flight)."""
        reply: Any = None
        while True:
            request = steps.send(reply)
            if type(request) is Write:
                return request
            reply = self.answer(request)


def test_a_session_trimmed_while_its_update_is_in_flight_is_not_committed_without_it() -> None:
    """The cache trimmed a session whose next batch was folded but not committed; the batch after
    read it from the store before that commit landed. Nothing may be committed that lacks the
    events in flight, however the later batches' marks line up."""
    events = [
        started(session_id="s1"),
        started(session_id="f1"),
        started(session_id="f2"),
        *[turn("user", x, session_id="s1") for x in "abc"],
    ]
    rec = _records(events)
    store = InMemoryProjectionStore()
    go = _Driver(store)
    cycle = ProjectionCycle(BatchFolder(), cache_limit=2)
    k0 = go.finish(cycle.fold(rec[0:3]))
    c0 = cycle.commit(k0)
    w0 = go.until_write(c0)
    k1 = go.finish(cycle.fold(rec[3:4]))  # folded while batch 0 is committed
    go.finish(c0, go.answer(w0))  # batch 0 lands; the cache is over its limit and trimmed
    c1 = cycle.commit(k1)
    w1 = go.until_write(c1)
    k2 = go.finish(cycle.fold(rec[4:5]))
    go.finish(c1, go.answer(w1))
    c2 = cycle.commit(k2)
    w2 = go.until_write(c2)
    k3 = go.finish(cycle.fold(rec[5:6]))
    go.finish(c2, go.answer(w2))
    go.finish(cycle.commit(k3))
    stored = store.folded(["s1"])["s1"]
    assert stored.mark == rec[5].position
    assert stored.state == fold("s1", [events[0], *events[3:]])


def test_a_batch_folded_on_a_state_its_predecessor_found_stale_is_folded_again() -> None:
    """Another writer moved a session; the batch being committed conflicted and re-read it while
    the next batch read it too. Every later commit still equals the pure fold."""
    events = [started(session_id="s1"), *[turn("user", x, session_id="s1") for x in "abcd"]]
    rec = _records(events)
    store = InMemoryProjectionStore()
    go = _Driver(store)
    go.finish(ProjectionCycle(BatchFolder()).project(rec[:2]))  # a stale owner applied 0..1
    cycle = ProjectionCycle(BatchFolder())
    cycle.cache["s1"] = Folded(fold("s1", events[:1]), rec[0].position)  # it knew s1 at 0
    kn = go.finish(cycle.fold(rec[1:3]))
    cn = cycle.commit(kn)
    first_write = go.until_write(cn)
    reread = cn.send(go.answer(first_write))  # a conflict: s1 is read again
    assert type(reread) is Read
    kn1 = cycle.fold(rec[3:4])
    next_read = kn1.send(None)  # the next batch misses s1 too
    assert type(next_read) is Read
    next_reply = go.answer(next_read)  # both reads see the stale owner's state
    refold_write = cn.send(go.answer(reread))
    with pytest.raises(StopIteration) as folded_next:
        kn1.send(next_reply)
    go.finish(cn, go.answer(refold_write))
    cn1 = cycle.commit(folded_next.value.value)
    w1 = go.until_write(cn1)
    kn2 = go.finish(cycle.fold(rec[4:5]))
    go.finish(cn1, go.answer(w1))
    go.finish(cycle.commit(kn2))
    stored = store.folded(["s1"])["s1"]
    assert stored.mark == rec[4].position
    assert stored.state == fold("s1", events)


def test_a_history_read_older_than_the_state_loses_none_of_the_state_s_decisions() -> None:
    count = RECENT_DECISIONS + 4
    records = _records(_questions_answered(count))
    store = InMemoryProjectionStore()
    run(ProjectionCycle(BatchFolder()).project(records), store)
    history = store.facts("s1").decisions
    answered = [r for r in records if r.event.type == ev.QUESTION_ANSWERED]
    redelivered = [answered[1], answered[-1]]  # one only the history holds, one the state holds
    requests, folding = _script(
        ProjectionCycle(BatchFolder()).fold(redelivered),
        [store.folded(("s1",)), {"s1": history[:-3]}],  # read before the last commits landed
    )
    assert type(requests[-1]) is ReadDecisions
    assert [d.question_id for _, d in folding.again] == ["q1", f"q{count - 1}"]


def test_a_state_read_again_with_a_later_mark_during_a_history_read_reads_further_back() -> None:
    # The latest decisions a redelivery can need are counted from the state's mark. Another
    # writer moved it on while the history was read (a conflict's re-read replaced the state):
    # counted again from the new mark, more of the history is read.
    count = 200
    records = _records(_questions_answered(count))
    store = InMemoryProjectionStore()
    first, _ = run(ProjectionCycle(BatchFolder()).project(records), store)
    made = {d.event_id: d for u in first.updates for d, _ in u.decisions}
    at_40 = run(ProjectionCycle(BatchFolder()).project(records[:41]), InMemoryProjectionStore())
    cycle = ProjectionCycle(BatchFolder())
    cycle.cache["s1"] = Folded(at_40[0].updates[0].state, records[40].position)
    chunk = records[1:7]  # q0..q2 asked and answered, redelivered
    steps = cycle.fold(chunk)
    asked: list[ReadDecisions] = []
    reply: Any = None
    while True:
        try:
            request = steps.send(reply)
        except StopIteration as done:
            folding = done.value
            break
        assert type(request) is ReadDecisions
        asked.append(request)
        cycle.cache["s1"] = store.folded(("s1",))["s1"]  # meanwhile: the state at offset 400
        reply = {"s1": store.facts("s1").decisions[-request.latest[0] :]}
    assert [r.latest for r in asked] == [(40,), (400,)]
    assert [d for _, d in folding.again] == [
        made[r.event.event_id] for r in chunk if r.event.type == ev.QUESTION_ANSWERED
    ]


# -- a session whose projection expired (retention): handled, not committed ---------------------


def test_an_update_the_store_reports_expired_is_not_committed_and_leaves_the_cache() -> None:
    events = [
        started(session_id="x"),
        ask("q1", session_id="x"),
        answer("q1", "yes", session_id="x"),
        started(session_id="b"),
    ]
    cycle = ProjectionCycle(BatchFolder())
    requests, (folding, committed) = _script(
        cycle.project(_records(events)), [{}, CommitResult(("b",), (), ("x",))]
    )
    assert [type(r) for r in requests] == [Read, Write]  # done with: not folded again
    lost = next(u for u in folding.updates if u.session_id == "x")
    assert lost.decisions  # what would have been published as decided
    assert [u.session_id for u in committed.updates] == ["b"]
    assert committed.expired == ("x",) and committed.conflicts == 0
    assert "x" not in cycle.cache and "b" in cycle.cache
    # The next event of x reads the store again.
    later, _ = _script(
        cycle.project(_records([turn("user", "hi", session_id="x")], start=4)),
        [{}, CommitResult((), (), ("x",))],
    )
    assert later[0] == Read(("x",))


def test_an_expired_session_among_conflicts_is_not_committed_while_the_conflict_is() -> None:
    events = [started(session_id="x"), started(session_id="c")]
    cycle = ProjectionCycle(BatchFolder())
    requests, (_, committed) = _script(
        cycle.project(_records(events)),
        [{}, CommitResult((), ("c",), ("x",)), {}, CommitResult(("c",))],
    )
    assert requests[2] == Read(("c",))  # only the conflict is read and folded again
    assert [u.session_id for u in requests[3].updates] == ["c"]
    assert [u.session_id for u in committed.updates] == ["c"]
    assert committed.expired == ("x",)


def test_a_batch_folded_on_an_expired_update_s_state_is_folded_again_from_the_store() -> None:
    """The next batch was folded onto the state of an update that then wrote nothing: it is
    folded again from what the store holds before it is written (here: nothing, from empty)."""
    events = [started(session_id="x"), turn("user", "a", session_id="x")]
    rec = _records(events)
    cycle = ProjectionCycle(BatchFolder())
    _, first = _script(cycle.fold(rec[:1]), [{}])
    _, second = _script(cycle.fold(rec[1:]), [])  # folded onto the first's state, uncommitted
    assert second.updates[0].base == rec[0].position
    _script(cycle.commit(first), [CommitResult((), (), ("x",))])
    requests, committed = _script(cycle.commit(second), [{}, CommitResult((), (), ("x",))])
    assert requests[0] == Read(("x",))
    assert requests[1].updates[0].base is None  # folded from the store's (absent) state
    assert committed.updates == () and committed.expired == ("x",)


def test_the_in_memory_store_s_expired_session_is_committed_by_no_projector() -> None:
    store = InMemoryProjectionStore()
    ended = [started(session_id="x"), make_event(ev.ENDED, {"because": "done"}, session_id="x")]
    store.retention = Retention(1000)
    run(ProjectionCycle(BatchFolder()).project(_records(ended)), store)
    assert store.expire_due(ended[-1].occurred_at + timedelta(seconds=1)) == ["x"]
    reused = [
        started(session_id="x"),
        ask("q1", session_id="x"),
        answer("q1", "yes", session_id="x"),
    ]
    cycle = ProjectionCycle(BatchFolder())
    _, committed = run(cycle.project(_records(reused, start=2)), store)
    assert committed.updates == () and committed.expired == ("x",)
    assert "x" not in cycle.cache and store.load("x") is None
