"""The cluster counterparts of the projector and e2e figures (`--topology cluster`): the same
measurements on 3 brokers (RF 3, min.insync.replicas 2) and a Redis Cluster (3 masters, 3
replicas), each read as a ratio to its single-node figure measured earlier in the same run.

Each runs right after its single-node figure (`bench.figures.plan`), on `Run.cluster_run()`:
the other stack idles meanwhile, and its servers' CPU is reported as `idle_stack`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from bench import infra
from bench.figures.common import ROUND_SETTLE_MAX_S, TARGETS, Prefill, Run, produce_all
from bench.figures.e2e import measure_e2e, warm_broker
from bench.figures.projector import ProjectorRun, _median_run, measure_projector
from bench.stats import Figure, rate, ratio
from producers.kafka_log import KafkaEventLog

SINGLE_PROJECTOR = "projector_events_per_s_per_worker_1w"
SINGLE_E2E_P50 = "e2e_latency_p50_ms"
SINGLE_E2E_P99 = "e2e_latency_p99_ms"  # its CPU report is in the p50 figure's params
CLUSTER_PROJECTOR = "projector_cluster_events_per_s_per_worker_1w"
CLUSTER_E2E_P50 = "e2e_cluster_latency_p50_ms"


def reference(results: Mapping[str, Figure], name: str) -> float | None:
    """The value of the same run's figure `name` (None if it was not measured)."""
    found = results.get(name)
    return None if found is None else found.value


def per_event(
    results: Mapping[str, Figure], name: str, process: str, key: str = "cpu_us_per_event"
) -> float | None:
    """µs of CPU per event `process` used in the same run's figure `name` (its `params[key]`:
    `cpu_us_per_event`, or `cpu_us_per_event_above_rest`), None if not measured."""
    found = results.get(name)
    if found is None:
        return None
    value = found.params.get(key, {}).get(process)
    return None if value is None else float(value)


def flagged(results: Mapping[str, Figure], *names: str) -> dict[str, str]:
    """`{"disturbed": why}` if a figure this one is read against (or whose CPU report it
    shares) was disturbed, else {}: a ratio to a disturbed reference is no result either."""
    for name in names:
        found = results.get(name)
        if found is not None and "disturbed" in found.params:
            return {"disturbed": f"its reference {name} was disturbed: {found.params['disturbed']}"}
    return {}


def projector_cluster(run: Run) -> None:
    """One worker on the replicated stack, without and with `MILPA_REDIS_WAIT_REPLICAS=1`.

    The pre-filled topic's events are produced again into a topic of the cluster (RF 3, acks=all:
    two replicas hold each write before its ack; timed, reported in params). Rounds alternate
    the two (`projector_rounds`), each figure the median round, as the projector figure does.
    """
    single = run.prefilled()
    crun = run.cluster_run()
    produced = _prefill(crun, single)
    plain: list[ProjectorRun] = []
    waiting: list[ProjectorRun] = []
    for i in range(run.sizes.projector_rounds):
        plain.append(measure_projector(crun, f"projc1r{i}", 1))
        run.log(f"projector on the cluster, round {i + 1}: {plain[-1].total_rate:.0f} events/s")
        waiting.append(measure_projector(crun, f"projcw1r{i}", 1, redis_wait_replicas=1))
        run.log(f"  … with WAIT 1, round {i + 1}: {waiting[-1].total_rate:.0f} events/s")
    one, wait = _median_run(plain), _median_run(waiting)
    single_rate = reference(run.results, SINGLE_PROJECTOR)
    crun.put(
        CLUSTER_PROJECTOR,
        one.per_process,
        "events/s",
        baseline=single_rate,
        target=TARGETS["projector_cluster"],
        params={
            **flagged(run.results, SINGLE_PROJECTOR),
            **one.params,
            "baseline": f"{SINGLE_PROJECTOR} of this run (one broker, one Redis)",
            "prefill": produced,
            "worker_cpu_us_per_event_vs_single": ratio(
                one.params["cpu_us_per_event"].get("worker0"),
                per_event(run.results, SINGLE_PROJECTOR, "worker0"),
            ),
        },
    )
    crun.put(
        "projector_cluster_wait_replicas_events_per_s_per_worker_1w",
        wait.per_process,
        "events/s",
        baseline=one.per_process,
        target=TARGETS["projector_cluster_wait"],
        params={
            **flagged(run.results, CLUSTER_PROJECTOR),
            **wait.params,
            "baseline": "the same on the cluster without WAIT (projector_cluster_events_per_s_"
            "per_worker_1w)",
            "vs_single": ratio(wait.per_process, single_rate),
            "what": "every projection write ends with WAIT 1 on each master it wrote to: "
            "a commit is on a replica before the worker lets Kafka commit its offsets",
        },
    )
    above = "cpu_us_per_event_above_rest"
    crun.put(
        "redis_cluster_master_cpu_us_per_event",
        one.params[above].get("redis_masters"),
        "µs",
        baseline=per_event(run.results, SINGLE_PROJECTOR, "redis", above),
        target=TARGETS["redis_master_per_event"],
        params={
            **flagged(run.results, CLUSTER_PROJECTOR, SINGLE_PROJECTOR),
            "what": "CPU the Redis Cluster's masters used (/proc) per event folded by one worker "
            "beyond what they use at rest, over the timed window of projector_cluster_events_per_"
            "s_per_worker_1w; each event is served by the one master owning its partition's slot",
            "baseline": f"the single Redis's CPU (INFO cpu) per event beyond rest, in "
            f"{SINGLE_PROJECTOR}",
            "masters_at_rest_cpu_pct": one.params["servers_at_rest_cpu_pct"].get(
                "redis_masters_cpu_pct"
            ),
            "masters_cpu_us_per_event_with_rest": one.params["cpu_us_per_event"].get(
                "redis_masters"
            ),
            "replicas_cpu_us_per_event": one.params[above].get("redis_replicas"),
            "with_wait_masters_cpu_us_per_event": wait.params[above].get("redis_masters"),
            "with_wait_replicas_cpu_us_per_event": wait.params[above].get("redis_replicas"),
            "brokers_cpu_us_per_event": one.params[above].get("kafka"),
            "brokers_cpu_us_per_event_single": per_event(
                run.results, SINGLE_PROJECTOR, "kafka", above
            ),
            "events_per_s": one.total_rate,
        },
    )


def _prefill(crun: Run, single: Prefill) -> dict[str, Any]:
    """The pre-filled topic's events produced into a topic of the cluster (kept for the run)."""
    settings = crun.settings("prefill")
    infra.create_topics(settings, crun.root)
    with KafkaEventLog(crun.stack.kafka_bootstrap, settings.events_topic) as log:
        seconds = produce_all(log, single.events)
    crun.prefill = Prefill(settings, single.events, single.sessions, single.record_bytes)
    produced = rate(len(single.events) - 1, seconds)
    crun.log(f"pre-filled the cluster's topic: {produced:.0f} events/s (acks=all, RF 3)")
    return {
        "events": len(single.events),
        "produce_events_per_s": produced,
        "producer_events_per_s_single": reference(crun.results, "producer_events_per_s"),
        "acks": "all",
        "replication_factor": settings.replication_factor,
        "min_insync_replicas": settings.min_insync_replicas,
    }


def e2e_cluster(run: Run) -> None:
    """The e2e figure on the replicated stack, against the single node's of the same run."""
    crun = run.cluster_run()
    warm = warm_broker(crun, "e2ecw")
    crun.settle(ROUND_SETTLE_MAX_S)
    m = measure_e2e(crun, "e2ec")
    single_ack = run.results.get("e2e_p99_vs_produce_ack_p99")
    single_ack_p99 = None if single_ack is None else single_ack.params.get("produce_ack_p99_ms")
    crun.put(
        CLUSTER_E2E_P50,
        m.send["p50"],
        "ms",
        baseline=reference(run.results, SINGLE_E2E_P50),
        params={**flagged(run.results, SINGLE_E2E_P50), **m.params},
    )
    crun.put(
        "e2e_cluster_latency_p99_ms",
        m.send["p99"],
        "ms",
        baseline=reference(run.results, SINGLE_E2E_P99),
        target=TARGETS["e2e_cluster"],
        params={
            **flagged(run.results, CLUSTER_E2E_P50, SINGLE_E2E_P50),
            "baseline": f"{SINGLE_E2E_P99} of this run (one broker, one Redis)",
            "from_ack_p99_ms": m.ack["p99"],
            "produce_ack_p99_ms": m.produce["p99"],
            "produce_ack_p99_ms_single": single_ack_p99,
            "produce_ack_p99_vs_single": ratio(m.produce["p99"], single_ack_p99),
            "see": "e2e_cluster_latency_p50_ms params",
        },
    )
    crun.put(
        "e2e_cluster_p99_vs_produce_ack_p99",
        ratio(m.send["p99"], m.produce["p99"]),
        "×",
        target=TARGETS["e2e_vs_ack"],
        params={
            **flagged(run.results, CLUSTER_E2E_P50),
            "e2e_p99_ms": m.send["p99"],
            "produce_ack_p99_ms": m.produce["p99"],
            "warmup_rounds": warm,
            "why": "as e2e_p99_vs_produce_ack_p99, on the cluster: the ack itself waits for a "
            "second replica there",
        },
    )
