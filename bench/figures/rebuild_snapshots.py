"""The rebuild from snapshots (#15 item 4): `replay` of a topic of long sessions starting from
their snapshots, against `replay --full` of the same topic, in the same figure.

The topic: `snapshot_rebuild_sessions` long sessions of `snapshot_rebuild_events` agent events
each (with their compactions; `projector_long.long_fleet`), 2M events in the full run. Its first
95 % is rebuilt (untimed) and snapshotted as a rebuild does at its end (`wiring.take_snapshots`:
the snapshot rounds the worker runs, timed apart); then the last 5 % is appended, so the rebuild
from snapshots restores every session and folds that tail. Both rebuilds run as the `replay`
command runs them (its store, forked processes); the result of each is checked on a sample of
sessions against the other.
"""

from __future__ import annotations

import time

import redis

from bench import infra, workload
from bench.figures.common import TARGETS, Run, produce_all
from bench.figures.projector_long import long_fleet
from bench.stats import rate, ratio
from milpa_sessions import wiring
from processors.replay import replay
from producers.kafka_log import KafkaEventLog
from session_model.compaction import Compactor

HEAD = 0.95  # of the topic snapshotted before the tail is appended


def rebuild_snapshots(run: Run) -> None:
    """How many times faster the rebuild from snapshots is than the full one (target ≥ 5×)."""
    s = run.sizes
    settings = run.settings("snaprebuild")
    infra.create_topics(settings, run.cleanup)
    infra.register_prefix(settings, run.cleanup)
    compactor = Compactor(settings.compactor_max_turns, settings.compactor_keep_recent)
    t = time.perf_counter()
    fleet = long_fleet(
        s.snapshot_rebuild_sessions,
        s.snapshot_rebuild_events,
        f"r{run.tag}",
        compactor,
        partitions=settings.partitions,
    )
    cut = int(len(fleet.events) * HEAD)
    head, tail = fleet.events[:cut], fleet.events[cut:]
    run.log(
        f"snapshot rebuild: {len(fleet.events)} events generated in {time.perf_counter() - t:.0f}s"
    )
    keys = workload.OPERATOR_KEYS
    access = settings.kafka_access()
    with KafkaEventLog(access, settings.events_topic) as log:
        produce_all(log, head)
        store = wiring.projection_store_for_rebuild(settings)
        built = replay(access, settings.events_topic, store, keys)  # untimed: what to snapshot
        started = time.perf_counter()
        taken = wiring.take_snapshots(settings, built.applied_through(), built.trust)
        snapshot_s = time.perf_counter() - started
        produce_all(log, tail)
    sample = fleet.sessions[:: max(len(fleet.sessions) // 20, 1)]
    # Redis's own CPU figure (INFO) from one server; on a cluster the meter counts the nodes.
    redis_info = store.client if isinstance(store.client, redis.Redis) else None

    cpu = run.cpu({}, redis_info)
    cpu.start()
    started = time.perf_counter()
    fast = replay(
        access, settings.events_topic, store, keys, snapshots_topic=settings.snapshots_topic
    )
    with_s = time.perf_counter() - started
    with_usage = cpu.stop()
    first = {sid: store.load(sid) for sid in sample}

    cpu = run.cpu({}, redis_info)
    cpu.start()
    started = time.perf_counter()
    full = replay(access, settings.events_topic, store, keys)
    without_s = time.perf_counter() - started
    without_usage = cpu.stop()
    same = all(store.load(sid) == first[sid] for sid in sample)
    store.client.close()
    run.log(
        f"snapshot rebuild: {full.records} records in {without_s:.1f}s whole, "
        f"{fast.restored} sessions restored + {fast.records} records in {with_s:.1f}s"
    )
    params = {
        "events_in_topic": len(fleet.events),
        "sessions": len(fleet.sessions),
        "agent_events_per_session": s.snapshot_rebuild_events,
        "compactions_in_topic": fleet.compactions,
        "snapshotted_through": f"the first {HEAD:.0%} of the topic ({len(head)} events)",
        "snapshots_taken": taken,
        "snapshot_rounds_seconds": round(snapshot_s, 2),
        "with_snapshots_seconds": round(with_s, 2),
        "with_snapshots_records_read": fast.records,
        "with_snapshots_restored": fast.restored,
        "with_snapshots_ignored": dict(fast.ignored),
        "without_snapshots_seconds": round(without_s, 2),
        "without_snapshots_events_per_s": rate(full.records, without_s),
        "sample_states_equal": same,
        "what": "processors.replay.replay as `milpa-sessions replay` runs it (its store, "
        "forked processes), timed from the call to its return; the same topic both times",
        "with_usage": with_usage,
        **without_usage,
    }
    if not same:
        params["error"] = "the rebuild from snapshots differs from the full one on the sample"
    run.put(
        "rebuild_snapshots_speedup",
        ratio(without_s, with_s) if same else None,
        "×",
        target=TARGETS["rebuild_snapshots"],
        params=params,
    )
