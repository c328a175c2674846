"""The metrics endpoint binds where its settings say: loopback by default."""

from __future__ import annotations

import socket
import urllib.request

from processors.metrics import Metrics
from processors.settings import WorkerSettings
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
