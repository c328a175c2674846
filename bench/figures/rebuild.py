"""The rebuild figure: `processors.replay.replay` of the pre-filled topic into a fresh prefix."""

from __future__ import annotations

import os
import resource
import threading
import time
from dataclasses import dataclass
from typing import Any

from bench import infra, workload
from bench.figures.calibration import calibrate
from bench.figures.common import ROUND_SETTLE_MAX_S, TARGETS, FoldCounter, Prefill, Run
from bench.stats import median_item, rate, ratio
from deploy.host import cpu_report
from processors.replay import replay
from projections.redis_store import RedisProjectionStore


@dataclass(frozen=True)
class _Round:
    """One rebuild of the pre-filled topic and the machine's speed right before and after it."""

    records: int
    sessions: int
    folded: int
    seconds: float
    calibrations: tuple[float, float]  # the pure fold's events/s right before and after
    params: dict[str, Any]

    @property
    def events_per_s(self) -> float | None:
        return rate(self.records, self.seconds)

    @property
    def reference(self) -> float:
        """The faster calibration: whatever else takes the core slows one, nothing speeds it."""
        return max(self.calibrations)

    @property
    def ratio(self) -> float | None:
        return ratio(self.events_per_s, self.reference)


def rebuild(run: Run) -> None:
    """`processors.replay.replay` of the pre-filled topic into a fresh prefix: events/s.

    `rebuild_rounds` times (once under `--profile`), each into a prefix of its own, with the CPU
    calibration between the rounds (after a settle): the figure is the round whose ratio to the
    faster calibration around it is the median. This kind of machine's speed moves within
    seconds (calibrations ten seconds apart differed by a third), so one rebuild against one
    pair of calibrations read as a miss or a pass by chance.

    With the product's default, the partitions are rebuilt in forked processes (one per CPU,
    since the harness runs no other thread then); their CPU is measured apart (they are this
    process's children). Under `--profile` it rebuilds in this process, the one py-spy samples.
    """
    prefill = run.prefilled()
    count = 1 if run.profile_dir is not None else max(1, run.sizes.rebuild_rounds)
    run.settle(ROUND_SETTLE_MAX_S)
    before, _ = calibrate()
    rounds: list[_Round] = []
    for i in range(count):
        measured = _measure(run, prefill, f"replay{i}" if i else "replay")
        # The rebuild's processes have exited; Redis may still be busy: measure the machine
        # once the servers are at rest, as before the round.
        run.settle(ROUND_SETTLE_MAX_S)
        after, _ = calibrate()
        rounds.append(_Round(**measured, calibrations=(before, after)))
        before = after
    m = median_item(rounds, lambda r: r.ratio)
    run.log(f"replay: {m.records} records in {m.seconds:.2f}s (median of {count} rounds)")
    run.put(
        "rebuild_events_per_s",
        m.events_per_s,
        "events/s",
        baseline=m.reference,
        target=TARGETS["replay"],
        params={
            "records": m.records,
            "folded": m.folded,
            "sessions": m.sessions,
            "seconds": m.seconds,
            "baseline": "the CPU calibration (the pure fold on one core, events/s) measured right "
            "before and right after the rebuild, the faster of the two: the ratio travels between "
            "machines of different single-core speed, and between moments of one machine's",
            "of": f"the round with the median ratio of {count}",
            "calibration_before_after": [round(c) for c in m.calibrations],
            "calibration_at_run_start": None if run.calibration is None else round(run.calibration),
            "rounds_events_per_s": [r.events_per_s for r in rounds],
            "rounds_ratio": [r.ratio for r in rounds],
            "rounds_calibration_before_after": [[round(c) for c in r.calibrations] for r in rounds],
            "rounds_cpu_pct": [cpu_report(r.params) for r in rounds],
            **m.params,
        },
    )


def _measure(run: Run, prefill: Prefill, name: str) -> dict[str, Any]:
    """One rebuild of the pre-filled topic into the prefix of `name`: what it read and wrote,
    its seconds and CPU."""
    settings = run.settings(name)
    infra.register_prefix(settings, run.cleanup)
    client = run.store_client(settings)  # the product's, as `milpa-sessions replay` makes it
    store = RedisProjectionStore(client, settings.redis_keys())
    cpu = run.cpu({}, run.redis())
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
    children_s = (after.ru_utime - children.ru_utime) + (after.ru_stime - children.ru_stime)
    harness_s = (usage.get("harness_cpu_pct") or 0.0) * elapsed / 100
    folded = FoldCounter(client, settings.redis_keys()).read()
    # Each round into a Redis as the first found it: with the rounds' keys kept, each round was
    # slower than the one before in both runs measured (the settle after waits out the deletion).
    infra.clear_prefix(settings)
    return {
        "records": report.records,
        "sessions": report.applied_sessions,
        "folded": folded,
        "seconds": elapsed,
        "params": {
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
    }
