"""The rebuild figure: `processors.replay.replay` of the pre-filled topic into a fresh prefix."""

from __future__ import annotations

import os
import resource
import threading
import time

from bench import infra, workload
from bench.figures.calibration import calibrate
from bench.figures.common import TARGETS, FoldCounter, Run
from bench.stats import rate
from processors.replay import replay
from projections.redis_store import RedisProjectionStore


def rebuild(run: Run) -> None:
    """`processors.replay.replay` of the pre-filled topic into a fresh prefix: events/s.

    With the product's default, the partitions are rebuilt in forked processes (one per CPU,
    since the harness runs no other thread then); their CPU is measured apart (they are this
    process's children). Under `--profile` it rebuilds in this process, the one py-spy samples.
    """
    prefill = run.prefilled()
    settings = run.settings("replay")
    infra.register_prefix(settings, run.cleanup)
    client = run.store_client(settings)  # the product's, as `milpa-sessions replay` makes it
    store = RedisProjectionStore(client, settings.redis_keys())
    cpu = run.cpu({}, run.redis())
    # The reference next to the figure, before and after (outside the profile): this kind of
    # machine's speed moves within minutes, and the run's own calibration was minutes earlier.
    before, _ = calibrate()
    spy = run.start_profile("replay", os.getpid())
    processes = 1 if spy is not None else None
    threads = threading.active_count()
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu.start()
    started = time.perf_counter()
    report = replay(
        run.stack.kafka_bootstrap,
        prefill.settings.events_topic,
        store,
        workload.OPERATOR_KEYS,
        processes=processes,
    )
    elapsed = time.perf_counter() - started
    usage = cpu.stop()
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    run.profile_summary("replay", spy)
    calibrated_after, _ = calibrate()
    # The faster of the two: whatever else takes the core slows a calibration, nothing speeds it.
    reference = max(before, calibrated_after)
    children_s = (after.ru_utime - children.ru_utime) + (after.ru_stime - children.ru_stime)
    folded = FoldCounter(client, settings.redis_keys()).read()
    run.log(f"replay: {report.records} records in {elapsed:.2f}s")
    harness_s = (usage.get("harness_cpu_pct") or 0.0) * elapsed / 100
    run.put(
        "rebuild_events_per_s",
        rate(report.records, elapsed),
        "events/s",
        baseline=reference,
        target=TARGETS["replay"],
        params={
            "records": report.records,
            "folded": folded,
            "sessions": report.applied_sessions,
            "seconds": elapsed,
            "baseline": "the CPU calibration (the pure fold on one core, events/s) measured right "
            "before and right after the rebuild, the faster of the two: the ratio travels between "
            "machines of different single-core speed, and between moments of one machine's",
            "calibration_before_after": [round(before), round(calibrated_after)],
            "calibration_at_run_start": None if run.calibration is None else round(run.calibration),
            "what": "processors.replay.replay(...) called in the harness process (which forks "
            "the rebuild processes), timed from the call (consumer connect included) to its "
            "return",
            "processes": "default (one per CPU)" if processes is None else processes,
            "harness_threads_at_call": threads,
            "rebuild_processes_cpu_pct": round(100 * children_s / elapsed, 1),
            "cpu_us_per_event": round((harness_s + children_s) / report.records * 1e6, 1)
            if report.records
            else None,
            "profiled": spy is not None,
            **usage,
        },
    )
