"""Rebuilding projections from the topic: the same fold, the same store, from the snapshots.

With a snapshots topic, each session starts from its latest usable snapshot and each partition is
read from after its checkpoint (`projections.snapshots`); without one (`replay --full`), or where
a snapshot or a checkpoint cannot be used, from offset zero.

It applies exactly the records the live worker applies: both admit records through
`session_model.intake.Intake` (same refusals, same codes; a rebuild counts what it refuses and never
folds it), and a session's mark is a position in its own partition only.

Run it with the workers stopped (or against a fresh key prefix): a worker committing while a
session is being rebuilt could fold its newest events onto an empty state (`milpa-sessions replay`
checks that the workers' consumer group is empty first; this function does not). The rebuild reads
every partition up to the end offsets it found when it started, in batches, and publishes no
decisions.

How it is made fast (issue #5: ≥ 25k events/s on the two-core bench machine):

- Partitions are rebuilt in parallel processes (`processes`; by default one per CPU when the
  caller runs no other thread): a session lives in one partition, so each process folds and
  commits its sessions alone. One process is
  CPU-bound on the GIL and waits for Redis for a sixth of its time; two on two cores rebuilt
  1.15-1.4x faster than one, while the broker and Redis shared the same cores.
- In each process the records are fetched by aiokafka on a thread of its own (`_Fetcher`), a few
  batches ahead: its record parsing is compiled (≈ 1.2 µs of CPU per record; kafka-python's
  pure-Python parsing took ≈ 7) and its waiting on the broker overlaps the folding.
- The collector is tuned for the duration of the rebuild (`_bulk_collector`): the rebuild keeps
  every session's state, so CPython's default thresholds ran a full collection over an ever larger
  cache every few batches — 40 % of the rebuild's CPU. Nothing the rebuild makes is cyclic.
- The rebuild keeps the states it committed (`Projector(cache=True)`), bounded.

Committing on a second thread while folding the next batch was measured too, and was slower: the
GIL hands the committing thread back its turn late, and the CPU work is the same.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import dataclasses
import gc
import logging
import multiprocessing
import os
import queue
import signal
import threading
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Final, TypeVar

from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.errors import KafkaError

from producers.kafka_access import KafkaAccess
from projections.projector import Projector
from projections.redis_store import RedisProjectionStore
from projections.requests import Restored, Retired
from projections.snapshots import Chosen, Plan, UnusableSnapshot, chosen_snapshots
from projections.snapshots import plan as plan_rebuild
from schemas.codec import EventCodec
from schemas.errors import BackendError, LogError, MilpaError, RebuildInProgressError
from session_model.authority import Cutover, trust_fingerprint
from session_model.intake import Intake
from session_model.modes import Mode
from session_model.partitioning import partition_for
from session_model.projection import BatchFolder, Record
from session_model.signing import TrustedKeys

Progress = Callable[[int, int], None]
log = logging.getLogger("milpa_sessions.replay")

# Sessions whose state a rebuild process keeps between batches, by default; beyond it the older
# half is dropped (a dropped session that shows up again is read back from Redis). Its memory:
# a few KB per session (docs/PERFORMANCE.md, "The rebuild's memory").
CACHE_LIMIT: Final = 200_000
# Records per batch, at most (across a process's partitions). A session's update is committed
# once per batch that holds its events: larger batches commit fewer updates per event (less
# state encoding, fewer script calls in Redis). 12,000 rebuilt the bench's topic 8-14 % faster
# than 2,000 in alternated runs (docs/PERFORMANCE.md, "The rebuild's batches"); a batch's
# records and states are tens of MB at most.
BATCH_RECORDS: Final = 12_000
# Batches fetched ahead of the fold.
_AHEAD: Final = 4
T = TypeVar("T")
_POLL_S: Final = 0.2  # how often the parent looks for a rebuild process that died silently
# A read that gets no further for this long fails (LogError) instead of waiting for ever: aiokafka
# retries some failures (a partition without a leader, a refused fetch) silently and endlessly.
STALL_S: Final = 60.0
# A fetcher thread that hands nothing over for this long is stuck where it cannot notice itself.
SILENT_S: Final = 5 * STALL_S
_RESTORE_BATCH: Final = 500  # sessions restored from snapshots per round trip

RawRecord = tuple[int, int, bytes | None, bytes | None]
"""partition, offset, key, value."""


@dataclass(frozen=True)
class ForkGuard:
    """Threads of the caller that may run while the rebuild forks: each holds `lock` whenever
    it could hold anything a forked child would need (a Redis connection, stderr), and the
    rebuild forks its processes holding it. They then do not keep the rebuild in one process."""

    lock: Any  # a `threading.Lock`
    threads: tuple[threading.Thread, ...] = ()


@dataclass(frozen=True, slots=True)
class ReplayReport:
    """What a rebuild read and applied, and what it refused (by refusal code).

    `restored`: sessions started from their snapshots; `retired`: sessions whose projection had
    expired, their tombstones brought back from their stubs (not among `applied_sessions`,
    nor `restored`); `ignored`: snapshot records it could not
    use, by reason (`projections.snapshots`), each one a warning; `skipped`: events before
    the partitions' checkpoints it did not read; `processes`: how many folded them; `trust`:
    the fingerprint of the trust inputs it folded under (what its snapshots must name).
    """

    records: int
    applied_sessions: int
    refused: Mapping[str, int] = dataclasses.field(default_factory=dict)
    restored: int = 0
    ignored: Mapping[str, int] = dataclasses.field(default_factory=dict)
    skipped: int = 0
    retired: int = 0
    ends: Mapping[int, int] = dataclasses.field(default_factory=dict)  # partition -> end read
    processes: int = 1  # that folded the partitions
    trust: str = ""  # `session_model.authority.trust_fingerprint` of its keys, mode, cut-over

    def applied_through(self) -> dict[int, int]:
        """partition -> the last offset the rebuild applied (what its snapshots can vouch for)."""
        return {p: end - 1 for p, end in self.ends.items()}

    @property
    def refused_total(self) -> int:
        """Records refused, whatever the reason."""
        return sum(self.refused.values())


def replay(
    bootstrap: str | KafkaAccess,
    topic: str,
    store: RedisProjectionStore,
    keys: TrustedKeys,
    *,
    session_id: str | None = None,
    batch_size: int = BATCH_RECORDS,
    progress: Progress | None = None,
    codec: EventCodec | None = None,
    processes: int | None = None,
    start_mode: Mode = Mode.ASK,
    cutover: Cutover | None = None,
    restored_at: datetime | None = None,
    snapshots_topic: str | None = None,
    clear: bool = True,
    fork_guard: ForkGuard | None = None,
    cache_limit: int = CACHE_LIMIT,
) -> ReplayReport:
    """Drop and rebuild every projection (or one session's) from the topic.

    `keys`, `start_mode` and `cutover` are the fold's trust inputs: the same as the workers'.

    With `snapshots_topic`, each session starts from its latest usable snapshot and each
    partition is read from after its checkpoint (`projections.snapshots`); without (`replay
    --full`), or where a snapshot or checkpoint is missing, unreadable, of another layout or
    folded under other trust inputs, from offset 0. Unusable snapshots are counted in the report
    and logged.

    `clear=False` leaves the store's keys as they are (a live rebuild writes a generation of its
    own, emptied beforehand: `processors.generations`). A rebuild that clears marks the store
    half built (`RedisProjectionStore.begin_rebuild`) until its fold has ended.

    One session's rebuild also takes its tombstone away with its first commit (an expired
    projection comes back whole; the drop before keeps it, so that a worker's commit meanwhile
    finds it expired instead of writing it from nothing) and, under a retention, keeps it at
    least one TTL from `restored_at` (default: now), so the next sweep does not drop it again at
    once. A full rebuild indexes every ended session at
    its own deadline again.

    `processes`: how many processes rebuild partitions in parallel, at most one per partition;
    1 rebuilds in this process. By default one per CPU when this process runs no other thread
    (the processes are forked) than those of `fork_guard`, else 1. `cache_limit`: the sessions
    whose state each of them keeps between batches.
    """
    codec = codec or EventCodec()
    cutover = cutover or Cutover()
    trust = trust_fingerprint(keys, start_mode, cutover)
    if session_id is None and clear and store.rebuild_running():
        raise RebuildInProgressError(
            "a live rebuild (replay --live) is under way: clearing every projection now would "
            "pull the generations from under it; wait for it to end"
        )
    if session_id is not None:
        # The session's pauses and outcomes are already in the global counters: rebuilding its
        # projection must not count them a second time.
        # Its commits restore it if it expired: its tombstone, kept by the drop so that a worker
        # meanwhile does not write it from nothing, does not refuse them.
        store = dataclasses.replace(store, count_stats=False, restores=True)
        if store.retention is not None:
            restored = store.retention.restored(restored_at or datetime.now(UTC))
            store = dataclasses.replace(store, retention=restored)
    access = KafkaAccess.of(bootstrap)
    # The snapshots topic's ends before the events topic's: every snapshot up to them was taken
    # of events the log held by then (a live rebuild starts while workers take snapshots).
    snapshot_ends = _snapshot_ends(access, snapshots_topic) if snapshots_topic else None
    ends, partitions = _end_offsets(access, topic, session_id)
    # Where a session's keys live depends on the topic's partition count (`projections.keys`).
    store = dataclasses.replace(store, keys=dataclasses.replace(store.keys, partitions=partitions))
    restoring: str | None = None  # one session's mark: half built (reads refuse it) meanwhile
    if session_id is not None:
        restoring = store.begin_restore(session_id, datetime.now(UTC))
        store.drop(session_id, restoring=True)  # its tombstone and retention entry too
        # Its partition's end read again, after the mark: a worker that applied an event of it
        # past the first read, before the mark or onto its cached state before the drop, has
        # that event folded here (one that reads it after the mark leaves it: its partition
        # waits for this restore, `BatchFolder.unreadable`).
        ends, _ = _end_offsets(access, topic, session_id)
    plan = Plan(starts=dict.fromkeys(ends, 0))
    if snapshots_topic is not None:
        plan = _snapshot_plan(
            access, snapshots_topic, snapshot_ends, ends, codec, session_id=session_id, trust=trust
        )
        for line in plan.messages:
            log.warning("snapshot ignored (the log is folded instead): %s", line)
    starts = {p: min(plan.starts.get(p, 0), end) for p, end in ends.items()}
    total = sum(end - starts[p] for p, end in ends.items())
    # From the clear until the fold has ended, the projections are half built: a mark says so
    # (`Keys.rebuild_incomplete`), set before the clear and taken away only after the fold, so a
    # rebuild that dies in between (a stalled read, Ctrl-C, OOM) leaves it, and workers refuse to
    # start on what it left; running the rebuild again is the remedy, and ends by taking it away.
    # One session's rebuild drops that session alone, and a live one (`clear=False`) builds a
    # generation of its own that readers and workers are moved to only once it is whole: neither
    # leaves the fleet's projection half built.
    marked = session_id is None and clear
    if marked:
        store.begin_rebuild("replay" if snapshots_topic else "replay --full", datetime.now(UTC))
        store.clear()
    folder = BatchFolder(keys, start_mode, cutover)
    intake = Intake(codec, partitions)
    job = _Job(
        access,
        topic,
        store,
        folder,
        session_id,
        batch_size,
        intake,
        starts,
        snapshots=plan.sessions,
        snapshots_topic=snapshots_topic,
        trust=trust,
        cache_limit=cache_limit,
    )
    groups = _groups(sorted(ends), processes, () if fork_guard is None else fork_guard.threads)
    if len(groups) <= 1:
        planned = [total]  # grown by a partition folded whole for a snapshot found unusable

        def grow(more: int) -> None:
            planned[0] += more

        report = job.run(
            ends, None if progress is None else lambda read: progress(read, planned[0]), grow
        )
    else:
        shares = [{p: ends[p] for p in g} for g in groups]
        report = _in_processes(job, shares, total, progress, fork_guard)
    if marked:
        store.end_rebuild()
    elif session_id is not None and restoring is not None:
        store.end_restore(session_id, restoring)
    return dataclasses.replace(
        report, ignored=dict(plan.ignored + Counter(report.ignored)), ends=dict(ends), trust=trust
    )


def fold_range(
    bootstrap: str | KafkaAccess,
    topic: str,
    store: RedisProjectionStore,
    keys: TrustedKeys,
    *,
    starts: Mapping[int, int],
    ends: Mapping[int, int],
    partitions: int,
    start_mode: Mode = Mode.ASK,
    cutover: Cutover | None = None,
    batch_size: int = BATCH_RECORDS,
    cache_limit: int = CACHE_LIMIT,
) -> ReplayReport:
    """Fold the records of these partitions from `starts` up to `ends` onto what the store holds
    (in this process): a live rebuild's catching up after its first pass."""
    wanted = {p: end for p, end in ends.items() if end > starts.get(p, 0)}
    if not wanted:
        return ReplayReport(0, 0)
    folder = BatchFolder(keys, start_mode, cutover or Cutover())
    intake = Intake(EventCodec(), partitions)
    access = KafkaAccess.of(bootstrap)
    job = _Job(
        access, topic, store, folder, None, batch_size, intake, starts, cache_limit=cache_limit
    )
    return job.run(dict(wanted), None)


def end_offsets(bootstrap: str | KafkaAccess, topic: str) -> tuple[dict[int, int], int]:
    """partition -> end offset now (of the partitions that hold anything), and the topic's
    partition count (LogError)."""
    return _end_offsets(KafkaAccess.of(bootstrap), topic, None)


def _snapshot_ends(access: KafkaAccess, topic: str) -> dict[int, int] | None:
    """The snapshots topic's end offsets, or None when it does not exist (never snapshotted)."""
    try:
        ends, _ = _end_offsets(access, topic, None)
    except LogError as e:
        if "does not exist" not in str(e):
            raise
        return None
    return ends


def _snapshot_plan(
    access: KafkaAccess,
    topic: str,
    snapshot_ends: Mapping[int, int] | None,
    events_ends: Mapping[int, int],
    codec: EventCodec,
    *,
    session_id: str | None,
    trust: str,
) -> Plan:
    """The rebuild's plan from the snapshots topic, read up to `snapshot_ends` (read before
    `events_ends`, the events topic's: snapshots past those are not believed), for a rebuild
    folding under `trust` (snapshots of another are not believed either)."""
    partitions = sorted(events_ends)
    if snapshot_ends is None:
        return Plan(starts=dict.fromkeys(partitions, 0))  # never snapshotted: the whole log
    ends = dict(snapshot_ends)
    if session_id is not None:  # its snapshot is in its own partition's number
        mine = partitions[0] if partitions else None
        ends = {p: end for p, end in ends.items() if p == mine}
    if not ends:  # nothing snapshotted yet
        return plan_rebuild((), partitions, codec, session_id, events_ends, trust=trust)
    with _Fetcher(access, topic, ends, 2000) as fetcher:
        # Planned as the batches arrive: what is kept is each key's latest usable snapshot, never
        # the topic's records (a key's older ones until compaction removes them). A partition's
        # records come in log order (the fetcher keeps each partition's order).
        records = (record for batch in fetcher.batches() for record in batch)
        return plan_rebuild(records, partitions, codec, session_id, events_ends, trust=trust)


def _groups(
    partitions: Sequence[int], processes: int | None, guarded: Sequence[threading.Thread] = ()
) -> list[list[int]]:
    """The partitions of each rebuild process (round robin); `guarded`: threads that hold a
    `ForkGuard`'s lock whenever forking would be unsafe."""
    if processes is None:
        # One per CPU, unless this process runs other threads: a forked child inherits the
        # locks they hold at that instant (a logging handler's, stderr's) and could wait on one
        # forever. A live rebuild's lease renewer is guarded; the CLI runs no other thread.
        processes = len(os.sched_getaffinity(0)) if not _unguarded(guarded) else 1
    elif processes > 1 and (others := _unguarded(guarded)):
        log.warning(
            "forking %d rebuild processes while other threads run (%s): a child waits for ever "
            "on a lock one of them held at the fork (OpenSSL's, with TLS; a logging handler's), "
            "which fails the rebuild after %gs; run it where no other thread does (the CLI)",
            processes,
            ", ".join(sorted(t.name for t in others)),
            SILENT_S,
        )
    if "fork" not in multiprocessing.get_all_start_methods():
        processes = 1
    count = max(1, min(processes, len(partitions)))
    return [list(partitions[i::count]) for i in range(count)] if partitions else []


def _unguarded(guarded: Sequence[threading.Thread]) -> list[threading.Thread]:
    """This process's threads but the caller's and those of a `ForkGuard`."""
    here = threading.current_thread()
    return [t for t in threading.enumerate() if t is not here and t not in guarded]


@dataclass(frozen=True)
class _Job:
    """What every rebuild process needs, besides its partitions and their end offsets."""

    bootstrap: KafkaAccess
    topic: str
    store: RedisProjectionStore
    folder: BatchFolder
    session_id: str | None
    batch_size: int
    intake: Intake
    starts: Mapping[int, int] = dataclasses.field(default_factory=dict)  # first offset to read
    # partition -> session -> its snapshot to restore, on `snapshots_topic` (of `trust`)
    snapshots: Mapping[int, Mapping[str, Chosen]] = dataclasses.field(default_factory=dict)
    snapshots_topic: str | None = None
    trust: str = ""
    cache_limit: int = CACHE_LIMIT  # sessions whose state it keeps between batches

    def run(
        self,
        ends: dict[int, int],
        progress: Callable[[int], None] | None,
        grow: Callable[[int], None] | None = None,
    ) -> ReplayReport:
        """Rebuild these partitions up to these offsets, in this process; `grow` hears of the
        records it reads beyond the plan (partitions folded whole for an unusable snapshot)."""
        if not ends:
            return ReplayReport(0, 0)
        # The states are released (`_run` returned) before the thresholds are restored, or the
        # first allocation after would collect them all, inside the rebuild's time.
        with _bulk_collector():
            return self._run(ends, progress, grow)

    def _run(
        self,
        ends: dict[int, int],
        progress: Callable[[int], None] | None,
        grow: Callable[[int], None] | None,
    ) -> ReplayReport:
        # The rebuild owns the sessions it writes: keep their states instead of re-reading them.
        projector = Projector(self.store, self.folder, cache=True, cache_limit=self.cache_limit)
        restored, retired, ignored, again = self._restore(ends)
        wanted = None if self.session_id is None else self.session_id.encode()
        admit = self.intake.admit
        read = 0
        refused: Counter[str] = Counter()
        applied: set[str] = set()
        # A partition with a snapshot that could not be restored is folded whole.
        starts = {p: 0 if p in again else self.starts.get(p, 0) for p in ends}
        more = sum(self.starts.get(p, 0) for p in again if p in ends)
        if more and grow is not None:
            grow(more)
        fetcher = _Fetcher(self.bootstrap, self.topic, ends, self.batch_size, starts)
        with fetcher:
            for batch in fetcher.batches():
                records: list[Record] = []
                for partition, offset, key, value in batch:
                    read += 1
                    if wanted is not None and key != wanted:
                        continue
                    admitted = admit(key, value, partition, offset)
                    if type(admitted) is Record:
                        records.append(admitted)
                    else:  # the live worker dead-lettered it
                        refused[admitted.code] += 1  # type: ignore[union-attr]
                if records:
                    applied.update([u.session_id for u in projector.project(records)])
                if progress is not None:
                    progress(read)
        refused.update(projector.refused)
        applied.update(restored)
        return ReplayReport(
            read,
            len(applied),
            dict(refused),
            restored=len(restored),
            ignored=dict(ignored),
            skipped=sum(starts.values()),
            retired=retired,
        )

    def _restore(self, ends: Mapping[int, int]) -> tuple[list[str], int, Counter[str], set[int]]:
        """Write the chosen snapshots of these partitions' sessions, read again from the
        snapshots topic a page at a time, for the fold to start from: the sessions restored,
        how many retired ones' tombstones were (from their stubs), the snapshots that could not
        be (by reason) and the partitions to fold whole for them."""
        chosen = {p: self.snapshots[p] for p in ends if self.snapshots.get(p)}
        done: list[str] = []
        ignored: Counter[str] = Counter()
        again: set[int] = set()
        retired = 0
        if not chosen or self.snapshots_topic is None:
            return done, retired, ignored, again
        # A partition's snapshots are in the snapshots topic's partition of the same number.
        starts = {p: min(c.at for c in found.values()) for p, found in chosen.items()}
        last = {p: max(c.at for c in found.values()) + 1 for p, found in chosen.items()}
        page: list[Restored] = []
        stubs: list[Retired] = []
        with _Fetcher(self.bootstrap, self.snapshots_topic, last, 2000, starts) as fetcher:
            records = (record for batch in fetcher.batches() for record in batch)
            codec = self.intake.codec
            for partition, got in chosen_snapshots(records, chosen, codec, trust=self.trust):
                if isinstance(got, UnusableSnapshot):
                    ignored[got.reason] += 1
                    again.add(partition)
                    if sum(ignored.values()) <= 20:
                        log.warning("snapshot ignored (the log is folded instead): %s", got)
                    continue
                if isinstance(got, Retired):
                    stubs.append(got)
                else:
                    page.append(got)
                if len(page) + len(stubs) >= _RESTORE_BATCH:
                    done.extend(self._write(page))
                    retired += self._retire(stubs)
                    page, stubs = [], []
        done.extend(self._write(page))
        retired += self._retire(stubs)
        return done, retired, ignored, again

    def _retire(self, stubs: Sequence[Retired]) -> int:
        """Write these retired sessions' tombstones and counters from their stubs; how many."""
        refused = self.store.restore_retired(stubs)
        if refused:
            raise BackendError(
                f"restoring retired sessions: {len(refused)} session(s) already had a tombstone "
                f"or a projection (e.g. {refused[0]}): is a worker running?"
            )
        return len(stubs)

    def _write(self, page: Sequence[Restored]) -> list[str]:
        """Write these sessions from their snapshots.

        Their states are not kept for the fold: a session with events after its snapshot is
        read back from Redis once, when they come (one round trip per batch for all of them),
        so a rebuild process holds the states of the sessions it folds, not of every session
        it restores (docs/PERFORMANCE.md, "The rebuild's memory").
        """
        if not page:
            return []
        result = self.store.restore(page)
        if result.conflicts:
            raise BackendError(
                f"restoring snapshots: {len(result.conflicts)} session(s) already had a "
                f"projection (e.g. {result.conflicts[0]}): is a worker running?"
            )
        return [r.folded.state.id for r in page]


def _in_processes(
    job: _Job,
    shares: list[dict[int, int]],
    total: int,
    progress: Progress | None,
    guard: ForkGuard | None = None,
) -> ReplayReport:
    """Run `job` over each share of the partitions in a process of its own; add the reports.

    The processes are forked: they inherit the store, keys and codec as they are (a Redis client
    reconnects in a forked child by itself), and nothing is imported again. A session lives in one
    partition, so the processes write disjoint sessions and their counts add up.
    """
    context = multiprocessing.get_context("fork")
    messages: Any = context.Queue()
    parent = os.getpid()
    children = [
        context.Process(
            target=_child,
            args=(job, share, i, messages, parent),
            name=f"replay-{i}",
            daemon=True,
        )
        for i, share in enumerate(shares)
    ]
    reads = [0] * len(children)
    reports: dict[int, ReplayReport] = {}
    try:
        with contextlib.nullcontext() if guard is None else guard.lock:
            for child in children:
                child.start()
        while len(reports) < len(children):
            try:
                kind, index, value = messages.get(timeout=_POLL_S)
            except queue.Empty:
                for i, child in enumerate(children):
                    if i not in reports and child.exitcode is not None:
                        raise BackendError(
                            f"rebuild process {child.name} ended (exit code {child.exitcode}) "
                            "without a report"
                        ) from None
                continue
            if kind == "error":
                raise value
            if kind == "grow":  # a partition folded whole for a snapshot found unusable
                total += value
            elif kind == "progress":
                reads[index] = value
                if progress is not None:
                    progress(sum(reads), total)
            else:
                reports[index] = value
        refused: Counter[str] = Counter()
        ignored: Counter[str] = Counter()
        for r in reports.values():
            refused.update(r.refused)
            ignored.update(r.ignored)
        return ReplayReport(
            sum(r.records for r in reports.values()),
            sum(r.applied_sessions for r in reports.values()),
            dict(refused),
            restored=sum(r.restored for r in reports.values()),
            ignored=dict(ignored),
            skipped=sum(r.skipped for r in reports.values()),
            processes=len(children),
            retired=sum(r.retired for r in reports.values()),
        )
    finally:
        reported = len(reports) == len(children)
        for child in children:
            if reported and child.pid is not None:
                child.join(timeout=10)  # it has reported: it is flushing its queue and exiting
            if child.is_alive():
                child.terminate()  # on failure, or a child that hangs on its way out
            if child.pid is not None:
                child.join(timeout=30)
        messages.close()


def _child(job: _Job, ends: dict[int, int], index: int, messages: Any, parent: int) -> None:
    """A rebuild process: its partitions, reported through `messages`."""
    _die_with(parent)
    # The parent's signal handlers are not this process's: `terminate()` must just end it.
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the parent, which stops us
    # What was inherited from the parent stays out of this process's collections (and its
    # memory pages shared): only what the rebuild makes is ever traversed.
    gc.freeze()
    try:
        report = job.run(
            ends,
            lambda read: messages.put(("progress", index, read)),
            lambda more: messages.put(("grow", index, more)),
        )
        messages.put(("report", index, report))
    except BaseException as e:  # handed to the parent, which raises it
        failure = e if isinstance(e, MilpaError) else BackendError(f"{type(e).__name__}: {e}")
        messages.put(("error", index, failure))
    finally:
        messages.close()
        messages.join_thread()  # the messages are sent before the process ends


_PR_SET_PDEATHSIG: Final = 1


def _die_with(parent: int) -> None:
    """Have the kernel kill this process when `parent` ends, however it ends.

    Why: a rebuild whose parent was killed (kill -9, the OOM killer) would otherwise fold on in
    its orphaned children, committing into the projection that the next `replay`, run by an
    operator who sees no rebuild running, clears and rebuilds: their late commits would land on
    its half-built states. `daemon=True` covers only a parent that exits normally. Linux only
    (`prctl`); where it is missing the children end with their partitions, as before.
    """
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # it ended before the request was made
        os._exit(1)


@contextlib.contextmanager
def _bulk_collector() -> Iterator[None]:
    """The collector's thresholds of the worker (`milpa-sessions worker`) while rebuilding.

    A young-generation collection every 1,000,000 net allocations instead of 700, and no full
    collection in practice: everything the rebuild allocates is freed by reference counting, and
    what it keeps (the states) is only ever traversed for nothing. Restored afterwards. (With
    100,000, the young collections alone took about an eighth of a rebuild's time:
    docs/PERFORMANCE.md, "The rebuild's collector".)
    """
    previous = gc.get_threshold()
    gc.set_threshold(1_000_000, 50, 1000)
    try:
        yield
    finally:
        gc.set_threshold(*previous)


def _end_offsets(
    bootstrap: KafkaAccess, topic: str, session_id: str | None
) -> tuple[dict[int, int], int]:
    """partition -> end offset now, of the partitions to rebuild that hold anything, and the
    topic's partition count (LogError)."""
    found: dict[int, int] = {}
    count: list[int] = []

    async def ask() -> None:
        # The partitions from the cluster's metadata, never from a subscription: a consumer
        # unsubscribed while its fetcher runs fails it ("'NoneType' object has no attribute
        # 'assignment'", seen in CI). Asked for all topics: a request that names the topic
        # would create it where the brokers auto-create topics.
        admin = AIOKafkaAdminClient(**bootstrap.aiokafka())
        try:
            try:
                await admin.start()
            except KafkaError as e:
                raise LogError(f"cannot reach Kafka at {bootstrap.bootstrap}: {e}") from e
            described = [t for t in await admin.describe_topics() if t["topic"] == topic]
        finally:
            await admin.close()
        known = {p["partition"] for t in described if not t["error_code"] for p in t["partitions"]}
        if not known:
            raise LogError(f"topic {topic} does not exist")
        partitions = sorted(known)
        async with _consumer(bootstrap) as consumer:
            count.append(len(partitions))
            if session_id is not None:
                partitions = [partition_for(session_id, len(partitions))]
            ends = await consumer.end_offsets([TopicPartition(topic, p) for p in partitions])
            found.update({tp.partition: end for tp, end in ends.items() if end > 0})

    _in_a_thread(ask, f"reading {topic} failed")
    return found, count[0]


@contextlib.asynccontextmanager
async def _consumer(access: KafkaAccess) -> Any:
    consumer = AIOKafkaConsumer(
        **access.aiokafka(),
        group_id=None,
        enable_auto_commit=False,
        auto_offset_reset="earliest",
        # Committed records only: a fenced snapshot writer's aborted ones are never read
        # (`processors.sinks.FencedSnapshotSink`); end offsets are then the last stable ones.
        isolation_level="read_committed",
        fetch_max_bytes=64 * 1024 * 1024,
        max_partition_fetch_bytes=8 * 1024 * 1024,
    )
    try:
        try:
            await consumer.start()
        except KafkaError as e:
            raise LogError(f"cannot reach Kafka at {access.bootstrap}: {e}") from e
        yield consumer
    finally:
        await consumer.stop()


def _in_a_thread(work: Callable[[], Any], failing: str) -> None:
    """Run a coroutine function to its end on a thread with its own loop (whatever the caller's
    thread runs); Kafka errors come back as `LogError`."""
    failure: list[BaseException] = []

    def run() -> None:
        try:
            asyncio.run(work())
        except KafkaError as e:
            failure.append(LogError(f"{failing}: {e}"))
        except BaseException as e:  # handed over to the caller's thread
            failure.append(e)

    thread = threading.Thread(target=run, name="replay-metadata", daemon=True)
    thread.start()
    thread.join()
    if failure:
        raise failure[0]


class _Fetcher:
    """Reads some partitions up to given end offsets, on a thread with its own loop.

    The batches travel to the caller through a bounded queue, so the fetcher runs at most
    `_AHEAD` batches ahead. Kafka failures come out of `batches()` as `LogError`.
    """

    def __init__(
        self,
        bootstrap: KafkaAccess,
        topic: str,
        ends: dict[int, int],
        batch_size: int,
        starts: Mapping[int, int] | None = None,
    ):
        self.bootstrap = bootstrap
        self.topic = topic
        self.ends = {TopicPartition(topic, p): end for p, end in ends.items()}
        self.starts = {TopicPartition(topic, p): at for p, at in (starts or {}).items() if at > 0}
        self.batch_size = batch_size
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=_AHEAD)
        self.silent_s = SILENT_S
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="replay-fetcher", daemon=True)

    def __enter__(self) -> _Fetcher:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        with contextlib.suppress(queue.Empty):
            while True:  # unblock a `put` waiting for room
                self._queue.get_nowait()
        self._thread.join(timeout=30)

    def batches(self) -> Iterator[list[RawRecord]]:
        """Every batch, in the order fetched (each partition's records in log order)."""
        while True:
            try:
                # The fetcher hands something over (a batch, the end, its failure) well within
                # this, or fails itself after `STALL_S` without progress: silent longer, its
                # thread is stuck where it cannot notice (a lock it needs held for ever: in a
                # process forked while another thread held it).
                item = self._queue.get(timeout=self.silent_s)
            except queue.Empty:
                raise LogError(
                    f"reading {self.topic}: the fetcher thread handed nothing over for "
                    f"{self.silent_s:g}s and is stuck (forked while another thread held a lock "
                    "it needs, such as OpenSSL's?)"
                ) from None
            if item is None:
                return
            if isinstance(item, BaseException):
                raise item
            yield item

    def _run(self) -> None:
        try:
            asyncio.run(self._fetch())
        except KafkaError as e:
            self._put(LogError(f"reading {self.topic} failed: {e}"))
        except BaseException as e:  # handed over to the caller's thread
            self._put(e)

    def _put(self, item: object) -> bool:
        """Queue an item, giving up when the caller has stopped listening."""
        while not self._stop.is_set():
            with contextlib.suppress(queue.Full):
                self._queue.put(item, timeout=0.1)
                return True
        return False

    async def _fetch(self) -> None:
        async with _consumer(self.bootstrap) as consumer:
            consumer.assign(list(self.ends))
            await self._bounded(consumer.seek_to_beginning(*self.ends), "finding the beginning")
            for tp, at in self.starts.items():  # after a checkpoint: what is before is covered
                if tp in self.ends:
                    consumer.seek(tp, at)
            positions = {
                tp: await self._bounded(consumer.position(tp), f"finding {tp}'s position")
                for tp in self.ends
            }
            remaining = {tp: end for tp, end in self.ends.items() if positions[tp] < end}
            loop = asyncio.get_running_loop()
            moved_at = loop.time()
            while remaining and not self._stop.is_set():
                if loop.time() - moved_at > STALL_S:
                    left = {tp.partition: (positions[tp], end) for tp, end in remaining.items()}
                    raise LogError(
                        f"reading {self.topic} got no further for {STALL_S:g}s with records left "
                        f"(partition: (position, end) {left}): is every partition led?"
                    )
                fetched = await consumer.getmany(
                    *remaining, timeout_ms=1000, max_records=self.batch_size
                )
                batch: list[RawRecord] = []
                for tp, messages in fetched.items():
                    end = remaining.get(tp)
                    if end is not None:
                        batch.extend(
                            (tp.partition, m.offset, m.key, m.value)
                            for m in messages
                            if m.offset < end
                        )
                # Every partition's position, not only those that returned records: one whose
                # last records were an aborted transaction (a fenced snapshot writer's) gets
                # past them with none to show.
                for tp, end in list(remaining.items()):
                    at = await self._bounded(consumer.position(tp), f"finding {tp}'s position")
                    if at != positions[tp]:
                        positions[tp], moved_at = at, loop.time()
                    if at >= end:
                        del remaining[tp]
                        consumer.pause(tp)  # what was appended since the start is not rebuilt
                if batch:
                    if not self._put(batch):
                        return
                    moved_at = loop.time()  # (a wait for the fold to take it is no stall)
        self._put(None)

    async def _bounded(self, step: Awaitable[T], what: str) -> T:
        """`step`, or LogError after `STALL_S` (aiokafka may retry it for ever)."""
        try:
            return await asyncio.wait_for(step, STALL_S)
        except TimeoutError as e:
            raise LogError(f"reading {self.topic}: {what} took over {STALL_S:g}s") from e
