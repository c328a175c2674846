"""Folding a batch of log records into per-session updates: the pure half of the projector.

Every projection store applies an update only if the mark it was folded from is still the stored
mark (compare-and-set). With one owner per partition that always holds; when it does not (a worker
that lost its partition kept going), the store refuses the update and the projector reloads and
folds again. Records at or below a session's mark are skipped before folding, so a redelivered
batch changes nothing — except that the decisions it had made are published again
(`redelivered_decisions`): the batch may have been redelivered because its decisions never left.

A mark is a position in the session's own partition: a record from another partition is never
compared with it and never folded (`foreign_records` finds them; `session_model.intake` already
refuses a record outside the partition its key maps to).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from schemas import events as ev
from schemas.errors import CorruptProjectionError
from schemas.events import Event
from schemas.frozen import fast_init
from session_model.authority import Authority, Cutover
from session_model.fold import Kind, Step, step
from session_model.modes import Mode
from session_model.session import (
    RECENT_DECISIONS,
    Decision,
    HistoryRecord,
    Rejection,
    Session,
    Turn,
)
from session_model.signing import TrustedKeys
from session_model.timeline import TimelineEntry, translate


@fast_init
@dataclass(frozen=True, slots=True, order=True)
class Position:
    """Where a record sits in the log: partition and offset."""

    partition: int
    offset: int

    def __str__(self) -> str:
        return f"{self.partition}:{self.offset}"

    @classmethod
    def parse(cls, text: str) -> Position:
        """Read `partition:offset`."""
        partition, _, offset = text.partition(":")
        return cls(int(partition), int(offset))


@dataclass(frozen=True, slots=True)
class Expired:
    """A session's tombstone: its projection was dropped at `at`, last applied at `mark`."""

    session_id: str
    at: datetime
    mark: Position


@fast_init
@dataclass(frozen=True, slots=True)
class Folded:
    """A session's state together with the log position of the last record folded into it."""

    state: Session
    mark: Position | None = None


@fast_init
@dataclass(frozen=True, slots=True)
class Record:
    """A decoded event and where it came from."""

    event: Event
    position: Position


@fast_init
@dataclass(frozen=True, slots=True)
class SessionUpdate:
    """What a batch did to one session: new state, new mark, and what to append or index."""

    session_id: str
    base: Position | None
    mark: Position
    state: Session
    steps: tuple[Step, ...]
    first: int | None = None  # the offset of its first step (None: not known)

    @property
    def turns(self) -> tuple[Turn, ...]:
        """Turns this update appends to the session's history."""
        return tuple(s.outcome.turn for s in self.steps if s.outcome.turn is not None)

    @property
    def decisions(self) -> tuple[tuple[Decision, Step], ...]:
        """Decisions accepted in this update, with the step that made each."""
        return tuple((s.outcome.decision, s) for s in self.steps if s.outcome.decision is not None)

    @property
    def rejections(self) -> tuple[Rejection, ...]:
        """Rejections recorded in this update."""
        return tuple(s.outcome.rejection for s in self.steps if s.outcome.rejection is not None)

    @property
    def facts(self) -> tuple[HistoryRecord, ...]:
        """What this update appends to the session's history (calls, observations, executions,
        decisions, rejections), in log order."""
        out: list[HistoryRecord] = []
        for s in self.steps:
            o = s.outcome
            if o.fact is not None:
                out.append(o.fact)
            if o.decision is not None:
                out.append(o.decision)
            if o.rejection is not None:
                out.append(o.rejection)
        return tuple(out)

    @property
    def timeline(self) -> tuple[TimelineEntry, ...]:
        """Timeline entries this update appends."""
        return tuple(entry for s in self.steps for entry in translate(s))

    def count(self, kind: Kind) -> int:
        """How many of this update's events had `kind`."""
        return sum(1 for s in self.steps if s.outcome.kind is kind)


FAULT_CHARS = 500  # of a fault's description (an exception's repr may quote an agent's text)
UNREADABLE = CorruptProjectionError.__name__  # a `Fault.kind`: the session's state did not read


@dataclass(frozen=True, slots=True)
class Fault:
    """A record the fold could not take: where, and why (it raised, or the state it would have
    been folded onto could not be read)."""

    position: Position
    session_id: str
    kind: str  # the exception's type name (`UNREADABLE`: the session's stored state)
    error: str  # the exception's repr, cut to FAULT_CHARS (it may quote an agent's text)
    unreadable: bool = False  # the session's stored state could not be read (not a fold bug)


@dataclass(slots=True)
class BatchFolder:
    """Folds records in log order into updates, one per session touched.

    With `parked` set (a worker's), a record the fold raises on parks its partition: it and every
    later record of that partition are left unfolded (here and in later batches) until the
    partition is let go, and the fault is kept in `parked` (the earliest, should a record before
    it fail when folded again); the other partitions go on. Without it (a rebuild's), the error
    is raised. The exception never reaches the worker's event loop, and no worker after it ends
    on it in turn. A session in `unreadable` (what is stored of it does not decode: its state,
    or the history a redelivery's decisions are read from; the worker's reads put it there)
    parks its partition at its first record alike: folded onto nothing it would lose its past,
    skipped it would be committed unapplied, and redelivered its decisions would go unpublished.
    """

    keys: TrustedKeys = field(default_factory=TrustedKeys.none)
    start_mode: Mode = Mode.ASK  # the least supervised mode a session may start in unsigned
    cutover: Cutover = field(default_factory=Cutover)  # records before it are legacy
    parked: dict[int, Fault] | None = None  # partition -> the record it stopped at
    held: int = 0  # records left unfolded so far because their partition is parked
    unreadable: dict[str, str] = field(default_factory=dict)  # session id -> why (with `parked`)
    # partition -> the sessions in `unreadable` whose records it holds (its fault names one)
    unreadable_held: dict[int, set[str]] = field(default_factory=dict)

    def fold(
        self, known: Mapping[str, Folded], records: Iterable[Record]
    ) -> tuple[SessionUpdate, ...]:
        """Fold `records` onto the `known` states (sessions absent from it start empty)."""
        keys = Authority(self.keys, self.start_mode)
        legacy = Authority(self.keys, self.start_mode, legacy=True)
        is_legacy = self.cutover.is_legacy if self.cutover.before else None
        parked = self.parked
        unreadable = self.unreadable
        # Per session touched: [state, mark, base mark, steps, first offset]; one lookup per
        # record, and no `Folded` per record (only the batch's last state of each session
        # becomes one).
        current: dict[str, list[Any]] = {}
        for record in records:
            event = record.event
            sid = event.session_id
            entry = current.get(sid)
            if entry is None:
                if unreadable and sid in unreadable and parked is not None:
                    self._park_unreadable(parked, record.position, sid, unreadable[sid])
                    continue
                folded = known.get(sid)
                if folded is None:
                    entry = [Session(sid), None, None, [], None]
                else:
                    entry = [folded.state, folded.mark, folded.mark, [], None]
                current[sid] = entry
            mark = entry[1]
            position = record.position
            if mark is not None and (
                position.partition != mark.partition or position.offset <= mark.offset
            ):
                continue  # already applied, or from another partition (`foreign_records`)
            if (
                parked
                and (fault := parked.get(position.partition)) is not None
                and position.offset >= fault.position.offset
            ):
                # At or after the record its partition is parked at: left unfolded. (One before
                # it, folded again after a conflict or a pause, is folded as it was the first
                # time: the partition is read again from at most there.)
                self.held += 1
                continue
            trust = legacy if is_legacy and is_legacy(position.partition, position.offset) else keys
            try:
                result = step(entry[0], event, trust)
            except Exception as e:
                if parked is None:
                    raise
                # (The partition's fault, or an earlier one than its fault: only records before
                # that are still folded.)
                fault = Fault(position, sid, type(e).__name__, repr(e)[:FAULT_CHARS])
                parked[position.partition] = fault
                self.held += 1
                continue
            entry[0] = result.state
            entry[1] = position
            steps = entry[3]
            if not steps:
                entry[4] = position.offset
            steps.append(result)
        return tuple(
            SessionUpdate(sid, base, mark, state, tuple(steps), first)
            for sid, (state, mark, base, steps, first) in current.items()
            if mark is not None and steps
        )

    def behind_park(self, position: Position) -> bool:
        """Whether a record there is at or after its partition's park: the partition is read
        again from at most there once it is let go (no offset past a park is committed). (`fold`
        makes the same test inline, on its hot path.)"""
        fault = self.parked.get(position.partition) if self.parked else None
        return fault is not None and position.offset >= fault.position.offset

    def _park_unreadable(
        self, parked: dict[int, Fault], position: Position, sid: str, why: str
    ) -> None:
        """Hold a record of a session whose state cannot be read, parking its partition there
        unless it is parked already at an earlier record."""
        fault = parked.get(position.partition)
        if fault is None or position < fault.position:
            parked[position.partition] = Fault(
                position, sid, UNREADABLE, why[:FAULT_CHARS], unreadable=True
            )
        self.unreadable_held.setdefault(position.partition, set()).add(sid)
        self.held += 1


def foreign_records(known: Mapping[str, Folded], records: Iterable[Record]) -> tuple[Record, ...]:
    """The records `BatchFolder.fold` skips because they sit in another partition than their
    session's (its stored mark's partition, or for a new session the first record's)."""
    home: dict[str, int] = {}
    found: list[Record] = []
    for record in records:
        sid = record.event.session_id
        partition = home.get(sid)
        if partition is None:
            folded = known.get(sid)
            mark = None if folded is None else folded.mark
            partition = home[sid] = record.position.partition if mark is None else mark.partition
        if record.position.partition != partition:
            found.append(record)
    return tuple(found)


def applied_state(known: Mapping[str, Folded], record: Record) -> Session | None:
    """The known state of the record's session when it already holds the record (the record sits
    at or below the session's mark, in its partition), else None."""
    folded = known.get(record.event.session_id)
    mark = None if folded is None else folded.mark
    if mark is None:
        return None
    position = record.position
    if position.partition != mark.partition or position.offset > mark.offset:
        return None
    return folded.state  # type: ignore[union-attr] # a mark implies a state


def redelivered_decisions(
    known: Mapping[str, Folded], records: Iterable[Record]
) -> tuple[tuple[str, Decision], ...]:
    """The decisions the `known` states hold for records at or below their marks, in state order.

    Why: a worker that stops between a batch's Redis commit and its decisions' acknowledgement
    leaves them unpublished, and the marks then skip the redelivered records. Publishing what the
    state recorded for them keeps decisions at-least-once; a subscriber drops repeats by seq.
    """
    stale: dict[str, set[str]] = {}
    for record in records:
        if applied_state(known, record) is not None:
            stale.setdefault(record.event.session_id, set()).add(record.event.event_id)
    return tuple(
        (sid, d)
        for sid, ids in stale.items()
        for d in known[sid].state.decisions
        if d.event_id in ids
    )


_DECIDING = frozenset({ev.QUESTION_ANSWERED, ev.ANSWER_WINDOW_CLOSED})


def beyond_recent_decisions(
    known: Mapping[str, Folded], records: Iterable[Record]
) -> dict[str, int]:
    """Sessions whose records at or below their marks may have made decisions older than the
    `RECENT_DECISIONS` their states keep (`redelivered_decisions` would miss those), each with
    how many of its latest decisions can hold every one those records made.

    A state holding fewer than that holds every decision the session made; one holding that many
    misses an answer or closing whose decision is not among them (or it was rejected: a history
    read tells), and an asking neither open nor among them.

    How many: each record of the session is one seq at most, and each seq one decision at most,
    so the decisions made from the session's first such record on are among the latest
    `mark - its offset + 1` (the records of its partition up to its mark): a bound set by the
    redelivery, not by the session's age.
    """
    first: dict[str, int] = {}
    short: dict[str, None] = {}
    for record in records:
        e = record.event
        sid = e.session_id
        state = applied_state(known, record)
        if state is None:
            continue
        first.setdefault(sid, record.position.offset)
        if sid in short or (e.type not in _DECIDING and e.type != ev.QUESTION_ASKED):
            continue
        if len(state.decisions) < RECENT_DECISIONS:
            continue
        if e.type in _DECIDING:
            found = any(d.event_id == e.event_id for d in state.decisions)
        else:
            qid, at, q = e.payload.get("question_id"), e.occurred_at, state.question
            found = (q is not None and q.id == qid and q.asked_at == at) or any(
                d.question_id == qid and d.asked_at == at for d in state.decisions
            )
        if not found:
            short[sid] = None
    return {sid: known[sid].mark.offset - first[sid] + 1 for sid in short}  # type: ignore[union-attr]


def joined(first: SessionUpdate, later: SessionUpdate) -> SessionUpdate:
    """One update of a session out of two consecutive ones (`later` folded onto `first`'s state)."""
    if later.session_id != first.session_id or later.base != first.mark:
        raise ValueError(
            f"{later.session_id}@{later.base} does not follow {first.session_id}@{first.mark}"
        )
    return SessionUpdate(
        first.session_id,
        first.base,
        later.mark,
        later.state,
        first.steps + later.steps,
        first.first if first.first is not None else later.first,
    )
