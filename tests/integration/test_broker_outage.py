"""A broker of this test's own: a worker started before it waits, then serves; an outage is quiet.

The shared broker cannot be stopped under the other tests, so this test starts one more
single-node Kafka (deploy/stack.py with a state directory of its own, the jars already resolved)
on ports it chose, after the worker. The outage is the broker's process ended and, 20 s later,
started again with the same command line and data.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from deploy.harness import Proc, free_port, stack_command, wait_for
from deploy.stack import port_open
from milpa_sessions.settings import Settings
from producers.kafka_log import KafkaEventLog
from projections.redis_store import RedisProjectionStore
from tests.integration.conftest import with_keys
from tests.unit.builders import started, turn

pytestmark = pytest.mark.integration

OUTAGE_S = 20.0


@pytest.fixture
def own_broker(tmp_path: Path) -> Iterator[dict[str, Any]]:
    """Ports for a broker not started yet, and how to start, stop and restart it."""
    state = tmp_path / "stack"
    kport, cport = free_port(), free_port()
    env = {
        **os.environ,
        "MILPA_STACK_DIR": str(state),
        "MILPA_KAFKA_PORT": str(kport),
        "MILPA_KAFKA_CONTROLLER_PORT": str(cport),
    }
    broker: dict[str, Any] = {"bootstrap": f"127.0.0.1:{kport}", "port": kport}

    def up() -> None:
        done = stack_command("up", env=env, timeout=300, check=False)
        assert done.returncode == 0, done.stderr[-2000:]
        pid = int((state / "kafka.pid").read_text().split()[0])
        broker["cmdline"] = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[:-1]
        broker["cwd"] = os.readlink(f"/proc/{pid}/cwd")
        broker["pid"] = pid

    def stop() -> None:
        os.kill(broker["pid"], signal.SIGTERM)
        deadline = time.monotonic() + 60
        while Path(f"/proc/{broker['pid']}").exists() and time.monotonic() < deadline:
            if Path(f"/proc/{broker['pid']}/stat").read_text().split()[2] == "Z":
                break
            time.sleep(0.1)
        wait_for(lambda: not port_open(kport), timeout=30)

    def restart() -> None:
        proc = Proc.start(
            "kafka", broker["cmdline"], state / "kafka-restart.log", cwd=broker["cwd"]
        )
        broker["pid"] = proc.pid
        broker["proc"] = proc
        wait_for(lambda: port_open(kport), timeout=90)

    broker.update(up=up, stop=stop, restart=restart)
    yield broker
    if "proc" in broker:
        broker["proc"].stop(60)
    stack_command("down", env=env, timeout=120, check=False)


def _seq(projections: RedisProjectionStore, sid: str) -> int:
    session = projections.load(sid)
    return -1 if session is None else session.seq


@pytest.mark.plain_stack  # a plaintext service of its own
def test_a_worker_started_before_the_broker_serves_once_it_is_up_and_an_outage_is_quiet(
    settings: Settings,
    projections: RedisProjectionStore,
    start_worker: Any,
    own_broker: dict[str, Any],
) -> None:
    s = with_keys(settings, kafka_bootstrap=own_broker["bootstrap"], startup_status_every=2.0)
    worker = start_worker(s)
    wait_for(lambda: "waiting for Kafka" in worker.log(), timeout=30)
    time.sleep(3)
    assert worker.alive(), worker.log()[-2000:]
    waiting = worker.log().count("waiting for Kafka")
    assert 1 <= waiting <= 4, worker.log()[-2000:]  # one status line every 2 s, not per attempt

    own_broker["up"]()
    log = KafkaEventLog(own_broker["bootstrap"], s.events_topic)
    try:
        log.append(started("wait for the broker", session_id="s-late"))
        log.append(turn("user", "one", session_id="s-late"))
        wait_for(lambda: _seq(projections, "s-late") == 2, timeout=120)
        assert "reachable after" in worker.log()
    finally:
        log.close(timeout=5)
    # (This process's producer is closed during the outage: kafka-python drops the sockets of
    # its failed reconnects unclosed, which warnings-as-errors would report here.)

    # The outage: the broker's process ends; 20 s later it starts again with its data.
    own_broker["stop"]()
    before = len(worker.log().splitlines())
    time.sleep(OUTAGE_S)
    during = worker.log().splitlines()[before:]
    assert worker.alive(), worker.log()[-3000:]
    assert len(during) <= 3 * OUTAGE_S, (len(during), "\n".join(during[-40:]))
    own_broker["restart"]()
    log = KafkaEventLog(own_broker["bootstrap"], s.events_topic)
    try:
        log.append(turn("user", "after the outage", session_id="s-late"))
        wait_for(lambda: _seq(projections, "s-late") == 3, timeout=120)
    finally:
        log.close(timeout=5)
    assert worker.alive()
