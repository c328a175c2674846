"""The memory figure: Redis memory of idle sessions through the real commit path."""

from __future__ import annotations

import collections
import time

import redis

from bench import infra, workload
from bench.figures.common import TARGETS, Run
from bench.stats import extrapolate
from deploy.harness import memory_usage
from milpa_sessions.settings import Settings
from projections.codec import STATE_VERSION
from projections.keys import Keys
from projections.layout import stored_sizes
from projections.redis_store import RedisProjectionStore
from schemas.events import Event
from session_model.partitioning import partition_for
from session_model.projection import BatchFolder, Position, Record

GIB = 1024**3


def memory(run: Run) -> None:
    """Redis memory of idle sessions through the real commit path, extrapolated to 1M sessions."""
    n = run.sizes.memory_sessions
    settings = run.settings("memory")
    infra.register_prefix(settings, run.cleanup)
    client = run.redis()
    keys = settings.redis_keys()
    store = RedisProjectionStore(
        client,
        keys,
        compact_after=settings.compactor_max_turns,
        track=settings.snapshot_interval_s > 0,  # as the workers commit by default
    )
    work = workload.idle_sessions(n, f"m{run.tag}")
    per_session = len(work.events) // n
    delta, index_bytes = _fill(client, store, settings, work.events)
    # Cross-check: MEMORY USAGE of every key under the prefix, by kind of key.
    by_kind: dict[str, int] = collections.Counter()
    counts: dict[str, int] = collections.Counter()
    for k, used in memory_usage(client, keys.pattern()):
        kind = _key_kind(k.decode(), settings.redis_prefix)
        by_kind[kind] += used
        counts[kind] += 1
    key_sum = sum(by_kind.values())
    held, encodings = _state_hashes(client, keys, work.sessions[:: max(n // 200, 1)])
    entries = sum(h.get("timeline_entries", 0) for h in held)

    def mean(name: str) -> float | None:
        return sum(h[name] for h in held) / len(held) if held else None

    value = extrapolate(delta, n, 1_000_000) / GIB
    run.log(f"memory: {delta / n:.0f} B/session (used_memory), {key_sum / n:.0f} B/session (keys)")
    run.put(
        "redis_gib_per_1m_idle_sessions",
        value,
        "GiB",
        target=TARGETS["memory"],
        params={
            "sessions_measured": n,
            "events_per_session": per_session,
            "session": "started + plan_set + todo_changed (no turns, no open question)",
            "session_id_chars": len(work.sessions[0]),
            "key_name_chars": len(keys.session(work.sessions[0]).state),
            "excluding_turns": "no turn was written: no session has a turns list "
            f"({counts.get('turns', 0)} turns keys found)",
            "method": "INFO memory used_memory after − before the fill, / sessions × 1M",
            "used_memory_delta_bytes": delta,
            "bytes_per_session": delta / n,
            "key_memory_usage_bytes_per_session": key_sum / n,
            "key_memory_usage_gib_per_1m": extrapolate(key_sum, n, 1_000_000) / GIB,
            "bytes_per_session_by_key": {k: v / n for k, v in sorted(by_kind.items())},
            "layout": f"{STATE_VERSION}: one state hash per session holding state, event ids "
            "and timeline in chunks (projections/layout.py)",
            "state_hash_encodings": dict(sorted(encodings.items())),
            "state_hash_fields_mean": mean("fields"),
            "state_bytes_mean": mean("state"),
            "event_ids_bytes_mean": mean("event_ids"),
            "timeline_bytes_mean": mean("timeline"),
            "timeline_entry_bytes_mean": (sum(h["timeline"] for h in held) - entries) / entries
            if entries
            else None,
            "keys_by_kind": dict(sorted(counts.items())),
            "unsnapshotted_index_bytes_per_session": index_bytes / n,
            "unsnapshotted_index": "the sessions' entries in their partitions' unsnapshotted "
            "index, dropped before the measurement: a snapshot round removes an idle session "
            "from it (a session active since the last round stays there until the next)",
            "fill": "RedisProjectionStore.commit of BatchFolder updates (the real commit "
            "script), 500 sessions per pipelined commit, no Kafka",
        },
    )


def _key_kind(key: str, prefix: str) -> str:
    rest = key[len(prefix) + 1 :]
    if rest.startswith("{s:"):
        return rest.rsplit(":", 1)[-1]
    return rest.split(":", 1)[0] if ":" in rest else rest


def _fill(
    client: redis.Redis, store: RedisProjectionStore, settings: Settings, events: list[Event]
) -> tuple[int, int]:
    """Commit the sessions' folded events, 500 sessions a commit; bytes of used_memory added,
    and what the unsnapshotted index held before it was dropped."""
    keys = store.keys
    folder = BatchFolder(workload.OPERATOR_KEYS)
    partitions = settings.partitions
    offsets = dict.fromkeys(range(partitions), 0)
    records = []
    for e in events:
        p = partition_for(e.session_id, partitions)
        records.append(Record(e, Position(p, offsets[p])))
        offsets[p] += 1
    time.sleep(0.2)
    before = int(client.info("memory")["used_memory"])
    size = 3 * 500  # 500 sessions per commit, each with its three events
    for i in range(0, len(records), size):
        result = store.commit(folder.fold({}, records[i : i + size]))
        if result.conflicts:
            raise RuntimeError("memory fill: a commit was refused")
    # An idle session is out of its partition's unsnapshotted index once a snapshot round took
    # it (`processors.snapshots`); no round runs here, so the index is measured and dropped.
    index = [keys.unsnapshotted(p) for p in range(partitions)]
    index_bytes = sum(client.memory_usage(k, samples=0) or 0 for k in index)
    client.unlink(*index)
    time.sleep(0.2)
    after = int(client.info("memory")["used_memory"])
    return after - before, index_bytes


def _state_hashes(
    client: redis.Redis, keys: Keys, sample: list[str]
) -> tuple[list[dict[str, int]], collections.Counter[str]]:
    """What these sessions' state hashes hold, and their encodings (layout: redis_store.py)."""
    pipe = client.pipeline(transaction=False)
    for sid in sample:
        pipe.hgetall(keys.session(sid).state)
        pipe.object("encoding", keys.session(sid).state)
    replies = pipe.execute()
    held = [stored_sizes(r) for r in replies[0::2] if r]
    return held, collections.Counter(e.decode() for e in replies[1::2] if e)
