"""`python -m bench.fold_micro [--sessions N] [--repeat R] [--gc MODE] [--stream FILE] [--json]`

The per-event CPU cost of the projector's pure half, in-process, without Kafka or Redis. The bench
workload (`bench.workload.sessions_workload`: the events the harness sends, with a fixed clock) is
encoded once (untimed) and laid out as the topic holds it; then every batch of B consecutive
records of one partition goes through what the worker and the replay do with it, each step timed
on its own:

- `decode`: `EventCodec.decode` of every record value, into `Record`s;
- `fold`: `BatchFolder.fold` onto the states the previous batches left (the cache the worker and
  the replay keep), and the cache update;
- `commit_args`: `projections.redis_store.commit_call` of every update: state JSON, turns, the
  timeline entries (`SessionUpdate.timeline`) and their JSON, indexes, counters — the rest of the
  worker's per-event work before Redis.

Only a batch's records and updates are alive at a time, plus the cache, as in the worker. `--gc`
sets the collector as CPython does (`default`), the worker (`worker`: milpa_sessions/cli.py), the
rebuild (`rebuild`: processors/replay.py), or turns it `off`. Each of R runs starts from an empty
cache; the best run is reported (µs per event) with the median and the worst (`--json`: one line).
"""

from __future__ import annotations

import argparse
import gc
import json
import pickle
import statistics
import sys
import time
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from bench.workload import OPERATOR_KEYS, sessions_workload
from projections.keys import Keys
from projections.requests import commit_call
from schemas.codec import EventCodec
from session_model.partitioning import partition_for
from session_model.projection import BatchFolder, Folded, Position, Record

PARTITIONS = 6
PHASES = ("decode", "fold", "commit_args")
GC_MODES = ("default", "worker", "rebuild", "off")
# A fixed clock: the same events, byte for byte, in every run.
BASE = datetime(2025, 1, 1, tzinfo=UTC)

Raw = tuple[int, int, bytes]


def encoded_stream(sessions: int) -> list[Raw]:
    """The workload as the topic holds it: (partition, offset, value), partition by partition."""
    work = sessions_workload(sessions, "micro", base=BASE, partitions=PARTITIONS)
    codec = EventCodec()
    logs: dict[int, list[bytes]] = {p: [] for p in range(PARTITIONS)}
    for e in work.events:
        logs[partition_for(e.session_id, PARTITIONS)].append(codec.encode(e))
    return [(p, offset, value) for p, values in logs.items() for offset, value in enumerate(values)]


def batches(raws: Sequence[Raw], size: int) -> list[list[Raw]]:
    """Consecutive records of one partition, at most `size` per batch (as the worker gets them).

    The partitions are interleaved batch by batch, as a consumer of several partitions sees them.
    """
    per_partition: dict[int, list[list[Raw]]] = {}
    for raw in raws:
        chunks = per_partition.setdefault(raw[0], [[]])
        if len(chunks[-1]) == size:
            chunks.append([])
        chunks[-1].append(raw)
    rounds = max(len(c) for c in per_partition.values())
    return [c[i] for i in range(rounds) for c in per_partition.values() if i < len(c)]


def run_once(chunks: Sequence[Sequence[Raw]], phases: Sequence[str]) -> dict[str, float]:
    """Seconds spent in each phase over the whole stream, from an empty cache."""
    codec = EventCodec()
    folder = BatchFolder(OPERATOR_KEYS)
    keys = Keys("micro", partitions=PARTITIONS)
    cache: dict[str, Folded] = {}
    spent = dict.fromkeys(phases, 0.0)
    args = "commit_args" in phases
    # CPU time of this thread: another process taking the core does not count (on this shared
    # two-core machine the wall clock varied twice as much); what it does to caches still does.
    clock = time.thread_time
    for chunk in chunks:
        t0 = clock()
        records = [Record(codec.decode(v), Position(p, o)) for p, o, v in chunk]
        t1 = clock()
        updates = folder.fold(cache, records)
        for u in updates:
            cache[u.session_id] = Folded(u.state, u.mark)
        t2 = clock()
        if args:
            for u in updates:
                commit_call(keys, u, None)
        t3 = clock()
        spent["decode"] += t1 - t0
        spent["fold"] += t2 - t1
        if args:
            spent["commit_args"] += t3 - t2
    return spent


def load_stream(sessions: int, path: Path | None) -> list[Raw]:
    """The encoded stream: from `path` if saved there for this size, else built (and saved)."""
    if path is not None and path.exists():
        saved = pickle.loads(path.read_bytes())
        if saved["sessions"] == sessions:
            return list(saved["raws"])
    raws = encoded_stream(sessions)
    if path is not None:
        path.write_bytes(pickle.dumps({"sessions": sessions, "raws": raws}))
    return raws


def measure(
    raws: Sequence[Raw], sessions: int, repeat: int, batch: int, *, gc_mode: str, args: bool
) -> dict[str, Any]:
    """µs per event of every phase, best of `repeat` runs."""
    chunks = batches(raws, batch)
    phases = PHASES if args else PHASES[:2]
    gc.collect()
    if gc_mode == "worker":  # milpa_sessions/cli.py, `worker`
        gc.freeze()
        gc.set_threshold(1_000_000, 20, 100)
    elif gc_mode == "rebuild":  # processors/replay.py, `_bulk_collector`
        gc.freeze()
        gc.set_threshold(1_000_000, 50, 1000)
    elif gc_mode == "off":
        gc.disable()
    runs = []
    for _ in range(repeat):
        runs.append(run_once(chunks, phases))
        gc.collect()  # the previous run's cache, out of the next run's way
    n = len(raws)
    out: dict[str, Any] = {
        "events": n,
        "sessions": sessions,
        "batch": batch,
        "repeat": repeat,
        "gc": gc_mode,
    }
    for phase in phases:
        us = [r[phase] / n * 1e6 for r in runs]
        out[phase] = {
            "best_us": round(min(us), 2),
            "median_us": round(statistics.median(us), 2),
            "worst_us": round(max(us), 2),
        }
    both = [(r["decode"] + r["fold"]) / n * 1e6 for r in runs]
    out["decode_plus_fold_us"] = round(min(both), 2)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    """Measure and print."""
    parser = argparse.ArgumentParser(
        prog="python -m bench.fold_micro",
        description="Per-event CPU of decode, fold and commit arguments (see the module doc).",
    )
    parser.add_argument("--sessions", type=int, default=4000, help="19 events each (default 4000)")
    parser.add_argument("--repeat", type=int, default=5, help="runs; the best is reported")
    parser.add_argument("--batch", type=int, default=500, help="records per batch (default 500)")
    parser.add_argument("--gc", choices=GC_MODES, default="default", help="collector settings")
    parser.add_argument("--no-args", action="store_true", help="skip the commit-arguments phase")
    parser.add_argument("--json", action="store_true", help="one JSON line instead of a table")
    parser.add_argument(
        "--stream",
        type=Path,
        help="keep the encoded workload in this file (generating it takes ~20 s); reused when "
        "it holds the same number of sessions. Only for files this tool wrote (pickle).",
    )
    args = parser.parse_args(argv)
    raws = load_stream(args.sessions, args.stream)
    result = measure(
        raws, args.sessions, args.repeat, args.batch, gc_mode=args.gc, args=not args.no_args
    )
    if args.json:
        print(json.dumps(result))
        return 0
    print(
        f"{result['events']} events, {result['sessions']} sessions, batches of {args.batch}, "
        f"gc {args.gc}, best of {args.repeat}"
    )
    print(f"{'phase':<12} {'best µs/ev':>11} {'median':>8} {'worst':>8}")
    for phase in PHASES:
        if phase in result:
            r = result[phase]
            print(f"{phase:<12} {r['best_us']:>11.2f} {r['median_us']:>8.2f} {r['worst_us']:>8.2f}")
    print(f"decode + fold: {result['decode_plus_fold_us']:.2f} µs/event (best run)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
