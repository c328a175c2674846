"""The projector figures: events/s per worker with 1 and 2 workers, against the naive projector
(`bench/naive_projector.py`) and the same run's Redis ceiling (the worker's Redis pattern alone)."""

from __future__ import annotations

import asyncio
import collections
import math
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import redis

from bench import infra, workload
from bench.figures.common import TARGETS, FoldCounter, Prefill, Run, scrape_workers
from bench.figures.consume import consume_ceiling
from bench.stats import cpu_per_event, median_item, rate, ratio
from deploy.host import CpuMeter, PySpy, redis_cpu_seconds
from milpa_sessions.settings import Settings
from producers.topics import delete_topics
from projections import requests, scripts
from projections.keys import Keys
from projections.redis_client import async_client
from projections.requests import commit_call, execute_async
from session_model.partitioning import partition_for
from session_model.projection import BatchFolder, Folded, Position, Record

POLL_S = 0.02  # how often the `folded` counter is read while the workers fold
_NAIVE_KEYS = {"events_timed", "seconds", "window_s", "worker0_cpu_pct", "redis_cpu_pct"}


@dataclass
class ProjectorRun:
    """What one projector measurement saw."""

    total_rate: float | None
    per_process: float | None
    params: dict[str, Any]
    profile: str | None = None


@dataclass
class _Polls:
    """What the polls of the `folded` counter saw, each as (time.monotonic(), events folded)."""

    launch: float
    last: tuple[float, int]
    first: tuple[float, int] | None = None  # the first poll that saw events folded
    start: tuple[float, int] | None = None  # where the timed window starts
    at_90: tuple[float, int] | None = None  # the first poll that saw 90 % of the topic folded
    spy: PySpy | None = None


def measure_projector(
    run: Run,
    name: str,
    workers: int,
    *,
    module: str = "milpa_sessions.cli",
    window_s: float | None = None,
    profile: bool = False,
    **changes: Any,
) -> ProjectorRun:
    """Start `workers` processes on a fresh group over the pre-filled topic; time the fold.

    The clock runs from the first poll that sees the `folded` counter move to the first poll that
    sees it reach the topic's record count (polled every 20 ms); with several workers it starts
    at the first poll that sees it move after the group is stable with every worker owning
    partitions, so the rebalance when the second worker joins is not counted (and the restart in
    the new assignment is timed like the 1-worker run's start). With `window_s` (the naive
    baseline) it stops after that many seconds instead and reports the rate over the window.
    `changes`: Settings fields of the workers (e.g. `redis_wait_replicas`).
    """
    prefill = run.prefilled()
    settings = run.settings(
        name, events_topic=prefill.settings.events_topic, scheduler_enabled=True, **changes
    )
    client = None if run.on_cluster else run.redis()  # Redis's INFO cpu (a cluster: /proc)
    at_rest = run.servers_at_rest()
    with run.cleanup.scope() as scope:
        scope.push(
            f"delete topics of {name}",
            lambda: delete_topics(settings, [settings.decisions_topic, settings.deadletter_topic]),
        )
        infra.register_prefix(settings, scope)
        started = [
            infra.start_worker(scope, run.workdir, f"{name}-{i}", settings, module=module)
            for i in range(workers)
        ]
        group: dict[str, Any] = {}
        if workers > 1:
            group, stop_watch = infra.watch_group(
                settings, settings.consumer_group, settings.events_topic, workers
            )
            scope.push("stop the group watcher", stop_watch.set)
        cpu = run.cpu({f"worker{i}": p.pid for i, p in enumerate(started)}, client)
        folding = FoldCounter(run.store_client(settings), settings.redis_keys(), started)
        polls = _poll_folded(run, name, folding, cpu, group, window_s=window_s, profile=profile)
        usage = cpu.stop() if polls.start is not None else {}
        profile_text = run.profile_summary(name, polls.spy)
        worker_metrics = scrape_workers(started)
    assert polls.start is not None and polls.first is not None
    end_t, end_n = polls.last
    seconds = end_t - polls.start[0]
    counted = end_n - polls.start[1]
    total_rate = rate(counted, seconds)
    params: dict[str, Any] = {
        "workers": workers,
        "events_in_topic": len(prefill.events),
        "sessions": prefill.sessions,
        "concurrent_sessions": run.sizes.concurrency,
        "sessions_per_partition": "equal (ids picked by the murmur2 partitioner)",
        "partitions": settings.partitions,
        "events_timed": counted,
        "seconds": seconds,
        "total_events_per_s": total_rate,
        "poll_interval_s": POLL_S,
        "startup_s": polls.first[0] - polls.launch,
        "batch_max_records": settings.batch_max_records,
        "scheduler_enabled": settings.scheduler_enabled,
        "redis_wait_replicas": settings.redis_wait_replicas,
        **usage,
        "cpu_us_per_event": cpu_per_event(usage, total_rate),
        "servers_at_rest_cpu_pct": at_rest,
        "cpu_us_per_event_above_rest": cpu_per_event(usage, total_rate, at_rest),
        **worker_metrics,
        **_window_params(polls, workers, group, window_s),
    }
    return ProjectorRun(
        total_rate, None if total_rate is None else total_rate / workers, params, profile_text
    )


def _poll_folded(
    run: Run,
    name: str,
    folding: FoldCounter,
    cpu: CpuMeter,
    group: dict[str, Any],
    *,
    window_s: float | None,
    profile: bool,
) -> _Polls:
    """Poll the `folded` counter until the pre-filled topic is folded (or `window_s` is over).

    The CPU meter starts with the timed window (see `measure_projector`); py-spy, if asked for,
    with the first events folded.
    """
    started, total = folding.procs, len(run.prefilled().events)
    launch = time.monotonic()
    polls = _Polls(launch, (launch, 0))
    timeout = 60 + total / 1000
    stable_n: int | None = None
    stalled_since = launch
    while True:
        now = time.monotonic()
        n = folding.read()
        if n > polls.last[1]:
            stalled_since = now
        polls.last = (now, n)
        if polls.first is None and n > 0:
            polls.first = (now, n)
            run.log(f"{name}: first events folded {now - launch:.1f}s after launch")
            if profile:
                polls.spy = run.start_profile(name, started[0].pid)
        if polls.start is None and polls.first is not None:
            if len(started) == 1:
                polls.start = polls.first
                cpu.start()
            elif "stable_at" in group:
                # As the 1-worker run: from the first events folded, here in the new
                # assignment (fetch positions, cold caches and all start from there).
                stable_n = n if stable_n is None else stable_n
                if n > stable_n:
                    polls.start = (now, n)
                    cpu.start()
        if polls.at_90 is None and n >= 0.9 * total:
            polls.at_90 = (now, n)
        if n >= total:
            return polls
        if window_s is not None and polls.start is not None and now - polls.start[0] >= window_s:
            return polls
        for p in started:
            if not p.alive():
                raise RuntimeError(f"{p.name} died\n{p.log(4000)}")
        if now - launch > timeout or now - stalled_since > 30:
            raise TimeoutError(
                f"{name}: {n} of {total} events folded after {now - launch:.0f}s"
                + "".join(f"\n--- {p.name}\n{p.log(1500)}" for p in started)
            )
        time.sleep(POLL_S)


def _window_params(
    polls: _Polls, workers: int, group: dict[str, Any], window_s: float | None
) -> dict[str, Any]:
    """How the timed window was chosen, and the rate up to 90 % of the topic."""
    assert polls.start is not None
    params: dict[str, Any] = {}
    if polls.at_90 is not None and polls.at_90[0] > polls.start[0]:
        # Without the tail, where workers whose partitions are drained wait for the others.
        params["events_per_s_to_90pct"] = rate(
            polls.at_90[1] - polls.start[1], polls.at_90[0] - polls.start[0]
        )
    if workers > 1:
        params["timed_from"] = (
            "first events folded after the group is stable with every worker owning partitions"
        )
        params["folded_before_stable"] = polls.start[1]
        params["partitions_per_worker"] = group.get("assignment")
    else:
        params["timed_from"] = "first folded event"
    if window_s is not None:
        params["window_s"] = window_s
    return params


def _median_run(runs: Sequence[ProjectorRun]) -> ProjectorRun:
    """The run with the median total rate (the lower of the middle two), every round's in params."""
    chosen = median_item(runs, lambda r: r.total_rate)
    totals = [r.total_rate for r in runs]
    return replace(chosen, params={**chosen.params, "rounds_total_events_per_s": totals})


def projector(run: Run) -> None:
    """Events/s per worker process with 1 and 2 workers, the naive baseline, the Redis ceiling.

    The 1-worker and 2-worker runs alternate `projector_rounds` times and each figure is the
    median round: on this shared two-core VM one worker's CPU per event moved by up to 18 %
    between runs minutes apart (35.5–41.9 µs), which a single pair turned into a two-vs-one ratio
    anywhere from 1.58× to 1.86× for the same code.
    """
    ceiling = redis_ceiling(run)
    consume = consume_ceiling(run)
    naive = measure_projector(
        run, "naive", 1, module="bench.naive_projector", window_s=run.sizes.naive_projector_window_s
    )
    run.log(f"naive projector: {naive.total_rate:.0f} events/s")
    ones: list[ProjectorRun] = []
    twos: list[ProjectorRun] = []
    for i in range(run.sizes.projector_rounds):
        profile = i == 0 and run.profile_dir is not None
        ones.append(measure_projector(run, f"proj1r{i}", 1, profile=profile))
        run.log(f"projector, 1 worker, round {i + 1}: {ones[-1].total_rate:.0f} events/s")
        twos.append(measure_projector(run, f"proj2r{i}", 2))
        run.log(f"projector, 2 workers, round {i + 1}: {twos[-1].total_rate:.0f} events/s")
    one, two = _median_run(ones), _median_run(twos)
    run.log(f"projector, medians: 1 worker {one.total_rate:.0f}, 2 workers {two.total_rate:.0f}")
    naive_params = {f"naive_{k}": v for k, v in naive.params.items() if k in _NAIVE_KEYS}
    run.put(
        "projector_events_per_s_per_worker_1w",
        one.per_process,
        "events/s",
        baseline=naive.per_process,
        params={
            **one.params,
            "baseline": "bench/naive_projector.py: commit script per event, awaited",
            **naive_params,
            "redis_ceiling_events_per_s": ceiling,
            "share_of_redis_ceiling": ratio(one.total_rate, ceiling),
            "profiled": one.profile is not None,
        },
    )
    run.put(
        "projector_vs_naive_ratio",
        ratio(one.per_process, naive.per_process),
        "×",
        target=TARGETS["projector_vs_naive"],
        params={"worker": one.per_process, "naive": naive.per_process},
    )
    run.put(
        "projector_events_per_s_per_worker_2w",
        two.per_process,
        "events/s",
        baseline=one.per_process,
        params=two.params,
    )
    run.put(
        "projector_events_per_s_total_2w",
        two.total_rate,
        "events/s",
        baseline=one.total_rate,
        params={"workers": 2, "baseline": "the same with 1 worker (total events/s)"},
    )
    run.put(
        "projector_two_vs_one_ratio",
        ratio(two.total_rate, one.total_rate),
        "×",
        target=TARGETS["two_vs_one"],
        params={
            "one_worker_total": one.total_rate,
            "two_workers_total": two.total_rate,
            "of": "median 2-worker total / median 1-worker total",
            "rounds_ratio": [
                None
                if o.total_rate in (None, 0) or t.total_rate is None
                else round(t.total_rate / o.total_rate, 3)
                for o, t in zip(ones, twos, strict=True)
            ],
            **_two_worker_bound(one.params, ratio(two.total_rate, one.total_rate)),
        },
    )
    run.put("projector_naive_events_per_s", naive.per_process, "events/s", params=naive.params)
    run.put(
        "projector_share_of_consume_ceiling",
        ratio(one.per_process, consume),
        "×",
        target=TARGETS["projector_vs_consume"],
        params={
            "worker": one.per_process,
            "consume_only_ceiling": consume,
            "why": "what folding and committing leave of the rate at which one process can "
            "merely fetch and decode the same topic: a ratio that travels between machines",
            "bound_if_commits_were_free": fold_bound(run.calibration, consume),
            "bound": "a worker that fetches and decodes as fast as the ceiling C and folds as fast "
            "as the run's CPU calibration F, in one process, and commits for free: F / (F + C)",
        },
    )


def fold_bound(fold: float | None, ceiling: float | None) -> float | None:
    """The share of the ceiling a worker reaches at most: it fetches, decodes and folds."""
    return None if fold is None or ceiling is None else round(fold / (fold + ceiling), 3)


def _two_worker_bound(one: dict[str, Any], reached: float | None) -> dict[str, Any]:
    """What two workers can reach at most on this machine's cores, from the 1-worker run's CPU.

    Per event, one worker spends w µs and the broker, Redis and the harness r + b + h more (above
    what they use at rest); on `nproc` shared cores k workers fold at most
    min(k, nproc) / (w + r + b + h) events per µs, one worker 1 / w at best. So two workers on
    two cores reach at most 2w / (w + r + b + h) of one.
    """
    per_event = one.get("cpu_us_per_event") or {}
    above = one.get("cpu_us_per_event_above_rest") or {}
    w = per_event.get("worker0")
    others = [above.get("kafka"), above.get("redis"), per_event.get("harness")]
    cores = os.cpu_count() or 1
    if not w or any(x is None for x in others):
        return {}
    total = w + sum(x for x in others if x is not None)
    bound = min(2, cores) * w / total
    return {
        "cpu_bound": round(bound, 3),
        "share_of_cpu_bound": ratio(reached, bound),
        "cpu_bound_of": f"min(2, nproc={cores}) * w / (w + r + b + h), from the 1-worker run's "
        "CPU per event: worker w, Redis r and broker b above rest, harness h",
    }


# -- the Redis ceiling -----------------------------------------------------------------------------

# One batch as the worker commits it: the sessions first seen (its cache misses), the commit calls,
# the sessions updated and how many events they fold.
_Batch = tuple[list[str], list[tuple[list[str], list[Any]]], list[str], int, list[int]]


def redis_ceiling(run: Run) -> float | None:
    """Same-run ceiling of the worker's Redis pattern without Kafka: events/s it can commit.

    The first `ceiling_events` records of the pre-filled topic are folded and their commit
    arguments built ahead (untimed), batched as the worker batches them (up to
    `batch_max_records` consecutive records of one partition). Timed: per batch, one pipelined
    round trip of READ scripts (64 sessions per call) for the sessions first seen (as the worker's
    cache misses on a fresh prefix) and one of COMMIT scripts (one call per 64 sessions of the
    batch, as the worker makes them), on `redis.asyncio` like the worker — so client-side command
    packing is included, fold and argument building are not.
    """
    prefill = run.prefilled()
    settings = run.settings("ceiling")
    infra.register_prefix(settings, run.cleanup)
    keys = settings.redis_keys()
    batches, prepared = _ceiling_batches(settings, keys, prefill, run.sizes.ceiling_events)
    folded = sum(b[3] for b in batches)
    sync = run.redis()
    cpu = run.cpu({})
    cpu.start()
    elapsed, redis_cpu = asyncio.run(_commit_all(run.stack.redis_url, keys, batches, sync))
    usage = cpu.stop()
    ceiling = rate(folded, elapsed)
    run.log(f"redis ceiling: {folded} events in {elapsed:.2f}s (prepared in {prepared:.1f}s)")
    n_calls = sum(len(b[1]) for b in batches)
    run.put(
        "redis_ceiling_events_per_s",
        ceiling,
        "events/s",
        params={
            "what": "the worker's Redis pattern alone: per batch one pipeline of READ scripts "
            "(cache misses) and one of COMMIT scripts, 64 sessions per call each, "
            "redis.asyncio, one connection",
            "events": folded,
            "batches": len(batches),
            "commit_calls": n_calls,
            "events_per_commit_call": folded / n_calls if n_calls else None,
            "seconds": elapsed,
            "redis_cpu_pct": 100 * redis_cpu / elapsed if elapsed else None,
            **usage,
        },
    )
    return ceiling


def _ceiling_batches(
    settings: Settings, keys: Keys, prefill: Prefill, count: int
) -> tuple[list[_Batch], float]:
    """The first `count` records in the worker's batches, folded; seconds the folding took."""
    partitions = settings.partitions
    per_partition: dict[int, list[Record]] = collections.defaultdict(list)
    for e in prefill.events[:count]:
        p = partition_for(e.session_id, partitions)
        per_partition[p].append(Record(e, Position(p, len(per_partition[p]))))
    size = settings.batch_max_records
    chunks = [
        per_partition[p][i : i + size]
        for i in range(0, max(len(v) for v in per_partition.values()), size)
        for p in sorted(per_partition)
        if per_partition[p][i : i + size]
    ]
    folder = BatchFolder(workload.OPERATOR_KEYS)
    cache: dict[str, Folded] = {}
    batches: list[_Batch] = []
    t = time.perf_counter()
    for chunk in chunks:
        misses = list(
            dict.fromkeys(r.event.session_id for r in chunk if r.event.session_id not in cache)
        )
        updates = folder.fold(cache, chunk)
        calls = [commit_call(keys, u, settings.compactor_max_turns) for u in updates]
        for u in updates:
            cache[u.session_id] = Folded(u.state, u.mark)
        batches.append(
            (
                misses,
                calls,
                [u.session_id for u in updates],
                sum(len(u.steps) for u in updates),
                [u.mark.partition for u in updates],
            )
        )
    return batches, time.perf_counter() - t


async def _commit_all(
    url: str, keys: Keys, batches: Sequence[_Batch], sync: redis.Redis
) -> tuple[float, float]:
    """Commit the batches as the worker does; seconds taken and Redis CPU seconds used."""
    client = async_client(url)  # the worker's client (hiredis packing)
    try:
        for script in scripts.ALL:  # loaded before the clock starts
            await client.script_load(script.source)
        cpu0 = redis_cpu_seconds(sync)
        started = time.perf_counter()
        for misses, calls, sids, _, partitions in batches:
            if misses:  # the replies are not decoded: this measures Redis, not the client
                read = requests.read(keys, misses)
                await execute_async(client, requests.Request(read.commands, list, read.failure))
            done = await execute_async(client, requests.commit(keys, sids, calls, partitions))
            if done.result.conflicts:
                raise RuntimeError("a ceiling commit was refused (mark conflict)")
        elapsed = time.perf_counter() - started
        cpu1 = redis_cpu_seconds(sync)
        return elapsed, (cpu1 - cpu0) if cpu0 is not None and cpu1 is not None else math.nan
    finally:
        await client.aclose()
