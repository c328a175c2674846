"""The projector's fold → commit → conflict loop, sans I/O: one loop for every projector.

`ProjectionCycle` keeps the folded states it knows (its cache) and, instead of calling a store,
yields requests: `Read` (the stored states of sessions it does not know), `Write` (a batch of
updates, answered with a `CommitResult`), `ReadDecisions` (a redelivery's decisions older than a
state keeps) and `Pause` (a point where an event loop may run others).
A shell answers them: `run` with a synchronous `ProjectionStore` (the in-memory projector, replay),
the worker with the asynchronous Redis store (retrying, and yielding to the event loop on `Pause`).
Every projector thus folds, skips, commits and re-folds conflicts by the same rules.
"""

from __future__ import annotations

from collections import ChainMap, Counter
from collections.abc import Generator, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Any, TypeVar

from schemas.errors import ProjectionError
from session_model.ports import CommitResult, ProjectionStore
from session_model.projection import (
    BatchFolder,
    Folded,
    Record,
    SessionUpdate,
    beyond_recent_decisions,
    foreign_records,
    joined,
    redelivered_decisions,
)
from session_model.questions import QuestionChange, redelivered_changes
from session_model.session import Decision, Session

T = TypeVar("T")
SLICE = 500  # records folded between two pauses
_NONE_HELD: Mapping[int, int] = MappingProxyType({})


@dataclass(frozen=True, slots=True)
class Read:
    """Request: the stored state and mark of these sessions (answered with `dict[str, Folded]`)."""

    session_ids: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class Write:
    """Request: commit these updates (answered with a `CommitResult`)."""

    updates: tuple[SessionUpdate, ...]


@dataclass(frozen=True, slots=True)
class ReadDecisions:
    """Request: the latest decisions these sessions' histories hold, in seq order (answered with
    `dict[str, tuple[Decision, ...]]`), for a redelivery whose decisions the states no longer hold.

    `latest[i]`: how many of session i's latest decisions are needed (more may be answered). A
    worker's answer leaves out a session whose history does not decode, having put it in its
    folder's `unreadable`: folded again, its records park their partition.
    """

    session_ids: tuple[str, ...]
    latest: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Pause:
    """Request: let other work run (answered with None)."""


PAUSE = Pause()
Request = Read | Write | ReadDecisions | Pause
Steps = Generator[Request, Any, T]
Redecided = tuple[tuple[str, Decision], ...]


@dataclass(frozen=True, slots=True)
class Folding:
    """A batch folded, not yet committed."""

    # Those folded, skipped as redelivered, or held for a parked partition (foreign ones left out).
    records: tuple[Record, ...]
    updates: tuple[SessionUpdate, ...]
    again: Redecided = ()  # decisions of records already applied (published again)
    foreign: tuple[Record, ...] = ()  # records of sessions projected from another partition
    redelivered: int = 0  # records at or below their session's mark
    reasked: tuple[QuestionChange, ...] = ()  # question changes of records already applied
    # The known state each update was folded onto (by identity; sessions new to the store have
    # none): how a commit tells an update folded on a state its predecessor found stale.
    based_on: Mapping[str, Session] = field(default_factory=dict)
    # Partition -> the offset from which its records were held (parked) when the fold ended: a
    # fault found or moved earlier later, by a re-fold, must not change what this one counted.
    held_from: Mapping[int, int] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Committed:
    """What committing a folded batch did."""

    updates: tuple[SessionUpdate, ...]
    again: Redecided = ()  # decisions a re-fold found already applied
    foreign: tuple[Record, ...] = ()  # found by a re-fold
    conflicts: int = 0
    redelivered: int = 0  # the re-folds' count, less what the conflicted folds had counted
    reasked: tuple[QuestionChange, ...] = ()  # question changes a re-fold found already applied
    # Sessions whose projection expired (retention): their updates wrote nothing and are not in
    # `updates`; their records are handled (they stay in the log for `replay --session`).
    expired: tuple[str, ...] = ()
    # Sessions whose records a conflict's re-fold found all applied already (a commit whose
    # reply was lost and that was sent again, or another writer's): their stored state, as an
    # update with no steps, for those told what a batch committed (its deadlines, its due
    # compaction), which would otherwise never hear of it. Not in `updates`: nothing to count
    # or publish from them (`again` and `reasked` carry that).
    settled: tuple[SessionUpdate, ...] = ()


@dataclass
class ProjectionCycle:
    """Folds batches onto the states it knows and commits them, re-folding conflicts.

    The folded states enter the cache at once, so a next batch can be folded while this one is
    committed: a state is determined by its mark, so whoever folds a session's partition up to
    offset X gets the same state. A conflict drops the session from the cache and re-folds its
    records from the store. With `keep=False` the cache lasts one batch (a store with other
    writers); beyond `cache_limit` sessions the older half of those with nothing uncommitted is
    dropped after a commit.

    Why a commit also re-folds what the commit before it found stale: a state folded onto a
    stale one (read from the store while a write was in flight, or folded before a conflict was
    found) carries the right mark and the wrong content. Its own commit conflicts, but the next
    batch, folded meanwhile onto it, starts from that same mark, which the conflict's re-fold
    then stores: its compare-and-set would pass. So the sessions of a batch folded onto a state
    its predecessor's commit found stale are folded again, from the state that commit left,
    before anything is written.

    An update the store reports `expired` (the session's projection was dropped by retention)
    wrote nothing: it is left out of `Committed.updates` (nothing of it is published), and its
    state leaves the cache like a conflicted one's (the next event reads the store again).
    """

    folder: BatchFolder
    keep: bool = True
    cache_limit: int | None = None
    slice_size: int = SLICE
    max_rounds: int | None = None  # conflict rounds before giving up (None: never)
    cache: dict[str, Folded] = field(default_factory=dict)
    # Sessions folded and not committed yet (by batches in flight): never trimmed.
    _uncommitted: Counter[str] = field(default_factory=Counter, repr=False)
    # The states the last commit found stale, by session (what the next batch may be folded on).
    _stale: dict[str, list[Session]] = field(default_factory=dict, repr=False)

    def forget(self) -> None:
        """Drop every known state (another projector may have advanced these sessions).

        Only once every batch folded so far has been committed or will be: a batch folded onto
        another's states, committed after this while the other never lands, would conflict, be
        folded again onto the store's state without the other's events, and land so.
        """
        self.cache.clear()
        self._stale.clear()
        self._uncommitted.clear()

    def project(self, records: Sequence[Record]) -> Steps[tuple[Folding, Committed]]:
        """Fold and commit one batch."""
        folding = yield from self.fold(records)
        return folding, (yield from self.commit(folding))

    def states(self, session_ids: Sequence[str]) -> Steps[dict[str, Folded]]:
        """The latest folded state of these sessions (known first, one read for the others)."""
        cache = self.cache
        misses = tuple(sid for sid in session_ids if sid not in cache)
        if misses:
            cache.update((yield Read(misses)))
        return {sid: cache[sid] for sid in session_ids if sid in cache}

    def fold(self, records: Sequence[Record]) -> Steps[Folding]:
        """Fold onto the known states (reading the others), in slices with a pause between.

        A session touched in several slices gets one update (`joined`), based on its mark before
        the batch. A slice re-reads a session that left the cache meanwhile (a conflict of the
        batch being committed drops it); the commit's compare-and-set catches a state folded twice.
        Every batch folded must be committed (`commit`), in order.
        """
        folding = yield from self._fold(records)
        self._uncommitted.update(u.session_id for u in folding.updates)
        return folding

    def _fold(self, records: Sequence[Record]) -> Steps[Folding]:
        ids = list(dict.fromkeys(r.event.session_id for r in records))
        new: set[str] = set()  # read and not found: sessions this batch starts
        yield from self._read_missing(ids, new)
        merged: dict[str, SessionUpdate] = {}
        based: dict[str, Session] = {}
        again: list[tuple[str, Decision]] = []
        reasked: list[QuestionChange] = []
        foreign: list[Record] = []
        redelivered = 0
        folder = self.folder
        fold, cache, size = folder.fold, self.cache, self.slice_size
        for at in range(0, len(records), size):
            chunk = records[at : at + size]
            if at:
                yield PAUSE
                yield from self._resume(records[:at], chunk, merged, based, new)
            held = folder.held
            updates = fold(cache, chunk)
            # Records of a parked partition (`BatchFolder.parked`) are not skipped as applied.
            skipped = len(chunk) - sum(len(u.steps) for u in updates) - (folder.held - held)
            if skipped:  # rare (a redelivery): only then is the slice searched, before its fold
                known: Mapping[str, Folded] = cache
                short = beyond_recent_decisions(cache, chunk)
                if short:  # rarer still: decisions the states hold too few of, from history
                    history: dict[str, tuple[Decision, ...]] = {}
                    read: dict[str, int] = {}
                    unreadable = folder.unreadable
                    # (A session whose history does not decode is left out of the answer, and
                    # put in `unreadable`: its records are held, so not asked for again. Let go
                    # of meanwhile (it reads now), it is asked for again.)
                    while need := {
                        s: n for s, n in short.items() if n > read.get(s, 0) and s not in unreadable
                    }:
                        answer = yield ReadDecisions(tuple(need), tuple(need.values()))
                        history.update(answer)
                        read.update((s, n) for s, n in need.items() if s in answer)
                        # Other work ran meanwhile (a commit may have replaced states this slice
                        # was folded onto): fold the slice again, as after a pause. A state
                        # read again may have a later mark, and need more of the history.
                        yield from self._resume(records[:at], chunk, merged, based, new)
                        held = folder.held
                        updates = fold(cache, chunk)
                        steps = sum(len(u.steps) for u in updates)
                        skipped = len(chunk) - steps - (folder.held - held)
                        short = beyond_recent_decisions(cache, chunk)
                    known = ChainMap(self._with_decisions(history), cache)
                # Records behind a park (those of a session in `unreadable` among them: each
                # parks its partition at or before it) are read again once it is let go, and
                # are refused or published then.
                seen: Sequence[Record] = chunk
                if folder.parked:
                    seen = [r for r in chunk if not folder.behind_park(r.position)]
                strays = foreign_records(cache, seen)
                foreign.extend(strays)
                redelivered += skipped - len(strays)
                again.extend(redelivered_decisions(known, seen))
                reasked.extend(redelivered_changes(known, seen))
            for u in updates:
                sid = u.session_id
                before = merged.get(sid)
                if before is None and (prior := cache.get(sid)) is not None:
                    based[sid] = prior.state
                cache[sid] = Folded(u.state, u.mark)
                merged[sid] = u if before is None else joined(before, u)
        kept = tuple(records)
        if foreign:
            gone = {id(r) for r in foreign}
            kept = tuple(r for r in records if id(r) not in gone)
        parked = folder.parked
        return Folding(
            kept,
            tuple(merged.values()),
            tuple(again),
            tuple(foreign),
            redelivered,
            tuple(reasked),
            based,
            {p: f.position.offset for p, f in parked.items()} if parked else _NONE_HELD,
        )

    def _resume(
        self,
        earlier: Sequence[Record],
        chunk: Sequence[Record],
        merged: dict[str, SessionUpdate],
        based: dict[str, Session],
        new: set[str],
    ) -> Steps[None]:
        """After other work ran: read what left the cache, fold again what was replaced."""
        yield from self._read_missing([r.event.session_id for r in chunk], new)
        self._refold_replaced(earlier, chunk, merged, based)

    def _with_decisions(self, history: Mapping[str, tuple[Decision, ...]]) -> dict[str, Folded]:
        """The cached states of these sessions holding every decision their history holds."""
        cache = self.cache
        out: dict[str, Folded] = {}
        for sid, decisions in history.items():
            folded = cache.get(sid)
            if folded is None or not decisions:
                continue
            # The history as read, and what the state holds beyond it (committed since the read).
            every = {d.seq: d for d in (*decisions, *folded.state.decisions)}
            merged = tuple(every[seq] for seq in sorted(every))
            out[sid] = Folded(replace(folded.state, decisions=merged), folded.mark)
        return out

    def commit(self, folding: Folding) -> Steps[Committed]:
        """Commit a folded batch, re-folding conflicted sessions from the store until none is.

        Batches must be committed in the order they were folded. A re-fold may find records
        already applied (by a stale owner, or by this projector's own earlier fold) whose
        decisions may never have been published: they are returned in `again`. An update the
        store reports expired is done with but not committed: it is in `expired`, not `updates`.
        """
        records, updates = folding.records, folding.updates
        self._uncommitted.subtract(u.session_id for u in updates)
        done: list[SessionUpdate] = []
        expired: list[str] = []
        again: list[tuple[str, Decision]] = []
        reasked: list[QuestionChange] = []
        foreign: list[Record] = []
        conflicts = redelivered = rounds = 0
        settled: set[str] = set()
        stale, self._stale = self._stale, {}
        suspect = (
            {
                u.session_id
                for u in updates
                if (found := stale.get(u.session_id))
                and any(folding.based_on.get(u.session_id) is state for state in found)
            }
            if stale
            else set()
        )
        if suspect:  # folded onto a state the last commit found stale: fold them again first
            self._note_stale(u for u in updates if u.session_id in suspect)
            redone = tuple(r for r in records if r.event.session_id in suspect)
            redelivered -= _counted(redone, folding.held_from) - sum(
                len(u.steps) for u in updates if u.session_id in suspect
            )  # counted again by the re-fold
            refolded = yield from self._fold(redone)
            updates = (*(u for u in updates if u.session_id not in suspect), *refolded.updates)
            again.extend(refolded.again)
            reasked.extend(refolded.reasked)
            foreign.extend(refolded.foreign)
            redelivered += refolded.redelivered
        held_from = folding.held_from
        while updates:
            result: CommitResult = yield Write(updates)
            conflicted = set(result.conflicts)
            unwritten = conflicted
            if result.expired:  # nothing written: handled, not done, and not folded again
                gone = set(result.expired)
                unwritten = conflicted | gone
                expired.extend(result.expired)
                # The next event reads the store again; a batch folded meanwhile onto this
                # state is folded again from the store before its commit (see above).
                self._note_stale(u for u in updates if u.session_id in gone)
                for sid in gone:
                    self.cache.pop(sid, None)
            done.extend(u for u in updates if u.session_id not in unwritten)
            if not conflicted:
                break
            rounds += 1
            if self.max_rounds is not None and rounds >= self.max_rounds:
                raise ProjectionError(f"sessions kept conflicting: {sorted(conflicted)}")
            conflicts += len(conflicted)
            self._note_stale(u for u in updates if u.session_id in conflicted)
            for sid in conflicted:
                self.cache.pop(sid, None)  # re-read: someone else moved this session's mark
            records = tuple(r for r in records if r.event.session_id in conflicted)
            redelivered -= _counted(records, held_from) - sum(
                len(u.steps) for u in updates if u.session_id in conflicted
            )  # counted again by the re-fold
            refolded = yield from self._fold(records)
            records, updates, held_from = refolded.records, refolded.updates, refolded.held_from
            settled.update(conflicted - {u.session_id for u in updates})
            again.extend(refolded.again)
            reasked.extend(refolded.reasked)
            foreign.extend(refolded.foreign)
            redelivered += refolded.redelivered
        written = {u.session_id for u in done}
        as_stored: list[SessionUpdate] = []
        for sid in sorted(settled - written):
            folded = self.cache.get(sid)
            if folded is not None and folded.mark is not None:
                as_stored.append(SessionUpdate(sid, folded.mark, folded.mark, folded.state, ()))
        self._trim()
        return Committed(
            tuple(done),
            tuple(again),
            tuple(foreign),
            conflicts,
            redelivered,
            tuple(reasked),
            tuple(expired),
            tuple(as_stored),
        )

    def _note_stale(self, updates: Iterable[SessionUpdate]) -> None:
        """These updates' states were folded onto stale ones: the next commit must not build on
        them."""
        for u in updates:
            self._stale.setdefault(u.session_id, []).append(u.state)

    def _read_missing(self, session_ids: Sequence[str], new: set[str]) -> Steps[None]:
        """Read the sessions neither known nor known to be new (one read, if any).

        Checked again after each read: while it was answered, a batch being committed may have
        trimmed the cache or dropped a conflicted session, and the fold that follows must find
        every session it folds.
        """
        cache = self.cache
        while misses := tuple(
            dict.fromkeys(s for s in session_ids if s not in cache and s not in new)
        ):
            found: dict[str, Folded] = yield Read(misses)
            cache.update(found)
            new.update(s for s in misses if s not in found)

    def _refold_replaced(
        self,
        earlier: Sequence[Record],
        chunk: Sequence[Record],
        merged: dict[str, SessionUpdate],
        based: dict[str, Session],
    ) -> None:
        """Fold again the earlier slices' records of sessions whose known state was replaced.

        During a pause a batch being committed may have trimmed the cache or re-read a conflicted
        session: the cache then no longer holds what the earlier slices folded, and this slice's
        update would not follow theirs. Their records are folded again onto what the cache holds
        now (those at or below its mark are skipped): one update per session, from one state.
        """
        cache = self.cache
        replaced = {
            sid
            for sid in {r.event.session_id for r in chunk}
            if sid in merged and ((f := cache.get(sid)) is None or f.mark != merged[sid].mark)
        }
        if not replaced:
            return
        for sid in replaced:
            del merged[sid]
            based.pop(sid, None)
            if (prior := cache.get(sid)) is not None:
                based[sid] = prior.state
        redone = self.folder.fold(cache, [r for r in earlier if r.event.session_id in replaced])
        for u in redone:
            cache[u.session_id] = Folded(u.state, u.mark)
            merged[u.session_id] = u

    def _trim(self) -> None:
        cache = self.cache
        pending = +self._uncommitted  # the counts above zero
        self._uncommitted = pending
        if not self.keep:
            cache.clear()
        elif self.cache_limit is not None and len(cache) > self.cache_limit:
            # In insertion order: the sessions known first are dropped first. Not a session a
            # batch in flight has folded: the batch after it would read it from the store before
            # that batch's write lands, and fold onto a stale state (see the class docstring).
            for sid in list(cache)[: len(cache) // 2]:
                if sid not in pending:
                    del cache[sid]


def run(steps: Steps[T], store: ProjectionStore) -> T:
    """Answer a cycle's requests with a synchronous store; the cycle's result."""
    reply: Any = None
    while True:
        try:
            request = steps.send(reply)
        except StopIteration as done:
            result: T = done.value
            return result
        if type(request) is Read:
            reply = store.folded(request.session_ids)
        elif type(request) is Write:
            reply = store.commit(request.updates)
        elif type(request) is ReadDecisions:
            reply = {
                sid: store.facts(sid).decisions[-n:]
                for sid, n in zip(request.session_ids, request.latest, strict=True)
            }
        else:
            reply = None


def _counted(records: Sequence[Record], held_from: Mapping[int, int]) -> int:
    """How many of `records` a fold counted as applied or as redelivered: not those it held, at
    or after the offset their partition was parked at when it ended (`Folding.held_from`)."""
    if not held_from:
        return len(records)
    return sum(
        1
        for r in records
        if (offset := held_from.get(r.position.partition)) is None or r.position.offset < offset
    )
