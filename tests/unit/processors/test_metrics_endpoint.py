"""The metrics endpoint binds where its settings say: loopback by default."""

from __future__ import annotations

import socket
import urllib.request

from prometheus_client.exposition import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from processors.metrics import Metrics
from processors.scheduler import SchedulerStats
from processors.settings import WorkerSettings
from processors.snapshots import SnapshotStats
from processors.worker import WorkerStats


def test_the_metrics_bind_address_is_a_setting_and_defaults_to_loopback() -> None:
    assert WorkerSettings().metrics_host == "127.0.0.1"
    assert WorkerSettings.from_env({"MILPA_METRICS_HOST": "0.0.0.0"}).metrics_host == "0.0.0.0"
    metrics = Metrics(WorkerStats, lambda: None, dict)
    port = metrics.serve(0, "127.0.0.2")  # another loopback address: only it answers
    try:
        with urllib.request.urlopen(f"http://127.0.0.2:{port}/metrics", timeout=5) as r:
            assert b"milpa_" in r.read()
        with socket.socket() as probe:
            assert probe.connect_ex(("127.0.0.1", port)) != 0
    finally:
        metrics.stop()


def test_the_snapshot_rounds_are_metrics_too() -> None:
    stats = SnapshotStats(rounds=3, snapshots=40, failures=1, bytes=9000, too_large=2, stubs=7)
    stats.checkpoint_lag.update({0: 5, 3: 0})
    taker: list[SnapshotStats] = []
    metrics = Metrics(WorkerStats, lambda: None, dict, lambda: taker[0] if taker else None)

    def scrape() -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        text = generate_latest(metrics.registry).decode()
        return {
            (s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text)
            for s in family.samples
        }

    assert scrape()[("milpa_snapshot_rounds_total", ())] == 0  # snapshots off, or not yet
    taker.append(stats)
    got = scrape()
    assert got[("milpa_snapshot_rounds_total", ())] == 3
    assert got[("milpa_snapshots_total", ())] == 40
    assert got[("milpa_snapshot_failures_total", ())] == 1
    assert got[("milpa_snapshot_bytes_total", ())] == 9000
    assert got[("milpa_snapshots_too_large_total", ())] == 2
    assert got[("milpa_snapshot_stubs_total", ())] == 7
    assert got[("milpa_snapshot_checkpoint_lag", (("partition", "0"),))] == 5
    assert got[("milpa_snapshot_checkpoint_lag", (("partition", "3"),))] == 0


def test_the_timer_s_restarts_and_hangs_are_metrics() -> None:
    stats = SchedulerStats(closings=4, timer_restarts=3, timer_hangs=1)
    text = generate_latest(Metrics(WorkerStats, lambda: stats, dict).registry).decode()
    got = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}
    assert got["milpa_timer_restarts_total"] == 3 and got["milpa_timer_hangs_total"] == 1
