"""The CPU calibration figure: how fast this machine runs the pure fold, measured at the start of
every run, so figures taken on machines of different single-core speed can be compared."""

from __future__ import annotations

import gc
import time

from bench import workload
from bench.figures.common import Run
from session_model.projection import BatchFolder, Position, Record

SESSIONS = 1_000  # x 19 events: about a second of folding on the reference machine
ROUNDS = 3


def calibrate() -> tuple[float, int]:
    """The pure fold (decode excluded: records are already events) of a fixed, seeded workload of
    signed sessions, in this process, one core, no I/O: events/s (best of three rounds) and the
    events of a round."""
    work = workload.sessions_workload(SESSIONS, "calibration", 250, partitions=1)
    records = [Record(e, Position(0, i)) for i, e in enumerate(work.events)]
    folder = BatchFolder(workload.OPERATOR_KEYS)
    best = float("inf")
    # With the worker's collector settings (`milpa-sessions worker`: what was there before is
    # frozen, a young collection every 1,000,000 allocations). With CPython's defaults the figure
    # measured the harness's heap as much as the machine: 61k events/s in a fresh process, 85k in
    # one holding the pre-filled topic's events (fewer full collections), 100k either way here.
    previous = gc.get_threshold()
    gc.collect()
    gc.freeze()
    gc.set_threshold(1_000_000, 20, 100)
    try:
        for _ in range(ROUNDS):
            t = time.perf_counter()
            for at in range(0, len(records), 4_000):
                folder.fold({}, records[at : at + 4_000])
            best = min(best, time.perf_counter() - t)
    finally:
        gc.set_threshold(*previous)
        gc.unfreeze()
    return len(records) / best, len(records)


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
            "what": "BatchFolder.fold of a fixed seeded workload (19 events per session, grants "
            "and relaxed modes signed: Ed25519 verification included), batches of 4,000 from "
            "empty states, in the harness process, with the worker's collector settings (since "
            "f10ab58: earlier calibrations, taken with CPython's defaults, were 30-40 % lower "
            "and are not comparable)",
            "events": events,
            "rounds": ROUNDS,
            "statistic": "best round",
            "use": "divide a throughput figure by this one to compare runs on machines of "
            "different single-core speed",
        },
    )
