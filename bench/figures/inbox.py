"""The inbox figure: how long the waiting-questions query takes with 100k questions waiting."""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta

from bench import infra
from bench.figures.common import TARGETS, Run
from bench.stats import summary
from projections.redis_store import RedisProjectionStore
from schemas import events as ev
from schemas.events import Event
from session_model.partitioning import partition_for
from session_model.projection import BatchFolder, Position, Record
from session_model.questions import Cursor

REASONS = ("permission", "signature", "target_not_named", "budget", "unspecified")


def inbox(run: Run) -> None:
    """100k waiting questions (5 reasons, spread deadlines), committed by the real commit script;
    then the inbox's queries, each timed `samples` times: the first page of 50, a page of one
    reason, a page deep in the list (by cursor), and the counts by reason. Baseline: one plain
    ZRANGE of 50 on one partition's zset (a Redis round trip for a page, without the merge)."""
    n, samples = run.sizes.inbox_waiting, run.sizes.inbox_samples
    settings = run.settings("inbox")
    infra.register_prefix(settings, run.cleanup)
    client = run.redis()
    keys = settings.redis_keys()
    store = RedisProjectionStore(client, keys)
    t = time.perf_counter()
    _fill(store, settings.partitions, n, run.tag)
    run.log(f"inbox: {n} waiting questions committed in {time.perf_counter() - t:.1f}s")
    assert store.waiting(limit=1).total == n, "the fill left a different number waiting"
    deep = store.waiting(limit=500)
    for _ in range(n // 1000):  # half way down the list
        if deep.next is None:
            break
        deep = store.waiting(after=deep.next, limit=500)
    middle = deep.next or Cursor(0, "")

    def timed(call: Callable[[], object]) -> list[float]:
        out = []
        for _ in range(samples):
            t0 = time.perf_counter()
            call()
            out.append((time.perf_counter() - t0) * 1000)
        return out

    first = summary(timed(lambda: store.waiting(limit=50)))
    reason = summary(timed(lambda: store.waiting(reason="signature", limit=50)))
    middle_page = summary(timed(lambda: store.waiting(after=middle, limit=50)))
    counts = summary(timed(store.waiting_by_reason))
    base = summary(timed(lambda: client.zrange(keys.waiting(0), 0, 49, withscores=True)))
    worst = max(first["p99"] or 0, reason["p99"] or 0, middle_page["p99"] or 0)
    run.log(f"inbox: first page p99 {first['p99']:.2f} ms, worst of the pages {worst:.2f} ms")
    run.put(
        "inbox_page_p99_ms",
        worst,
        "ms",
        baseline=base["p99"],
        target=TARGETS["inbox_p99"],
        params={
            "waiting": n,
            "partitions": settings.partitions,
            "page": 50,
            "samples_per_query": samples,
            "value": "the worst p99 of the three page queries below",
            "first_page_ms": first,
            "one_reason_page_ms": reason,
            "middle_page_by_cursor_ms": middle_page,
            "counts_by_reason_ms": counts,
            "baseline": "ZRANGE 0 49 WITHSCORES of one partition's waiting zset (one round trip)",
            "client": "redis-py (hiredis), synchronous, on loopback",
        },
    )


def _fill(store: RedisProjectionStore, partitions: int, n: int, tag: str) -> None:
    """Start and ask in `n` sessions, committed 1000 sessions at a time."""
    folder = BatchFolder()
    now = datetime.now(UTC)
    offsets = dict.fromkeys(range(partitions), 0)
    batch: list[Record] = []

    def add(e: Event) -> None:
        p = partition_for(e.session_id, partitions)
        batch.append(Record(e, Position(p, offsets[p])))
        offsets[p] += 1

    for i in range(n):
        sid = f"inbox-{tag}-{i:06d}"
        deadline = (now + timedelta(seconds=60 + (i * 7919) % 86_400)).isoformat()
        add(Event(f"{sid}-1", sid, ev.STARTED, now, "bench", {"goal": f"goal {i}", "mode": "ask"}))
        payload = {
            "question_id": f"q{i}",
            "question": f"May I run step {i}?",
            "options": ["yes", "no"],
            "why": "the bench asks",
            "expires_at": deadline if i % 10 else None,
            "reason": REASONS[i % len(REASONS)],
        }
        add(Event(f"{sid}-2", sid, ev.QUESTION_ASKED, now, "bench", payload))
        if len(batch) >= 2000:
            _commit(store, folder, batch)
    _commit(store, folder, batch)


def _commit(store: RedisProjectionStore, folder: BatchFolder, batch: list[Record]) -> None:
    if batch and store.commit(folder.fold({}, batch)).conflicts:
        raise RuntimeError("inbox fill: a commit was refused")
    batch.clear()
