"""`--topology cluster`: the command line, the steps of a run, the cluster figures' references and
ratios, the settings and CPU accounting of the replicated stack. No stack: nothing here connects.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
from redis.crc import key_slot

from bench import run as bench_run
from bench.figures import CALIBRATION, FIGURES, ON_CLUSTER, STEPS, plan
from bench.figures.cluster import flagged, per_event, reference
from bench.figures.common import CLUSTER_TOPOLOGY, TARGETS, Run, Sizes, stack_pids
from bench.figures.e2e import marks_calls
from bench.stats import Figure, cpu_per_event
from deploy import harness
from deploy.harness import Stack
from deploy.host import CpuMeter
from projections.keys import Keys

SINGLE = Stack("127.0.0.1:9092", "redis://127.0.0.1:6379/0", "test", kafka_pid=11, redis_pid=12)
REPLICATED = Stack(
    "127.0.0.1:9093,127.0.0.1:9094,127.0.0.1:9095",
    "redis://127.0.0.1:6380/0",
    "test cluster",
    redis_pid=22,
    redis_cluster_url="redis://127.0.0.1:7001",
    kafka_pids=(31, 32, 33),
    redis_cluster_nodes=tuple((f"redis://127.0.0.1:{7001 + i}", 41 + i) for i in range(6)),
    replication_factor=3,
    min_insync_replicas=2,
)


# -- the command line --------------------------------------------------------------------------


def test_the_topology_is_single_unless_asked_and_only_single_or_cluster() -> None:
    assert bench_run.parser().parse_args([]).topology == "single"
    args = bench_run.parser().parse_args(["--topology", "cluster", "--only", "projector,e2e"])
    assert args.topology == "cluster"
    with pytest.raises(SystemExit):
        bench_run.parser().parse_args(["--topology", "mesh"])


def test_a_cluster_run_without_a_figure_that_has_a_counterpart_is_refused_before_any_stack(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as exited:
        bench_run.main(["--topology", "cluster", "--only", "memory"])
    assert exited.value.code == 2
    assert "projector, e2e" in capsys.readouterr().err


@pytest.mark.parametrize(
    "field", ["redis_cluster", "replication_factor", "min_insync_replicas", "redis_wait_replicas"]
)
def test_the_topology_fields_are_the_harness_s_not_set_s(field: str) -> None:
    with pytest.raises(ValueError, match="the harness chooses it"):
        bench_run.parse_overrides([f"{field}=1"])


# -- the steps of a run --------------------------------------------------------------------------


def test_a_single_run_measures_what_was_asked_after_the_calibration_only() -> None:
    assert plan(["e2e", "projector"]) == [CALIBRATION, "projector", "e2e"]
    assert plan([]) == list(FIGURES)


def test_a_cluster_run_follows_each_figure_with_its_cluster_counterpart() -> None:
    assert plan(["projector", "e2e"], "cluster") == [
        CALIBRATION,
        "projector",
        "projector_cluster",
        "e2e",
        "e2e_cluster",
    ]
    steps = plan(["e2e", "memory"], "cluster")
    assert steps == [CALIBRATION, "e2e", "e2e_cluster", "memory"]
    everything = plan([], "cluster")
    assert [s for s in everything if s.endswith("_cluster")] == [f"{n}_cluster" for n in ON_CLUSTER]
    assert all(step in STEPS for step in everything)


def test_plan_refuses_unknown_figures_topologies_and_cluster_runs_with_nothing_to_compare() -> None:
    with pytest.raises(ValueError, match="unknown figure"):
        plan(["projector_cluster"], "cluster")  # a counterpart is not asked for by name
    with pytest.raises(ValueError, match="unknown topology"):
        plan(["projector"], "mesh")
    with pytest.raises(ValueError, match="none of them was asked for"):
        plan(["memory", "inbox"], "cluster")


def test_the_cluster_figures_are_registered_as_steps_but_not_as_figures() -> None:
    assert set(ON_CLUSTER) <= set(FIGURES)
    assert STEPS["projector_cluster"] is ON_CLUSTER["projector"]
    assert STEPS["e2e_cluster"] is ON_CLUSTER["e2e"]
    assert not any(name.endswith("_cluster") for name in FIGURES)


# -- references and ratios ---------------------------------------------------------------------


def _run(tmp_path: Path, emitted: list[Figure], **fields: Any) -> Run:
    return Run(
        stack=SINGLE,
        tag="t",
        sizes=Sizes.quick(),
        cleanup=None,  # type: ignore[arg-type] # put() and settings() touch no cleanup
        root=None,  # type: ignore[arg-type]
        workdir=tmp_path,
        log=lambda _: None,
        emit=emitted.append,
        **fields,
    )


def test_a_cluster_figure_is_a_ratio_to_the_single_node_figure_of_the_same_run(
    tmp_path: Path,
) -> None:
    emitted: list[Figure] = []
    run = _run(tmp_path, emitted, other_stack=REPLICATED)
    run.put(
        "projector_events_per_s_per_worker_1w",
        10_000.0,
        "events/s",
        params={
            "cpu_us_per_event": {"worker0": 95.0, "redis": 6.0},
            "cpu_us_per_event_above_rest": {"redis": 5.5},
        },
    )
    crun = run.cluster_run()
    single = reference(crun.results, "projector_events_per_s_per_worker_1w")
    assert single == 10_000.0
    assert per_event(crun.results, "projector_events_per_s_per_worker_1w", "redis") == 6.0
    assert per_event(crun.results, "projector_events_per_s_per_worker_1w", "kafka") is None
    above = "cpu_us_per_event_above_rest"
    assert per_event(crun.results, "projector_events_per_s_per_worker_1w", "redis", above) == 5.5
    assert per_event(crun.results, "e2e_latency_p99_ms", "redis") is None
    met = crun.put(
        "projector_cluster_events_per_s_per_worker_1w",
        8_000.0,
        "events/s",
        baseline=single,
        target=TARGETS["projector_cluster"],
    )
    missed = crun.put(
        "projector_cluster_events_per_s_per_worker_1w",
        7_900.0,
        "events/s",
        baseline=single,
        target=TARGETS["projector_cluster"],
    )
    assert (met.ratio, met.met) == (0.8, True)
    assert missed.met is False
    assert met.params["topology"] == CLUSTER_TOPOLOGY
    assert "topology" not in emitted[0].params
    assert run.results is crun.results  # one run: the later figures read the earlier ones


def test_a_cluster_figure_read_against_a_disturbed_reference_is_disturbed_too(
    tmp_path: Path,
) -> None:
    emitted: list[Figure] = []
    run = _run(tmp_path, emitted, other_stack=REPLICATED)
    run.put("e2e_latency_p50_ms", 9.0, "ms", params={"cpu": {"unaccounted_cpu_pct": 80.0}})
    run.put("e2e_latency_p99_ms", 20.0, "ms")
    assert "disturbed" in emitted[0].params and "disturbed" not in emitted[1].params
    why = flagged(run.results, "e2e_cluster_latency_p50_ms", "e2e_latency_p50_ms")
    assert why["disturbed"].startswith("its reference e2e_latency_p50_ms was disturbed")
    assert flagged(run.results, "e2e_latency_p99_ms", "absent") == {}
    crun = run.cluster_run()
    figure = crun.put("e2e_cluster_latency_p99_ms", 25.0, "ms", baseline=20.0, params=why)
    assert figure.params["disturbed"] == why["disturbed"]


def test_the_e2e_and_per_event_targets_bound_the_ratio_from_above() -> None:
    def met(name: str, value: float, baseline: float) -> bool | None:
        return Figure("f", value, "ms", baseline=baseline, target=TARGETS[name]).met

    assert met("e2e_cluster", 15.0, 10.0) is True
    assert met("e2e_cluster", 15.1, 10.0) is False
    assert met("redis_master_per_event", 6.0, 5.0) is True
    assert met("redis_master_per_event", 6.5, 5.0) is False
    assert met("projector_cluster_wait", 9.0, 10.0) is True
    assert all(TARGETS[n].of_ratio for n in ("projector_cluster", "e2e_cluster"))


def test_a_missing_reference_leaves_the_ratio_and_the_verdict_unknown(tmp_path: Path) -> None:
    crun = _run(tmp_path, [], other_stack=REPLICATED).cluster_run()
    baseline = reference(crun.results, "e2e_latency_p99_ms")
    figure = Figure("e2e_cluster_latency_p99_ms", 12.0, "ms", baseline, TARGETS["e2e_cluster"])
    assert baseline is None
    assert (figure.ratio, figure.met) == (None, None)


def test_cpu_per_event_is_each_process_s_share_of_a_core_over_the_rate() -> None:
    usage = {
        "worker0_cpu_pct": 98.0,
        "redis_masters_cpu_pct": 15.0,
        "kafka_cpu_pct": None,
        "unaccounted_cpu_pct": 30.0,
        "other_processes_cpu_pct": [[12.0, "java"]],
        "loadavg_1m": 2.5,
    }
    assert cpu_per_event(usage, 10_000) == {"worker0": 98.0, "redis_masters": 15.0}
    assert cpu_per_event(usage, 0) == {}
    assert cpu_per_event(usage, None) == {}


def test_beyond_rest_only_the_servers_measured_at_rest_count_and_only_what_they_added() -> None:
    usage = {"worker0_cpu_pct": 98.0, "redis_masters_cpu_pct": 15.0, "kafka_cpu_pct": 20.0}
    at_rest = {"redis_masters_cpu_pct": 3.0, "kafka_cpu_pct": 4.0}
    assert cpu_per_event(usage, 10_000, at_rest) == pytest.approx(
        {"redis_masters": 12.0, "kafka": 16.0}
    )
    assert cpu_per_event(usage, 10_000, {}) == {}


# -- the replicated stack: settings, CPU, the watcher's calls -----------------------------------


def test_a_cluster_run_reads_and_writes_the_redis_cluster_and_replicates_its_topics(
    tmp_path: Path,
) -> None:
    run = _run(tmp_path, [], other_stack=REPLICATED)
    single = run.settings("projector")
    assert (single.redis_cluster, single.redis_url, single.replication_factor) == (
        False,
        SINGLE.redis_url,
        1,
    )
    crun = run.cluster_run()
    assert (crun.stack, crun.other_stack, crun.on_cluster) == (REPLICATED, SINGLE, True)
    on_cluster = crun.settings("projector", redis_wait_replicas=1)
    assert on_cluster.redis_cluster is True
    assert on_cluster.redis_url == REPLICATED.redis_cluster_url
    assert on_cluster.kafka_bootstrap == REPLICATED.kafka_bootstrap
    assert (on_cluster.replication_factor, on_cluster.min_insync_replicas) == (3, 2)
    assert on_cluster.redis_wait_replicas == 1
    assert on_cluster.redis_prefix == single.redis_prefix  # on another Redis: the same names
    with pytest.raises(RuntimeError, match="no replicated stack"):
        crun.cluster_run()
    with pytest.raises(RuntimeError, match="no replicated stack"):
        _run(tmp_path, []).cluster_run()


def test_a_stack_without_a_redis_cluster_cannot_hold_a_cluster_run(tmp_path: Path) -> None:
    crun = _run(tmp_path, [], other_stack=SINGLE).cluster_run()
    with pytest.raises(RuntimeError, match="has no Redis Cluster"):
        crun.settings("e2e")


def test_the_servers_of_a_stack_are_every_broker_and_redis_node_once() -> None:
    assert stack_pids(SINGLE) == (11, 12)
    assert stack_pids(REPLICATED) == (31, 32, 33, 22, 41, 42, 43, 44, 45, 46)


def test_the_cpu_meter_reports_a_group_of_processes_as_one() -> None:
    me = os.getpid()
    meter = CpuMeter({}, None, set(), {"servers": (me, me)})
    meter.start()
    sum(i * i for i in range(200_000))
    usage = meter.stop()
    assert usage["servers_cpu_pct"] is not None
    assert usage["servers_cpu_pct"] >= usage["harness_cpu_pct"]  # this process, counted twice


def test_the_replicated_stack_lives_beside_the_stack_s_state_dir(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("MILPA_STACK_DIR", str(tmp_path / ".run-bench"))
    assert harness.cluster_stack_dir() == tmp_path / ".run-bench-cluster"
    assert harness.CLUSTER_UP == ("up", "--brokers", "3", "--redis-cluster")


def test_the_watcher_reads_each_partition_s_marks_in_one_call_of_one_hash_slot() -> None:
    keys = Keys("bench", partitions=6)
    sessions = {f"s{i}": keys.partition_of(f"s{i}") for i in range(40)}
    groups, calls = marks_calls(keys, sessions)
    assert len(calls) == len(set(sessions.values())) == len(groups)
    assert sorted(sid for group in groups for sid in group) == sorted(sessions)
    for group, call in zip(groups, calls, strict=True):
        assert call[0] == "EVALSHA"
        assert call[2] == len(group)
        named = call[3:]
        assert list(named) == [keys.session(sid).state for sid in group]
        assert len({key_slot(k.encode()) for k in named}) == 1
