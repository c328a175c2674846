"""The CPU calibration figure: how fast this machine runs the pure fold, measured at the start of
every run, so figures taken on machines of different single-core speed can be compared."""

from __future__ import annotations

import time

from bench import workload
from bench.figures.common import Run
from session_model.projection import BatchFolder, Position, Record

SESSIONS = 1_000  # x 19 events: about a second of folding on the reference machine
ROUNDS = 3


def calibration(run: Run) -> None:
    """The pure fold (decode excluded: records are already events) of a fixed, seeded workload of
    signed sessions, in the harness process, one core, no I/O: events/s, best of three rounds."""
    work = workload.sessions_workload(SESSIONS, "calibration", 250, partitions=1)
    records = [Record(e, Position(0, i)) for i, e in enumerate(work.events)]
    folder = BatchFolder(workload.OPERATOR_KEYS)
    best = float("inf")
    for _ in range(ROUNDS):
        t = time.perf_counter()
        for at in range(0, len(records), 4_000):
            folder.fold({}, records[at : at + 4_000])
        best = min(best, time.perf_counter() - t)
    rate = len(records) / best
    run.calibration = rate
    run.log(f"calibration: the pure fold runs {rate:,.0f} events/s on one core here")
    run.put(
        "cpu_calibration_fold_events_per_s",
        rate,
        "events/s",
        params={
            "what": "BatchFolder.fold of a fixed seeded workload (19 events per session, grants "
            "and relaxed modes signed: Ed25519 verification included), batches of 4,000 from "
            "empty states, in the harness process",
            "events": len(records),
            "rounds": ROUNDS,
            "statistic": "best round",
            "use": "divide a throughput figure by this one to compare runs on machines of "
            "different single-core speed",
        },
    )
