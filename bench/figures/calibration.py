"""The CPU calibration figure: how fast this machine runs the pure fold, measured at the start of
every run, so figures taken on machines of different single-core speed can be compared."""

from __future__ import annotations

import functools
import gc
import time

from bench import workload
from bench.figures.common import Run
from session_model.projection import BatchFolder, Folded, Position, Record

SESSIONS = 1_000  # x 19 events: about a second of folding on the reference machine
ROUNDS = 3


def calibrate() -> tuple[float, int]:
    """The pure fold (decode excluded: records are already events) of a fixed, seeded workload of
    signed sessions, in this process, one core, no I/O: events/s (best of three rounds) and the
    events of a round."""
    records = list(_records())
    folder = BatchFolder(workload.OPERATOR_KEYS)
    best = float("inf")
    # With the worker's collector settings (`milpa-sessions worker`). With CPython's defaults it
    # measured the harness's heap as much as the machine (61k events/s in a fresh process, 85k in
    # one holding the pre-filled topic's events: fewer full collections).
    previous = gc.get_threshold()
    gc.collect()
    gc.freeze()
    gc.set_threshold(1_000_000, 20, 100)
    try:
        for _ in range(ROUNDS):
            t = time.perf_counter()
            fold_all(folder, records)
            best = min(best, time.perf_counter() - t)
    finally:
        gc.set_threshold(*previous)
        gc.unfreeze()
    return len(records) / best, len(records)


@functools.cache
def _records() -> tuple[Record, ...]:
    """The seeded workload, made once per process (the e2e and rebuild figures calibrate again
    around each round; making it signs thousands of acts, untimed but not free)."""
    work = workload.sessions_workload(SESSIONS, "calibration", 250, partitions=1)
    return tuple(Record(e, Position(0, i)) for i, e in enumerate(work.events))


def fold_all(folder: BatchFolder, records: list[Record]) -> dict[str, Folded]:
    """Fold in batches of 4,000, each onto the states the earlier ones left (as the worker does:
    from empty states, half the events were refused as `unknown_session`, a cheaper path)."""
    cache: dict[str, Folded] = {}
    for at in range(0, len(records), 4_000):
        batch = folder.fold(cache, records[at : at + 4_000])
        cache.update((u.session_id, Folded(u.state, u.mark)) for u in batch)
    return cache


def calibration(run: Run) -> None:
    """`calibrate()` at the start of the run: the reference of the figures measured against it."""
    rate, events = calibrate()
    run.calibration = rate
    run.log(f"calibration: the pure fold runs {rate:,.0f} events/s on one core here")
    run.put(
        "cpu_calibration_fold_events_per_s",
        rate,
        "events/s",
        params={
            "what": "BatchFolder.fold of a seeded workload (19 events per session, signed grants "
            "and modes), batches of 4,000 as in fold_all, with the worker's collector settings; "
            "runs before 2026-12-05 folded each batch from empty states (~1.5x higher)",
            "events": events,
            "rounds": ROUNDS,
            "statistic": "best round",
            "use": "divide a throughput figure by this one to compare runs on machines of "
            "different single-core speed",
        },
    )
