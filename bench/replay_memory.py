"""`python -m bench.replay_memory [--sessions N] [--long EVENTS] [--tail F] [--repeat R] [--expire]`

The memory a rebuild from snapshots takes, by the number of sessions it restores. On the local
default stack (`deploy/stack.py up`, or the one this starts), with topics and keys of its own:
`N` sessions of the bench workload (`workload.sessions_workload`, nineteen events each; with
`--long`, long sessions of that many agent events each, `projector_long.long_fleet`) are
produced but the last part `F` of the topic (default 0.05), rebuilt (`replay --full`, untimed)
and snapshotted as `replay` does at its end (`wiring.take_snapshots`); then that part is
produced too. Then `replay` from those snapshots runs in a fresh process, as the command runs
it (its store, forked processes), and that process reports its largest resident set (`VmHWM`)
and its rebuild processes' largest (`ru_maxrss` of its children), with the time the rebuild
took (`--repeat`: that many times, one process each). The topics and keys are removed at the
end.

With `--expire`, the projections keep ended sessions one day (`MILPA_PROJECTION_TTL_S`), and
before the measured rebuild the retention sweep drops every ended session (nine in ten of the
workload's) with a clock ten years on, and a snapshot round replaces their snapshots with stubs,
as a worker's sweep and rounds do. Each line also gives the bytes of the snapshots topic's
latest record per key (what compaction keeps).

What it is for: the rebuild's plan once held every snapshot's state in the parent process, so
its memory grew with the fleet (docs/PERFORMANCE.md, "the rebuild's memory"); and a rebuild
restored every expired session whole until their snapshots became stubs ("retired sessions").
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Mapping
from datetime import UTC, datetime, timedelta
from pathlib import Path

from kafka import KafkaConsumer, TopicPartition

from bench import infra, workload
from bench.figures.common import produce_all
from bench.figures.projector_long import long_fleet
from deploy import harness
from milpa_sessions import wiring
from milpa_sessions.settings import Settings
from processors.replay import replay
from producers.kafka_log import KafkaEventLog
from session_model.compaction import Compactor


def log(line: str) -> None:
    """A progress line, on stderr (stdout carries the result)."""
    print(line, file=sys.stderr, flush=True)


def _settings(stack: harness.Stack, tag: str, keys_dir: Path, expire: bool) -> Settings:
    ttl = 86_400.0 if expire else None
    return infra.figure_settings(
        stack, tag, "replaymem", trusted_keys_dir=keys_dir, projection_ttl_s=ttl
    )


def _expire_all(settings: Settings, applied: Mapping[int, int], trust: str) -> int:
    """Drop every ended session as the sweep does ten years on, then take a round of each
    partition (its stubs); the sessions dropped."""
    store = wiring.projection_store_for_rebuild(settings)
    dropped = 0
    try:
        later = datetime.now(UTC) + timedelta(days=3650)
        while got := store.expire_due(later, limit=10_000):
            dropped += len(got)
    finally:
        store.close()
    wiring.take_snapshots(settings, applied, trust)
    return dropped


def _latest_bytes(settings: Settings) -> int:
    """The bytes of the snapshots topic's latest record per key (what compaction keeps)."""
    consumer = KafkaConsumer(
        **settings.kafka_access().kafka_python(),
        enable_auto_commit=False,
        isolation_level="read_committed",
    )
    try:
        parts = [
            TopicPartition(settings.snapshots_topic, p)
            for p in consumer.partitions_for_topic(settings.snapshots_topic) or ()
        ]
        consumer.assign(parts)
        consumer.seek_to_beginning(*parts)
        ends = consumer.end_offsets(parts)
        latest: dict[bytes, int] = {}
        while any(consumer.position(tp) < end for tp, end in ends.items()):
            for messages in consumer.poll(timeout_ms=500).values():
                for m in messages:
                    if m.key is not None:
                        latest[m.key] = len(m.value or b"")
        return sum(latest.values())
    finally:
        consumer.close()


def _measure(settings: Settings) -> dict[str, object]:
    """`replay` from the snapshots, in this process: its time and peak memory."""
    store = wiring.projection_store_for_rebuild(settings)
    started = time.perf_counter()
    try:
        report = replay(
            settings.kafka_access(),
            settings.events_topic,
            store,
            workload.OPERATOR_KEYS,
            snapshots_topic=settings.snapshots_topic,
        )
    finally:
        store.close()
    seconds = time.perf_counter() - started
    return {
        "restored": report.restored,
        "retired": report.retired,
        "records_read": report.records,
        "ignored": dict(report.ignored),
        "processes": report.processes,
        "seconds": round(seconds, 2),
        "max_rss_mib": _high_water_mib(),
        "largest_child_max_rss_mib": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss // 1024,
    }


def _high_water_mib() -> int:
    """This process's largest resident set (`VmHWM`): unlike `ru_maxrss`, it starts again at
    `exec`, so it is not the parent's size when the parent forked this process."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) // 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def main(argv: list[str] | None = None) -> int:
    """Build the topic and snapshots, then measure the rebuild in a fresh process."""
    parser = argparse.ArgumentParser(prog="python -m bench.replay_memory")
    parser.add_argument("--sessions", type=int, default=40_000)
    parser.add_argument(
        "--long",
        type=int,
        default=0,
        metavar="EVENTS",
        help="long sessions of this many agent events each (the replay_snapshots figure's "
        "kind), instead of the bench's sessions of nineteen",
    )
    parser.add_argument("--repeat", type=int, default=1, help="rebuilds measured, one by one")
    parser.add_argument(
        "--tail", type=float, default=0.05, help="the part of the topic after the snapshots"
    )
    parser.add_argument(
        "--expire",
        action="store_true",
        help="expire the ended sessions and replace their snapshots with stubs first",
    )
    parser.add_argument("--measure-only", metavar="TAG", help=argparse.SUPPRESS)
    parser.add_argument("--keys-dir", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    stack = harness.ensure_stack(log)
    if args.measure_only:
        settings = _settings(stack, args.measure_only, args.keys_dir, args.expire)
        print(json.dumps(_measure(settings)))
        return 0
    cleanup = harness.Cleanup(log)
    tag = uuid.uuid4().hex[:8]
    try:
        with tempfile.TemporaryDirectory() as workdir:
            keys_dir = infra.trusted_keys_dir(Path(workdir), workload.OPERATOR)
            settings = _settings(stack, tag, keys_dir, args.expire)
            infra.create_topics(settings, cleanup)
            infra.register_prefix(settings, cleanup)
            partitions = settings.partitions
            if args.long:
                compactor = Compactor(settings.compactor_max_turns, settings.compactor_keep_recent)
                fleet = long_fleet(args.sessions, args.long, tag, compactor, partitions=partitions)
                produced = fleet.events
            else:
                sessions = workload.sessions_workload(args.sessions, tag, partitions=partitions)
                produced = sessions.events
            access = settings.kafka_access()
            cut = len(produced) - int(len(produced) * args.tail)
            with KafkaEventLog(access, settings.events_topic) as events:
                produce_all(events, produced[:cut])
                store = wiring.projection_store_for_rebuild(settings)
                try:
                    built = replay(access, settings.events_topic, store, workload.OPERATOR_KEYS)
                finally:
                    store.close()
                taken = wiring.take_snapshots(settings, built.applied_through(), built.trust)
                expired = (
                    _expire_all(settings, built.applied_through(), built.trust)
                    if args.expire
                    else 0
                )
                produce_all(events, produced[cut:])
            log(f"{len(produced)} events of {args.sessions} sessions, {taken} snapshots")
            command = [sys.executable, "-m", "bench.replay_memory", "--measure-only", tag]
            command += ["--keys-dir", str(keys_dir), *(["--expire"] if args.expire else [])]
            head = {
                "sessions": args.sessions,
                "snapshots": taken,
                "expired": expired,
                "snapshot_topic_bytes": _latest_bytes(settings),
                "events_after": len(produced) - cut,
            }
            # The stack by its address: the measuring process starts nothing (a stack started
            # there would count among its children).
            env = {
                **os.environ,
                "MILPA_KAFKA_BOOTSTRAP": stack.kafka_bootstrap,
                "MILPA_REDIS_URL": stack.redis_url,
            }
            for _ in range(args.repeat):
                done = subprocess.run(command, check=True, capture_output=True, text=True, env=env)
                measured = json.loads(done.stdout.strip().splitlines()[-1])
                print(json.dumps({**head, **measured}), flush=True)
    finally:
        cleanup.run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
