"""Rebuilding the projections while the workers serve them: a new generation, then a switch.

Every key of a partition is in one generation (`projections.keys`: `<prefix>:g<n>:{<tag>}...`,
generation 0 without the `g<n>:`), named by the partition's generation hash, which lives in the
partition's hash slot. A live rebuild:

1. writes the next generation beside the current one, from the snapshots and the topic, as
   `replay` does (`processors.replay`), while the workers go on committing in the current one;
2. catches up: folds what the topic received meanwhile into the new generation, and tries to
   move each partition over with `lua/switch.lua`, which succeeds only if the new generation has
   committed at least as far in that partition as the current one (the commit script keeps
   each generation's highest offset committed). The script runs in the partition's slot, so it
   is atomic with the workers' commits there: from the switch on, a worker's commit in the old
   generation is refused (it answers 3), the worker reads the generations again and folds the
   refused sessions onto their states in the new generation (their marks tell what is applied);
3. once every partition moved, waits for readers that resolved the old generation just before
   (they read the generations again at most every `GENERATIONS_TTL_S`) and drops it.

Readers only ever read a generation that a partition's hash names, so they see the old
projection or the new one, never a half-built one. Counters and indexes are rebuilt with the
rest: the new generation's are exact by construction.

One live rebuild at a time: each holds a lease in Redis (`lua/lease.lua`), renewed by a thread
while it runs (guarded, so that the first pass still forks its processes: `ForkGuard`), and
refuses to start (`RebuildInProgressError`) while another holds it; a plain
`replay` refuses too. A rebuild that loses its lease (it stalled longer than the lease lives)
stops before its next move. A rebuild killed outright leaves the lease to lapse after
`LEASE_TTL_S`.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Final

from processors.replay import (
    BATCH_RECORDS,
    CACHE_LIMIT,
    ForkGuard,
    Progress,
    ReplayReport,
    end_offsets,
    fold_range,
    replay,
)
from producers.kafka_access import KafkaAccess
from projections.keys import Keys
from projections.redis_store import GENERATIONS_TTL_S, RedisProjectionStore
from schemas.errors import BackendError, MilpaError, RebuildInProgressError
from session_model.authority import Cutover
from session_model.modes import Mode
from session_model.signing import TrustedKeys

log = logging.getLogger("milpa_sessions.replay")

_MAX_ROUNDS: Final = 200  # catch-up rounds before a rebuild that cannot keep up gives up
_ROUND_PAUSE_S: Final = 0.05
LEASE_TTL_S: Final = 30.0  # how long a rebuild's lease outlives its last renewal


@dataclass(frozen=True, slots=True)
class LiveReport:
    """A live rebuild: the generation it built, its first pass, what it folded catching up, in
    how many rounds, and how many keys of the old generation(s) it dropped."""

    generation: int
    first_pass: ReplayReport
    caught_up: int
    rounds: int
    dropped: int


def rebuild_live(
    bootstrap: str | KafkaAccess,
    topic: str,
    store: RedisProjectionStore,
    keys: TrustedKeys,
    *,
    start_mode: Mode = Mode.ASK,
    cutover: Cutover | None = None,
    snapshots_topic: str | None = None,
    progress: Progress | None = None,
    batch_size: int = BATCH_RECORDS,
    grace_s: float = 2 * GENERATIONS_TTL_S,
    processes: int | None = None,
    cache_limit: int = CACHE_LIMIT,
) -> LiveReport:
    """Rebuild every projection into the next generation while the workers serve the current
    one, move each partition over once the new one has caught up, and drop the old one
    (`RebuildInProgressError` while another live rebuild runs). `processes`: of the first pass,
    as `processors.replay.replay` takes it."""
    with _lease(store, LEASE_TTL_S) as (lost, guard):
        return _rebuild(
            bootstrap,
            topic,
            store,
            keys,
            lost,
            guard=guard,
            start_mode=start_mode,
            cutover=cutover,
            snapshots_topic=snapshots_topic,
            progress=progress,
            batch_size=batch_size,
            grace_s=grace_s,
            processes=processes,
            cache_limit=cache_limit,
        )


@contextmanager
def _lease(
    store: RedisProjectionStore, ttl_s: float
) -> Iterator[tuple[threading.Event, ForkGuard]]:
    """Hold the rebuild lease while the block runs; the event is set if it was lost. The
    renewing thread holds the guard's lock while it renews (and logs)."""
    token, ttl_ms = uuid.uuid4().hex, int(ttl_s * 1000)
    if not store.lease(token, ttl_ms, "take"):
        raise RebuildInProgressError(
            "another live rebuild of these projections is under way (it holds the rebuild "
            f"lease {store.keys.rebuild_lease()}); wait for it to end"
        )
    lost, done, lock = threading.Event(), threading.Event(), threading.Lock()

    def renew() -> None:
        while not done.wait(ttl_s / 3):
            with lock:
                try:
                    held = store.lease(token, ttl_ms, "renew")
                except MilpaError as e:  # Redis away for a moment: try again before it lapses
                    log.warning("live rebuild: renewing the lease failed: %s", e)
                    continue
                except Exception:  # the lease would lapse unrenewed: the rebuild must stop
                    log.exception("live rebuild: renewing the lease failed")
                    held = False
            if not held:
                lost.set()
                return

    renewer = threading.Thread(target=renew, name="rebuild-lease", daemon=True)
    guard = ForkGuard(lock, (renewer,))
    renewer.start()
    try:
        yield lost, guard
    finally:
        done.set()
        renewer.join()
        try:
            store.lease(token, ttl_ms, "give")
        except MilpaError as e:  # it lapses by itself
            log.warning("live rebuild: giving the lease back failed: %s", e)


def _rebuild(
    bootstrap: str | KafkaAccess,
    topic: str,
    store: RedisProjectionStore,
    keys: TrustedKeys,
    lost: threading.Event,
    *,
    guard: ForkGuard,
    start_mode: Mode,
    cutover: Cutover | None,
    snapshots_topic: str | None,
    progress: Progress | None,
    batch_size: int,
    grace_s: float,
    processes: int | None,
    cache_limit: int,
) -> LiveReport:
    access = KafkaAccess.of(bootstrap)
    _, partitions = end_offsets(access, topic)
    store = dataclasses.replace(store, keys=Keys(store.keys.prefix, partitions=partitions))
    current = store.refresh_generations()
    new = max(current) + 1
    target = dataclasses.replace(
        store, keys=store.keys.in_generations((new,) * partitions), follow=False
    )
    target.drop_generation(new)  # what an earlier attempt that died left there
    log.info("live rebuild: generation %d, the partitions are in %s", new, sorted(set(current)))
    first = replay(
        access,
        topic,
        target,
        keys,
        progress=progress,
        start_mode=start_mode,
        cutover=cutover,
        snapshots_topic=snapshots_topic,
        batch_size=batch_size,
        clear=False,
        fork_guard=guard,
        processes=processes,
        cache_limit=cache_limit,
    )
    read = {p: first.ends.get(p, 0) for p in range(partitions)}
    pending = set(range(partitions))
    caught, rounds = 0, 0
    while pending:
        rounds += 1
        if rounds > _MAX_ROUNDS:
            raise BackendError(
                f"live rebuild: partitions {sorted(pending)} still behind the workers after "
                f"{_MAX_ROUNDS} rounds; generation {new} is left for the next attempt to drop"
            )
        ends, _ = end_offsets(access, topic)
        more = fold_range(
            access,
            topic,
            target,
            keys,
            starts=read,
            ends={p: ends.get(p, 0) for p in pending},
            partitions=partitions,
            start_mode=start_mode,
            cutover=cutover,
            batch_size=batch_size,
            cache_limit=cache_limit,
        )
        caught += more.records
        for p in pending:
            read[p] = max(read[p], ends.get(p, 0))
        if lost.is_set():
            raise RebuildInProgressError(
                f"live rebuild: lost the rebuild lease; generation {new} is left for the next "
                "attempt to drop"
            )
        for p in sorted(pending):
            moved = target.switch_generation(p, current[p], new)
            if moved == 1:
                pending.discard(p)
            elif moved == -1:
                raise BackendError(
                    f"live rebuild: partition {p} left generation {current[p]} meanwhile "
                    "(another rebuild?)"
                )
        if pending:
            time.sleep(_ROUND_PAUSE_S)
    log.info("live rebuild: every partition in generation %d after %d round(s)", new, rounds)
    time.sleep(grace_s)  # readers that resolved the old generation just before finish with it
    dropped = sum(store.drop_generation(g) for g in sorted(set(current)))
    return LiveReport(new, first, caught, rounds, dropped)
