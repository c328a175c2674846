"""A rebalance storm: workers go 1 → 4 → 2 while a producer keeps appending (#16 item 5).

A paced producer appends many sessions' events (every kind of event, questions answered, closed,
left open, rejections; and sessions whose questions have real deadlines a few seconds away, which
the workers' schedulers must close whoever owns their partition by then). Meanwhile one worker
starts, three more join, then one leaves gracefully (SIGTERM) and one is killed with -9 with an
applied but uncommitted tail, so partitions are revoked and reassigned several times mid-stream
and records are delivered again to their new owners. When the producer has finished and the two
workers left caught up, the topic is read back: every session's projection in Redis equals the
pure fold of its events there (state, history, facts, timeline), every counter, the fleet counts
and the waiting index are what one application of each event leaves, and every question change
and decision was published.

Why a double count cannot hide: the counters are compared hash by hash with the sum of what each
step of the fold adds (`expected_counters`), the folded-events counter included (one per record
of the topic), and history, facts and timeline are compared as whole lists. A redelivered record
folded again adds one to the folded-events counter even where the fold's dedupe window makes it a
no-op (with the marks' skip of redelivered records removed, this test fails on that counter); one
applied again past the window adds its pause, turn, fact or timeline entry twice. A lost event
leaves a mark short of its session's last position (the wait fails) or a state unequal to the
fold. What this storm does not produce is a stale owner writing after its partition moved (a
revoked worker finishes its batch before it lets go, a killed one writes nothing more): the
commit's compare-and-set is covered by the stale-owner tests in `test_scale_and_crash.py`.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from bench.infra import trusted_keys_dir
from bench.workload import Console
from deploy.harness import Proc, wait_for
from milpa_sessions.settings import Settings
from producers.kafka_log import KafkaEventLog
from producers.memory import InMemoryEventLog
from producers.store import SessionStore, deadline_in
from projections.memory import InMemoryProjectionStore
from projections.redis_store import RedisProjectionStore
from schemas.events import Event
from session_model.policy import (
    APPROVAL,
    SIGNATURE,
    permission_question,
    signature_question,
    target_question,
)
from session_model.principal import Principal
from session_model.session import Question
from tests.integration.conftest import PacedProducer, committed_offsets, with_keys
from tests.integration.expected import (
    decided,
    expected_projections,
    waiting_index,
)
from tests.integration.test_scale_and_crash import (
    FAST_GROUP_ENV,
    assert_counts_are_exact,
    assert_equals_the_fold,
    decisions_in,
    events_in,
    generate,
    group_assignment,
    highest_marks,
    ids_by_session,
    joins,
    records_in,
    wait_for_all,
)
from tests.unit.builders import OPERATOR

pytestmark = pytest.mark.integration

SESSIONS = 400  # scripted sessions: about 8,000 events
# Sessions whose question has a real deadline; the odd ones are answered in time (half of them a
# signature question, answered by the operator's approval), the even ones left to expire.
TIMED = 48
PRODUCE_S = 45.0  # the producer spreads the events over this long: the storm falls mid-stream
SCHEDULER = "milpa-scheduler"  # the producer name of the workers' closings


def _timed_question(j: int, expires_at: str) -> Question:
    kind = j % 4
    if kind == 0:
        return permission_question(f"ship-{j}", {"n": j}, expires_at=expires_at)
    if kind == 1:
        return signature_question(f"tag-{j}", {"v": j}, expires_at=expires_at)
    if kind == 2:
        return target_question(f"rm-{j}", f"/srv/{j}", f"Remove /srv/{j}?", expires_at=expires_at)
    return Question(
        id=f"q{j}", question=f"Go on with {j}?", options=("yes", "no"), expires_at=expires_at
    )


def workload(start: datetime) -> tuple[list[Event], list[str]]:
    """The scripted sessions with `TIMED` short sessions spliced in along the stream.

    Each timed session starts, turns and asks a question whose deadline is a few seconds after
    the ask is sent (by a `PacedProducer` over `PRODUCE_S` from `start`); the odd ones are
    answered well before it (a signature question by the operator's approval, through an
    operator's `Console`: it stands where the workers trust `OPERATOR`), the even ones are left
    to the workers' schedulers. Returns the events in the order to append and the ids of the
    sessions left to expire.
    """
    _, scripted = generate(SESSIONS, prefix="r", group=100)
    ids = itertools.count()

    def now() -> datetime:
        return datetime.now(UTC)

    def new_id() -> str:
        return f"t{next(ids):08d}"

    collecting = InMemoryEventLog()
    store = SessionStore(
        collecting,
        InMemoryProjectionStore(),
        producer="it-agent",
        checks=False,
        clock=now,
        new_id=new_id,
    )
    console = Console(collecting, OPERATOR, producer="it-console", clock=now, new_id=new_id)
    count = len(scripted) + 3 * TIMED + TIMED // 2

    def sent_at(index: int) -> datetime:
        return start + timedelta(seconds=PacedProducer.sent_after(index, count, PRODUCE_S))

    every = len(scripted) // (TIMED + 1)
    answers: dict[int, tuple[str, Question]] = {}  # index in `scripted` -> session, question
    left_open: list[str] = []
    out: list[Event] = []

    def take(write: Callable[[], object]) -> None:
        first = len(collecting.records)
        write()
        out.extend(r.event for r in collecting.records[first:])

    for i, event in enumerate(scripted):
        j, at = divmod(i, every)
        if at == 0 and 0 < j <= TIMED:
            sid = f"timed{j:03d}"
            take(lambda sid=sid: store.start(sid, f"timed goal {sid}", mode="ask"))
            take(lambda sid=sid: store.record_turn(sid, "user", "ask me"))
            window = 12.0 if j % 2 else 2.0  # the answer comes ~1 s after the ask
            question = _timed_question(j, deadline_in(sent_at(len(out)), window))
            take(lambda sid=sid, q=question: store.ask(sid, q))
            if j % 2:
                answers[i + 2 * PacedProducer.CHUNK] = (sid, question)
            else:
                left_open.append(sid)
        if i in answers:
            sid, asked = answers.pop(i)
            by = Principal(f"actor:member:{i % 5}")
            if asked.reason == SIGNATURE:
                take(lambda sid=sid, q=asked, by=by: console.approve(sid, q.id, by))
            else:
                take(lambda sid=sid, q=asked, by=by: store.answer(sid, q.id, q.options[0], by))
        out.append(event)
    assert not answers and len(out) == count, (answers, len(out), count)
    return out, left_open


@dataclass(frozen=True)
class Phase:
    """The group as the coordinator described it once stable: which worker held what."""

    name: str
    owners: dict[str, set[int]]  # worker name -> partitions
    acked: int  # events the broker had acknowledged by then
    at: float  # monotonic time


def _stable_phase(
    settings: Settings,
    workers: Sequence[Proc],
    name: str,
    producer: PacedProducer,
    *,
    alive: Sequence[Proc],
    timeout: float = 40.0,
) -> Phase:
    """Wait until exactly `workers` form the stable group and hold all six partitions.

    Not necessarily each of them: Faust's assignor (one standby replica, its default) caps a
    client at ceil(6/n) partitions and keeps what clients held, so a fourth worker joining three
    that hold two each gets none until the next rebalance.
    """
    found: dict[str, set[int]] = {}

    def formed() -> bool:
        members = group_assignment(settings)  # member id -> partitions ({} unless stable)
        worker_of = {m: w.name for w in workers for _, m in joins(w.log())}
        if sorted(worker_of.get(m, "?") for m in members) != sorted(w.name for w in workers):
            return False  # not each worker once, or a member of none (a dead one still in)
        if sorted(p for parts in members.values() for p in parts) != list(range(6)):
            return False
        found.update({w.name: set() for w in workers})
        for m, parts in members.items():
            found[worker_of[m]] = parts
        return True

    wait_for(formed, timeout=timeout, what=f"the group of {name}", interval=0.3, procs=alive)
    return Phase(name, found, producer.acked(), time.monotonic())


def _owner_of(phase: Phase) -> dict[int, str]:
    return {p: w for w, parts in phase.owners.items() for p in parts}


@pytest.mark.fault_load
def test_a_rebalance_storm_mid_stream_loses_and_counts_nothing_twice(  # noqa: PLR0917
    settings: Settings,
    kafka_log: KafkaEventLog,
    projections: RedisProjectionStore,
    start_worker: Any,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    tmp_path: Path,
) -> None:
    began = time.monotonic()
    # kafka-python cannot read the metadata of Faust's assignor and says so at every describe.
    caplog.set_level(logging.ERROR, logger="kafka.admin._groups")
    for name, value in FAST_GROUP_ENV.items():  # a killed member leaves after 6 s, not 60
        monkeypatch.setenv(name, value)
    # Offsets are committed rarely: the killed worker leaves an applied, uncommitted tail, and
    # the partitions a rebalance moves are read again from behind what Redis holds. The workers
    # trust the operator: its signed acts stand, the approvals of signature questions among them.
    trusted = OPERATOR.trusted_keys()
    s = with_keys(
        settings,
        commit_interval=10.0,
        commit_every=1_000_000,
        trusted_keys_dir=trusted_keys_dir(tmp_path, OPERATOR),
    )

    events, left_open = workload(datetime.now(UTC) + timedelta(seconds=1.0))  # ~ the first send
    workers: list[Proc] = []

    def started() -> Proc:
        worker: Proc = start_worker(s)
        worker.name = f"worker-{len(workers) + 1}"
        workers.append(worker)
        return worker

    sids = sorted({e.session_id for e in events})

    def progressed(worker: Proc, phase: Phase, alive: Sequence[Proc]) -> None:
        """Wait until `worker` applied a batch of the partitions it holds in `phase`."""
        mine = phase.owners[worker.name]
        before = highest_marks(projections, sids)

        def moved() -> bool:
            now = highest_marks(projections, sids)
            return any(now.get(p, -1) > before.get(p, -1) for p in mine)

        what = f"{worker.name} folding its partitions {sorted(mine)}"
        wait_for(moved, timeout=30, what=what, procs=alive)

    first = started()
    producer = PacedProducer(kafka_log, events, PRODUCE_S)
    producer.start()
    phases: list[Phase] = []
    try:
        phases.append(_stable_phase(s, [first], "one worker", producer, alive=workers))
        # Three more start while the first folds alone (they take seconds to join).
        second, third, fourth = started(), started(), started()
        phases.append(
            _stable_phase(s, workers, "four workers", producer, alive=workers, timeout=60)
        )
        # One of the three that joined, holding partitions, leaves gracefully (SIGTERM): it
        # finishes its batch and commits before it lets go.
        leaving = next(w for w in (second, third, fourth) if phases[-1].owners[w.name])
        progressed(leaving, phases[-1], workers)
        stopping_at = producer.acked()
        leaving.stop()
        graceful = leaving.proc.returncode
        remaining = [w for w in workers if w is not leaving]
        phases.append(_stable_phase(s, remaining, "three workers", producer, alive=remaining))

        # The first worker (or, if the assignor left it none, another holding partitions) is
        # killed while it folds: Redis is ahead of what it committed.
        holding = [w for w in remaining if phases[-1].owners[w.name]]
        victim = first if first in holding else holding[0]
        progressed(victim, phases[-1], remaining)
        victim_partitions = phases[-1].owners[victim.name]
        victim.kill9()
        killed_at, killed = producer.acked(), time.monotonic()
        committed = committed_offsets(s)
        applied = highest_marks(projections, sids)
        tail = {p for p in victim_partitions if committed.get(p, 0) <= applied.get(p, -1)}
        remaining = [w for w in remaining if w is not victim]
        phases.append(_stable_phase(s, remaining, "two workers", producer, alive=remaining))
        producer.join(timeout=PRODUCE_S + 60)
        assert not producer.is_alive(), "the producer did not finish"
        assert producer.error is None, repr(producer.error)
    finally:
        producer.join(timeout=5)
    storm_s = time.monotonic() - began

    # The storm happened mid-stream, and every worker owned partitions at some point.
    print(  # pytest -rA shows it
        "acknowledged, seconds when each group was stable: "
        + ", ".join(f"{p.name} {p.acked} {p.at - began:.1f}s" for p in phases)
        + f"; SIGTERM at {stopping_at}, kill -9 at {killed_at} ({killed - began:.1f}s) of "
        f"{len(events)}; partitions redelivered after the kill {sorted(tail)}"
    )
    assert stopping_at < killed_at < len(events), (stopping_at, killed_at)
    assert graceful == 0, f"{leaving.name} did not stop on SIGTERM\n{leaving.log()[-3000:]}"
    assert tail, f"no uncommitted tail at the kill: committed {committed}, applied {applied}"
    held = {w for phase in phases for w, parts in phase.owners.items() if parts}
    assert held == {w.name for w in workers}, phases
    one, four, three, two = (_owner_of(p) for p in phases)
    assert set(one.values()) == {first.name}
    assert one != four != three != two, phases  # each rebalance moved partitions
    generations = {g for w in workers for g, _ in joins(w.log())}
    assert len(generations) >= 4, generations
    print(
        f"storm over after {storm_s:.1f}s; generations {sorted(generations)}; "
        f"SIGTERM: {leaving.name}, kill -9: {victim.name}; partitions per worker: "
        + "; ".join(f"{p.name} {p.owners}" for p in phases)
    )

    failed = [(e, f.exception) for e, f in producer.futures if not f.succeeded()]
    assert not failed, f"{len(failed)} appends failed, e.g. {failed[:3]}"

    # The schedulers close the windows left open, whoever owns their partitions now: wait
    # until no question waits with a deadline that is not the generator's, decades away.
    def closed_in_time() -> bool:
        soon = (time.time() + 86400) * 1000
        return not any(w.deadline_ms and w.deadline_ms < soon for w in waiting_index(projections))

    wait_for(closed_in_time, timeout=30, what="every window closed", procs=remaining)
    # Read the topic back and wait for the workers to reach its end; a closing a scheduler
    # appended meanwhile (a repeat after a rebalance) makes the topic longer: read it again.
    for _ in range(5):
        in_topic, last = events_in(s)
        wait_for_all(projections, last, timeout=60, why="after the storm", workers=remaining)
        if records_in(s, s.events_topic) == len(in_topic):
            break
    else:
        pytest.fail("the events topic kept growing after the producer finished")

    # The topic holds what the producer sent, each session's in order, and the closings.
    ours = [e for e in in_topic if e.producer != SCHEDULER]
    assert ids_by_session(ours) == ids_by_session(events)
    closings = [e.session_id for e in in_topic if e.producer == SCHEDULER]
    closed = set(closings)
    assert closed >= set(left_open), sorted(set(left_open) - closed)
    # Any other closing is a scheduler's for an odd one whose answer, already in the log, it had
    # not seen folded at the deadline (its partition moving then): a no-op in the fold, whose
    # decisions are counted exactly below.
    late_closings = closed - set(left_open)
    print(
        f"{len(closings)} closings appended for {len(closed)} sessions "
        f"({len(late_closings)} after an answer)"
    )

    expected = expected_projections(in_topic, trusted)
    assert sorted(projections.ids()) == sorted(expected)
    assert_equals_the_fold(projections, expected)  # state, history, facts, timeline
    # Counters, fleet, waiting: each step once; every question change published, none invented.
    assert_counts_are_exact(s, projections, expected)
    # Exactly what the timed sessions decided: the even ones expired, the odd ones answered in
    # time (a yes, or the operator's approval of the call), nothing of theirs refused.
    timed = sorted(sid for sid in expected if sid.startswith("timed"))
    assert len(timed) == TIMED
    outcomes: dict[tuple[str | None, str, bool], list[str]] = {}
    for sid in timed:
        state = expected[sid].state
        assert not state.rejection_counts(), (sid, state.rejections)
        (decision,) = state.decisions
        expired = decision.expired_at is not None
        outcomes.setdefault((decision.reason, decision.answer, expired), []).append(sid)
        approved = decision.reason == SIGNATURE and not expired
        assert len(state.approvals) == int(approved), (sid, state.approvals)
    assert {k: len(v) for k, v in outcomes.items()} == {
        ("permission", "", True): TIMED // 4,  # j % 4 == 0: expired
        ("target_not_named", "", True): TIMED // 4,  # j % 4 == 2: expired
        (SIGNATURE, APPROVAL, False): TIMED // 4,  # j % 4 == 1: approved in time
        (None, "yes", False): TIMED // 4,  # j % 4 == 3: answered in time
    }
    expired_ones = outcomes[("permission", "", True)] + outcomes[("target_not_named", "", True)]
    assert sorted(expired_ones) == sorted(left_open)
    answered = outcomes[(SIGNATURE, APPROVAL, False)] + outcomes[(None, "yes", False)]
    assert late_closings <= set(answered), sorted(late_closings - set(answered))
    reasons = {r for exp in expected.values() for r in exp.state.pauses}
    assert reasons == {"permission", "signature", "target_not_named", "unspecified"}
    assert decisions_in(s) == set(decided(expected))  # each at least once, none invented
    for w in remaining:
        assert w.alive(), w.log()[-3000:]
    print(f"whole test {time.monotonic() - began:.1f}s")
