"""Below saturation: one worker's CPU at paced rates, fetches answered at once or held.

At each of `paced_rates`, the e2e workload paced into a fresh topic with one worker, with the
default `fetch_min_bytes` (1) and with `PACED_MIN_BYTES`: the worker's CPU, batches and CPU per
event, and the second's CPU over the first's. No target (docs/PERFORMANCE.md, "Below saturation").
"""

from __future__ import annotations

import math
import time
from typing import Any

from bench import infra, workload
from bench.figures.common import FoldCounter, Run, paced, scrape_workers
from producers.kafka_log import KafkaEventLog

PACED_MIN_BYTES = 16_384


def paced_cost(run: Run) -> None:
    """Per rate: the worker's CPU with fetches answered at once, then held for 16 KiB."""
    for rate in run.sizes.paced_rates:
        one, held = (measure_paced(run, rate, b) for b in (1, PACED_MIN_BYTES))
        base = run.put(f"projector_paced_{rate}_cpu_pct", one["worker0_cpu_pct"], "%", params=one)
        name, value = f"projector_paced_{rate}_min_bytes_cpu_pct", held["worker0_cpu_pct"]
        run.put(name, value, "%", baseline=base.value, params=held)


def measure_paced(run: Run, rate: int, min_bytes: int) -> dict[str, Any]:
    """One worker on a fresh topic: a warm-up, then `paced_seconds` at `rate` events/s."""
    s = run.sizes
    name = f"paced{rate}b{min_bytes}"
    settings = run.settings(name, fetch_min_bytes=min_bytes)
    infra.create_topics(settings, run.cleanup)
    infra.register_prefix(settings, run.cleanup)
    n_warm = int(rate * s.e2e_warmup_s)
    total = n_warm + int(rate * s.paced_seconds)
    sessions = math.ceil(total / 19) + 1
    tag = f"p{run.tag}{rate}b{min_bytes}"
    work = workload.sessions_workload(sessions, tag, concurrency=max(sessions // 5, 50))
    events = work.events[:total]
    worker = run.start(f"{name}-0", settings)
    log = KafkaEventLog(run.stack.kafka_bootstrap, settings.events_topic)
    run.cleanup.push(f"close {name} producer", lambda: log.close(timeout=5))
    folding = FoldCounter(run.store_client(settings), settings.redis_keys(), [worker])
    log.append(workload.starts([f"{tag}-warmup"])[0])
    folding.wait(1, 90, f"{name} worker ready", 0.05)
    paced(log, events[:n_warm], rate)
    log.flush(timeout=30)
    folding.wait(1 + n_warm, 60, f"{name} warm-up folded", 0.01)
    before = scrape_workers([worker])
    cpu = run.cpu({"worker0": worker.pid}, None if run.on_cluster else run.redis())
    cpu.start()
    spy = run.start_profile(name, worker.pid)
    started = time.perf_counter()
    produced_in, behind = paced(log, events[n_warm:], rate)
    log.flush(timeout=30)
    folding.wait(1 + total, 60, f"{name} all folded", 0.01)
    usage, seconds = cpu.stop(), time.perf_counter() - started
    run.profile_summary(name, spy)
    after = scrape_workers([worker])
    worker.stop()
    measured = total - n_warm
    batches, trips = (
        _delta(after, before, k) for k in ("batches_per_worker", "redis_round_trips_per_worker")
    )
    worker_pct = float(usage["worker0_cpu_pct"])
    return {
        "rate_events_per_s": rate,
        "fetch_min_bytes": min_bytes,
        "fetch_max_wait_s": settings.fetch_max_wait,
        "events": measured,
        "seconds_measured": seconds,
        "produced_in_s": produced_in,
        "sends_late_over_5ms": behind,
        "batches": batches,
        "records_per_batch": batches and measured / batches,
        "redis_round_trips": trips,
        "worker_cpu_us_per_event": worker_pct / 100 * seconds / measured * 1e6,
        "worker_cpu_ms_per_batch": batches and worker_pct / 100 * seconds / batches * 1e3,
        "what": "the e2e workload paced with kafka-python (KafkaEventLog, linger 5 ms) after a "
        "warm-up; CPU from the first measured send until the worker had folded the last",
        "profiled": spy is not None,  # py-spy's sampling costs the worker CPU of its own
        **usage,
    }


def _delta(after: dict[str, Any], before: dict[str, Any], key: str) -> int | None:
    """A worker counter's growth between two scrapes (None if either lacks it)."""
    a, b = (after.get(key) or [None])[0], (before.get(key) or [None])[0]
    return None if a is None or b is None else int(a - b)
