"""Deterministic, realistic session workloads built with the product's own writer API.

Events are made by a `SessionStore` over a collecting log with `checks=False` (no reads), so every
payload is exactly what an agent would append; nothing is sent while generating. The one
exception is the answer to a signature question: only an operator's approval answers it, and that
approval names the asking it answers (its seq), which only a read of the session knows, so it comes
from an operator's `Console` (the writer API with its checks on, as a console uses it). Event ids
are UUID4 strings like production's; sessions are staggered like a fleet's (about `concurrency`
live at once), so any window of the stream holds every kind of event and a batch holds few events
of any one session.
"""

from __future__ import annotations

import hashlib
import itertools
import random
import uuid
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from producers.memory import InMemoryEventLog
from producers.store import SessionStore, deadline_in
from projections.memory import InMemoryProjectionStore
from projections.projector import Projector
from schemas.events import Event
from session_model.deadlines import format_instant
from session_model.partitioning import partition_for
from session_model.policy import (
    APPROVAL,
    SIGNATURE,
    permission_question,
    signature_question,
    target_question,
)
from session_model.principal import Principal
from session_model.projection import BatchFolder, Position, Record
from session_model.session import Question
from session_model.signing import Signer

_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
# The bench's operator: grants and relaxed modes are signed, as in production (the workers and
# the harness's folds trust this key). A fixed key: the workload stays deterministic.
OPERATOR = Signer(
    "bench-operator", Ed25519PrivateKey.from_private_bytes(hashlib.sha256(b"milpa bench").digest())
)
OPERATOR_KEYS = OPERATOR.trusted_keys()
FAR_FUTURE_S = 50 * 365 * 86400  # questions left open must never be closed by the scheduler


def ticking(start: datetime) -> Callable[[], datetime]:
    """A clock that advances 1 ms each time it is read (once per event a writer builds)."""
    ticks = itertools.count()
    return lambda: start + timedelta(milliseconds=next(ticks))


def writer(
    collecting: InMemoryEventLog,
    base: datetime | None = None,
    producer: str = "bench-agent",
    clock: Callable[[], datetime] | None = None,
) -> SessionStore:
    """A SessionStore that only collects, with a clock that advances 1 ms per event (`clock`: one
    shared with another writer of the same log)."""
    return SessionStore(
        collecting,
        InMemoryProjectionStore(),
        producer=producer,
        signer=OPERATOR,
        checks=False,
        clock=clock or ticking(base or datetime.now(UTC)),
    )


class Console:
    """An operator's console over a collecting log: approves signature questions as a console
    does, through `SessionStore.answer` with its checks on (the `APPROVAL` answer, carrying the
    operator key's signature over exactly the call asked about and the asking it answers).

    That answer needs the session as projected (the asking's seq), so before each answer the
    console folds the answered session's records appended since its last read, as a worker would
    have; sessions it never answers are never folded. It subscribes to `log` (to note which
    records are whose) and appends its answers there, with `clock` and `new_id` (pass the other
    writers' own, so times and ids keep one sequence).
    """

    def __init__(
        self,
        log: InMemoryEventLog,
        signer: Signer = OPERATOR,
        *,
        producer: str = "bench-console",
        clock: Callable[[], datetime] | None = None,
        new_id: Callable[[], str] = lambda: str(uuid.uuid4()),
    ) -> None:
        projections = InMemoryProjectionStore()
        self._projector = Projector(projections, BatchFolder(signer.trusted_keys()))
        self._unread: defaultdict[str, list[Record]] = defaultdict(list)
        log.subscribers.append(self._appended)
        self.store = SessionStore(
            log,
            projections,
            producer=producer,
            signer=signer,
            clock=clock or ticking(datetime.now(UTC)),
            new_id=new_id,
        )

    def _appended(self, batch: Sequence[Record]) -> None:
        for record in batch:
            self._unread[record.event.session_id].append(record)

    def approve(
        self,
        session_id: str,
        question_id: str,
        by: Principal | None = None,
        executor: str | None = None,
    ) -> Position:
        """Answer the open signature question `question_id` with the signed `APPROVAL`."""
        self._projector.project(self._unread.pop(session_id, []))
        return self.store.answer(session_id, question_id, APPROVAL, by, executor=executor)


def _question(rng: random.Random, n: int, now: datetime) -> Question:
    expires = deadline_in(now, FAR_FUTURE_S)
    kind = rng.randrange(4)
    if kind == 0:
        return permission_question(f"deploy-{n}", {"env": "prod", "n": n}, expires_at=expires)
    if kind == 1:
        return signature_question(f"sign-{n}", {"doc": f"d{n}"}, expires_at=expires)
    if kind == 2:
        return target_question(f"rm-{n}", f"/tmp/x{n}", f"Remove /tmp/x{n}?", expires_at=expires)
    return Question(id=f"q{n}", question=f"Which way, {n}?", options=("left", "right"))


def session_script(store: SessionStore, console: Console, sid: str, i: int, now: datetime) -> None:
    """Nineteen events of an agent session: turns, tools, plan, todos, a question and its answer.

    A fold that trusts `OPERATOR_KEYS` applies every one of them (none is refused): the first
    question is answered by its first option, or, a signature question (about one session in
    four), by the operator's signed approval through `console` (over `store`'s log). One session
    in ten is then left paused on a second question (deadline 50 years out), the rest end.
    """
    rng = random.Random(i)
    store.start(sid, f"goal of {sid}: migrate module {i % 97} to the new API", mode="ask")
    store.record_turn(sid, "user", f"please migrate module {i % 97}; keep the public API stable")
    store.set_plan(sid, f"plan {i}: read the module, change the calls, run the tests, report")
    store.set_todo(sid, "t1", "read the module", "in_progress")
    store.record_tool_call(
        sid, "grep", {"pattern": f"old_api_{i % 13}"}, f"{i % 7} hits in 3 files"
    )
    store.record_turn(sid, "assistant", f"found {i % 7} call sites; the plan is to change them")
    first = _question(rng, i, now)
    store.ask(sid, first)
    by = Principal(f"actor:member:{i % 13}", verified=False)
    if first.reason == SIGNATURE:
        console.approve(sid, first.id, by, executor="bench-agent")
    else:
        store.answer(sid, first.id, first.options[0], by, executor="bench-agent")
    store.grant(sid, f"deploy-{i}")
    store.record_tool_call(
        sid, "make", {"target": f"t{i}"}, "ok: 3 files changed", mutating=True, artifact=f"repo:{i}"
    )
    store.set_todo(sid, "t1", "read the module", "done")
    store.set_todo(sid, "t2", "change the call sites", "in_progress")
    store.record_turn(sid, "system", f"reminder {i}: keep the change small")
    store.record_tool_call(sid, "pytest", {"path": f"tests/m{i % 97}"}, "42 passed", ok=True)
    store.record_turn(sid, "user", "thanks, looks good")
    store.revoke(sid, f"deploy-{i}")
    store.set_mode(sid, rng.choice(["ask", "acknowledge", "auto"]))
    store.record_turn(sid, "assistant", "done: all call sites migrated, tests pass")
    if i % 10 == 6:
        store.ask(sid, _question(rng, i + 1, now))  # left open: the session stays paused
    else:
        store.end(sid, f"finished {i}")


@dataclass(frozen=True)
class Workload:
    """Events in send order and their sessions."""

    sessions: list[str]
    events: list[Event]


def long_artifact(i: int, k: int = 0) -> str | None:
    """What the `i`th event of a long agent session names: a third of the events name a file,
    half of those one of 37 the agent keeps coming back to (shifted by the session's index `k`),
    half a file it touches for the first time (a coding agent over days: the files it has
    touched keep growing; 100,000 events touch 8,371)."""
    if i % 3:
        return None
    if (i // 6) % 2:
        return f"file:src/module_{(i + k) % 37}.py"
    return f"file:src/generated/step_{i}.py"


def staggered(per_session: Sequence[Sequence[Event]], concurrency: int) -> list[Event]:
    """Merge sessions as a fleet produces them: starts staggered, about `concurrency` live at once.

    Session i's j-th event is placed at i + j * concurrency / (events − 1): each session spans
    `concurrency` session starts, so any stretch of the stream longer than that holds every kind of
    event (no phase made only of `started`), and a session's events keep their order.
    """
    keyed: list[tuple[float, int, int, Event]] = []
    for i, events in enumerate(per_session):
        span = max(len(events) - 1, 1)
        for j, e in enumerate(events):
            keyed.append((i + j * concurrency / span, i, j, e))
    keyed.sort(key=lambda k: (k[0], k[1], k[2]))
    return [k[3] for k in keyed]


def balanced_ids(count: int, tag: str, partitions: int) -> list[str]:
    """`count` session ids spread evenly over the partitions by the producer's partitioner.

    With a few thousand random keys murmur2 leaves partitions a few percent apart, which skews a
    short run with several workers; the ids are picked so every partition gets its share.
    """
    share = -(-count // partitions)
    filled = dict.fromkeys(range(partitions), 0)
    out: list[str] = []
    k = 0
    while len(out) < count:
        sid = f"{tag}-{k:07d}"
        k += 1
        p = partition_for(sid, partitions)
        if filled[p] < share:
            filled[p] += 1
            out.append(sid)
    return out


def sessions_workload(
    count: int,
    tag: str,
    concurrency: int = 1000,
    base: datetime | None = None,
    partitions: int | None = None,
) -> Workload:
    """`count` sessions of nineteen events each, about `concurrency` of them live at any point.

    With `partitions`, the sessions are spread evenly over that many partitions.
    """
    collecting = InMemoryEventLog()  # it only records (and the console notes whose each record is)
    now = base or datetime.now(UTC)
    clock = ticking(now)
    store = writer(collecting, clock=clock)
    console = Console(collecting, clock=clock)
    per_session: list[list[Event]] = []
    if partitions:
        sids = balanced_ids(count, tag, partitions)
    else:
        sids = [f"{tag}-{i:07d}" for i in range(count)]
    for i, sid in enumerate(sids):
        first = len(collecting.records)
        session_script(store, console, sid, i, now)
        per_session.append([r.event for r in collecting.records[first:]])
    return Workload(sids, staggered(per_session, concurrency))


def idle_sessions(count: int, tag: str) -> Workload:
    """Idle sessions: started, a plan and one todo; no turns, no question (the memory figure).

    Session ids are UUID-sized (36 characters) like an agent platform's, since every key name
    repeats the id.
    """
    collecting = InMemoryEventLog()  # no subscribers: it only records
    store = writer(collecting)
    sids = [str(uuid.uuid5(uuid.NAMESPACE_URL, f"{tag}/{i}")) for i in range(count)]
    for i, sid in enumerate(sids):
        store.start(sid, f"goal of session {i}: migrate module {i % 97}", mode="ask")
        store.set_plan(sid, f"plan {i}: read, change, test")
        store.set_todo(sid, "t1", "read the module", "pending")
    return Workload(sids, [r.event for r in collecting.records])


def questions(
    sids: Sequence[str], deadlines_ms: Sequence[int], producer: str = "bench-agent"
) -> list[Event]:
    """One `question_asked` per session with the given deadline (epoch ms) each."""
    collecting = InMemoryEventLog()  # no subscribers: it only records
    store = writer(collecting, producer=producer)
    for sid, ms in zip(sids, deadlines_ms, strict=True):
        expires = format_instant(_EPOCH + timedelta(milliseconds=ms))
        question = Question(
            id=f"q-{sid}",
            question="proceed?",
            options=("yes", "no"),
            expires_at=expires,
            reason="permission",
        )
        store.ask(sid, question)
    return [r.event for r in collecting.records]


def starts(sids: Sequence[str], producer: str = "bench-agent") -> list[Event]:
    """One `started` per session."""
    collecting = InMemoryEventLog()  # no subscribers: it only records
    store = writer(collecting, producer=producer)
    for sid in sids:
        store.start(sid, f"goal of {sid}", mode="ask")
    return [r.event for r in collecting.records]
